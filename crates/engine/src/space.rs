//! Room in the log: eviction of clean blocks at the tail (with a second
//! chance for recently hit ones), persisting write-back progress and
//! checkpointing when those are what holds the tail back.

use crate::checkpoint;
use crate::env::Env;
use crate::error::EngineResult;
use crate::log::{EPOCH_END_RESERVE_BLOCKS, SECOND_CHANCE_MAX_BLOCKS};
use crate::state::State;
use crate::stats::Counters;

/// Rounds of "evict, persist write-back, checkpoint" before giving up and
/// asking for write-back.
const SPACE_ROUNDS_MAX: usize = 4;

pub(crate) enum Space {
    Ready,
    /// The log is full of dirty data: write-back must run first.
    NeedWriteback,
}

/// Make sure `blocks` more data blocks (plus headers and a possible lap
/// skip) fit before the log's limit, reclaiming clean space as needed.
pub(crate) fn ensure_space(env: &Env, st: &mut State, blocks: u64) -> EngineResult<Space> {
    let records_max = env.record_data_blocks_max;
    let headers = blocks / records_max + 2;
    // The slack keeps room for a lap skip and for an empty epoch-end
    // record, so a flush can always seal even when the log is full of
    // dirty data (write-back needs that epoch end to make progress).
    let needed = blocks + headers + records_max + 1 + EPOCH_END_RESERVE_BLOCKS;
    let slot_count = st.log.slot_count();
    let mut rescued = Vec::new();
    let mut ready = false;
    for _ in 0..SPACE_ROUNDS_MAX {
        let from = st.log.append_position();
        if from + needed <= st.log.limit() {
            ready = true;
            break;
        }
        // 1. Evict clean slots up to the persisted write-back position,
        //    a little further than needed so second-chance blocks have
        //    room at the head.
        let target = from + needed + SECOND_CHANCE_MAX_BLOCKS as u64 + 2 - slot_count;
        rescued.extend(st.log.evict_until(env, &mut st.index, target));
        if from + needed <= st.log.limit() {
            ready = true;
            break;
        }
        // 2. Persist write-back progress so the tail may move further.
        let log = &st.log;
        if log.tail() >= log.writeback_persisted()
            && log.writeback_position() > log.writeback_persisted()
        {
            st.persist_writeback(env)?;
            continue;
        }
        // 3. The checkpoint's head is what blocks us: take a new one.
        if log.checkpoint_head() < log.tail() && log.checkpoint_head() + slot_count < from + needed
        {
            checkpoint::write(env, st)?;
            continue;
        }
        break;
    }
    // Eviction dropped a corrupt dirty block (it reads as EIO from now on):
    // that must be on the device before its slot is written again, which
    // the caller is about to do.
    if st.index.lost_unpersisted() {
        checkpoint::write(env, st)?;
        ready = st.log.append_position() + needed <= st.log.limit();
    }
    // Recently hit blocks that were evicted move to the head. They may use
    // room the caller wanted (it then waits for write-back, which frees
    // more), but never the reserve a flush needs.
    let keep_free = records_max + 1 + EPOCH_END_RESERVE_BLOCKS;
    reinsert(env, st, rescued, if ready { needed } else { keep_free })?;
    if ready || st.log.append_position() + needed <= st.log.limit() {
        Ok(Space::Ready)
    } else {
        Ok(Space::NeedWriteback)
    }
}

/// Re-insert second-chance blocks at the head as clean copies, if that
/// still leaves `needed` blocks free; otherwise they stay evicted.
fn reinsert(
    env: &Env,
    st: &mut State,
    rescued: Vec<(u64, Vec<u8>)>,
    needed: u64,
) -> EngineResult<()> {
    for (lba, block) in rescued {
        let from = st.log.append_position();
        // One block, a possible new header and lap skip, plus the room the
        // caller asked for.
        // A block of a volume being removed is not moved forward.
        if from + 3 + needed > st.log.limit()
            || st.index.is_cached(lba)
            || !env.origins.takes_new_data(lba)
        {
            continue;
        }
        st.log.append_data(env, &mut st.index, lba, &block, true)?;
        Counters::add(&env.counters.second_chances, 1);
    }
    Ok(())
}

/// Insert a clean copy (a read fill or a repair). Returns false if there
/// was no room without evicting dirty data, or the cache is no longer
/// written (then nothing is inserted).
pub(crate) fn promote(env: &Env, st: &mut State, lba: u64, block: &[u8]) -> EngineResult<bool> {
    if !env.health.cache_writable() {
        return Ok(false);
    }
    if !matches!(ensure_space(env, st, 1)?, Space::Ready) {
        return Ok(false);
    }
    st.log.append_data(env, &mut st.index, lba, block, true)?;
    Ok(true)
}
