//! Read-modify-write of part of one block: the only write that reads
//! anything (the old block, from memory, the cache or the origin).

use cairn_format::block_checksum;

use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::index::Plan;
use crate::origin_check::check_origin_data;
use crate::retry::read_slot_retrying;
use crate::state::State;
use crate::stats::Counters;

/// Write `src` at byte `within` of block `lba`, under the engine lock.
pub(crate) fn write_partial(
    env: &Env,
    st: &mut State,
    lba: u64,
    within: usize,
    src: &[u8],
) -> EngineResult<()> {
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
        Plan::Miss { tag, .. } => {
            env.read_origin(lba, &mut block)?;
            // The engine lock is held, so the tag is current: a mismatch is
            // real, and merging into bad data would bless it.
            check_origin_data(env, lba, &block, tag)?;
        }
    }
    block[within..within + src.len()].copy_from_slice(src);
    st.log.append_data(env, &mut st.index, lba, &block, false)
}
