//! Read-modify-write of part of one block: the only write that reads
//! anything (the old block, from memory, the cache or the origin; the
//! origin without the engine lock when the caller can wait as a task).

use cairn_format::block_checksum;

use super::origin_block::OriginBlock;
use super::Waits;
use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::index::{Plan, WriteStamp};
use crate::origin_check::check_origin_data;
use crate::retry::read_slot_retrying;
use crate::state::State;
use crate::stats::Counters;

/// Rounds a partial write reads its block from the origin without the
/// lock, each lost to a write of the block meanwhile, before it reads
/// under the lock (which nothing can race).
const ORIGIN_READ_ROUNDS_MAX: usize = 8;

/// How far [`write_partial`] got.
pub(crate) enum Partial {
    Written,
    /// The block is not cached: the caller reads it from the origin
    /// without the lock (a miss planned with `stamp`), puts it in
    /// [`PartialReads`] and calls again.
    NeedsOriginBlock {
        stamp: WriteStamp,
    },
}

/// A write's reads of the blocks it covers in part (see [`Partial`]).
#[derive(Debug, Default)]
pub(crate) struct PartialReads {
    fetched: Option<OriginBlock>,
    rounds: usize,
}

impl PartialReads {
    /// The caller read `block` (see [`Partial::NeedsOriginBlock`]).
    pub(crate) fn fetched(&mut self, block: OriginBlock) {
        self.fetched = Some(block);
    }

    /// The fetched data of `key`, if it was read for a miss planned with
    /// `stamp` (the block's current one). Taken either way: a stale block
    /// is never looked at again.
    fn take(&mut self, key: u64, stamp: WriteStamp) -> Option<Vec<u8>> {
        let fetched = self.fetched.take()?;
        (fetched.key == key && fetched.stamp == stamp).then_some(fetched.data)
    }
}

/// Write `src` at byte `within` of block `lba`, under the engine lock.
/// With [`Waits::Caller`], a block that is not cached is not read here
/// (the origin may take milliseconds, and every request waits for the
/// lock): [`Partial::NeedsOriginBlock`] says so, and the write is resumed
/// with the block in `reads`.
pub(crate) fn write_partial(
    env: &Env,
    st: &mut State,
    lba: u64,
    within: usize,
    src: &[u8],
    waits: Waits,
    reads: &mut PartialReads,
) -> EngineResult<Partial> {
    let mut block = vec![0u8; env.block_size_bytes];
    match st.plan(env, lba, &mut block)? {
        Plan::Done => {}
        Plan::Cache { slot, crc } => {
            let read = read_slot_retrying(env, slot, &mut block);
            let ok = read.is_ok() && block_checksum(lba, &block) == crc;
            if !ok {
                match read {
                    // The device did not deliver the block: that is not
                    // corruption, and a dirty block's copy is the only one.
                    Err(e) if st.index.is_dirty(slot) => return Err(EngineError::Cache(e)),
                    Err(_) => {}
                    Ok(()) => {
                        Counters::add(&env.counters.checksum_mismatches, 1);
                        if st.index.is_dirty(slot) {
                            st.index.mark_corrupt(slot);
                            return Err(EngineError::DirtyBlockCorrupt { lba });
                        }
                    }
                }
                env.read_origin(lba, &mut block)?;
                let tag = st.tags.as_ref().and_then(|t| t.tag_of(lba));
                check_origin_data(env, lba, &block, tag)?;
                Counters::add(&env.counters.repairs, 1);
            }
        }
        Plan::Miss { tag, stamp } => {
            match reads.take(lba, stamp) {
                Some(data) => {
                    assert_eq!(data.len(), block.len(), "an origin block is one block");
                    block.copy_from_slice(&data);
                    Counters::add(&env.counters.write_rmw_unlocked_reads, 1);
                }
                None if waits == Waits::Caller && reads.rounds < ORIGIN_READ_ROUNDS_MAX => {
                    reads.rounds += 1;
                    return Ok(Partial::NeedsOriginBlock { stamp });
                }
                None => env.read_origin(lba, &mut block)?,
            }
            // The engine lock is held, so the tag is current: a mismatch is
            // real, and merging into bad data would bless it.
            check_origin_data(env, lba, &block, tag)?;
        }
    }
    block[within..within + src.len()].copy_from_slice(src);
    st.log.append_data(env, &mut st.index, lba, &block, false)?;
    Ok(Partial::Written)
}
