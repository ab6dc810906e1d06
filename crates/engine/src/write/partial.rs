//! Read-modify-write of part of one block: the only write that reads
//! anything (the old block, from memory, the cache or the origin; the
//! origin without the engine lock when the caller can wait as a task).

use cairn_format::block_checksum;

use super::origin_block::OriginBlock;
use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::index::{Plan, WriteStamp};
use crate::origin_check::check_origin_data;
use crate::read_kind::ReadKind;
use crate::retry::read_slot_retrying;
use crate::state::State;
use crate::stats::Counters;

/// Rounds a partial write reads its block from the origin without the
/// lock, each lost to a write of the block meanwhile, before it reads
/// under the lock (which nothing can race).
const ORIGIN_READ_ROUNDS_MAX: usize = 8;

/// Blocks one write covers in part: its first and its last.
const EDGE_BLOCKS_MAX: usize = 2;

/// A write's blocks covered in part, read from the origin without the
/// lock before any of the write went into the log (see
/// `write::write_from`).
#[derive(Debug, Default)]
pub(crate) struct PartialReads {
    fetched: Vec<OriginBlock>,
    /// Reads made so far, bounded by [`ORIGIN_READ_ROUNDS_MAX`].
    rounds: usize,
}

impl PartialReads {
    /// The caller read `block` (see `WriteStep::NeedsOriginBlock`).
    pub(crate) fn fetched(&mut self, block: OriginBlock) {
        self.fetched.retain(|b| b.key != block.key);
        assert!(
            self.fetched.len() < EDGE_BLOCKS_MAX,
            "a write has two edges"
        );
        self.fetched.push(block);
    }

    /// Does this write hold `key` as read for a miss with `stamp`?
    fn holds(&self, key: u64, stamp: WriteStamp) -> bool {
        self.fetched
            .iter()
            .any(|b| b.key == key && b.stamp == stamp)
    }

    /// Should the write stop, before it logs anything, to read edge block
    /// `key` (its origin stamp `stamp`) without the lock? Counts the round.
    pub(crate) fn wants_read(&mut self, key: u64, stamp: WriteStamp) -> bool {
        if self.holds(key, stamp) || self.rounds >= ORIGIN_READ_ROUNDS_MAX {
            return false;
        }
        self.rounds += 1;
        true
    }

    /// The fetched data of `key`, if it was read for a miss planned with
    /// `stamp` (the block's current one). Taken either way: a stale block
    /// is never looked at again.
    fn take(&mut self, key: u64, stamp: WriteStamp) -> Option<Vec<u8>> {
        let at = self.fetched.iter().position(|b| b.key == key)?;
        let fetched = self.fetched.swap_remove(at);
        (fetched.stamp == stamp).then_some(fetched.data)
    }
}

/// Write `src` at byte `within` of block `lba`, under the engine lock. A
/// block that is not cached is merged into the copy in `reads` if it is
/// still current, else read from the origin here. Counted in `write_rmw`,
/// and the old contents by where they came from (`write_rmw_hits`,
/// `_zero_hits`, `_origin_reads`), never as a client read: a client that
/// only writes leaves the read counters and the hit ratio alone.
pub(crate) fn write_partial(
    env: &Env,
    st: &mut State,
    lba: u64,
    within: usize,
    src: &[u8],
    reads: &mut PartialReads,
) -> EngineResult<()> {
    let c = &env.counters;
    Counters::add(&c.write_rmw, 1);
    let kind = ReadKind::WriteBase;
    let mut block = vec![0u8; env.block_size_bytes];
    // In memory or in a zeroed range: counted by `plan`.
    match st.plan(env, lba, kind, &mut block)? {
        Plan::Done => {}
        Plan::Cache { slot, crc } => {
            let read = read_slot_retrying(env, slot, &mut block);
            let ok = read.is_ok() && block_checksum(lba, &block) == crc;
            if ok {
                Counters::add(kind.hits(c), 1);
            } else {
                match read {
                    // The device did not deliver the block: that is not
                    // corruption, and a dirty block's copy is the only one.
                    Err(e) if st.index.is_dirty(slot) => return Err(EngineError::Cache(e)),
                    Err(_) => {}
                    Ok(()) => {
                        Counters::add(&c.checksum_mismatches, 1);
                        if st.index.is_dirty(slot) {
                            st.index.mark_corrupt(slot);
                            return Err(EngineError::DirtyBlockCorrupt { lba });
                        }
                    }
                }
                crate::origin_retry::read_origin(env, lba, &mut block)?;
                Counters::add(kind.misses(c), 1);
                let tag = st.tags.as_ref().and_then(|t| t.tag_of(lba));
                check_origin_data(env, lba, &block, tag)?;
                Counters::add(&c.repairs, 1);
            }
        }
        Plan::Miss { tag, stamp } => {
            match reads.take(lba, stamp) {
                Some(data) => {
                    assert_eq!(data.len(), block.len(), "an origin block is one block");
                    block.copy_from_slice(&data);
                    Counters::add(&c.write_rmw_unlocked_reads, 1);
                }
                // Not read beforehand, or written since it was.
                None => crate::origin_retry::read_origin(env, lba, &mut block)?,
            }
            // One read used (an unlocked one found stale is not counted).
            Counters::add(kind.misses(c), 1);
            // The engine lock is held, so the tag is current: a mismatch is
            // real, and merging into bad data would bless it.
            check_origin_data(env, lba, &block, tag)?;
        }
    }
    block[within..within + src.len()].copy_from_slice(src);
    st.log.append_data(env, &mut st.index, lba, &block, false)
}
