//! Room in the log: eviction of clean blocks at the tail (with a second
//! chance for recently hit ones, and for the blocks of a volume under its
//! share of the cache while another is over its own), persisting
//! write-back progress and checkpointing when those are what holds the
//! tail back.

use cairn_format::key_volume;

use crate::checkpoint;
use crate::env::Env;
use crate::error::EngineResult;
use crate::log::{EPOCH_END_RESERVE_BLOCKS, SECOND_CHANCE_MAX_BLOCKS, SHARE_RESCUE_MAX_BLOCKS};
use crate::state::State;
use crate::stats::Counters;
use crate::volume_set::VolumeSet;

/// Batches of protected blocks (`SHARE_RESCUE_MAX_BLOCKS` each) one
/// eviction moves at most under the engine lock: 16 MiB of 4 KiB blocks
/// read and written, so a long run of a working set delays the other
/// requests by one such batch at a time, not by its whole length.
const SHARE_BATCHES_MAX: usize = 4;

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
        rescued.extend(evict(env, st, needed)?);
        // Eviction may have moved blocks to the head: the append position
        // is where it is now.
        let from = st.log.append_position();
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
    // What still does not fit stays evicted (its data is on its origin).
    let _ = reinsert(env, st, rescued, if ready { needed } else { keep_free })?;
    if ready || st.log.append_position() + needed <= st.log.limit() {
        Ok(Space::Ready)
    } else {
        Ok(Space::NeedWriteback)
    }
}

/// Evict towards room for `needed` blocks (a little more, so rescued
/// blocks fit at the head). Returns the rescued blocks not yet moved: the
/// last batch and any an earlier one had no room for.
/// While the tail stops in front of a protected volume's block (a batch
/// full of them), the batch moves to the head at once and eviction goes
/// on, so a long run of one volume's working set moves forward whole
/// instead of losing its end to the cap. At most `SHARE_BATCHES_MAX`
/// batches per call: the moves happen under the engine lock, so a run
/// longer than that is left where the tail stopped (not evicted), the
/// caller finds too little room and retries after dropping the lock.
fn evict(env: &Env, st: &mut State, needed: u64) -> EngineResult<Vec<(u64, Vec<u8>, bool)>> {
    let slot_count = st.log.slot_count();
    let protected = protected_volumes(st);
    let keep_free = env.record_data_blocks_max + 1 + EPOCH_END_RESERVE_BLOCKS;
    let mut batches = 0;
    let mut left = Vec::new();
    loop {
        batches += 1;
        let from = st.log.append_position();
        // Room for the blocks still waiting too, with their headers.
        let waiting = left.len() as u64;
        let waiting_room = waiting + waiting.div_ceil(env.record_data_blocks_max) + 3;
        let target = (from + needed + SECOND_CHANCE_MAX_BLOCKS as u64 + 2 + waiting_room)
            .saturating_sub(slot_count);
        let (batch, stopped_at_cap) = st.log.evict_until(env, &mut st.index, target, protected);
        assert!(batch.len() <= SECOND_CHANCE_MAX_BLOCKS + SHARE_RESCUE_MAX_BLOCKS);
        // Blocks an earlier batch had no room for yet (the log was full
        // when the tail stopped short) go first; at most one batch waits.
        left.extend(batch);
        if !stopped_at_cap {
            return Ok(left);
        }
        // The tail stopped short of the target: these blocks use the room
        // it freed for them now, before the caller takes what it needs.
        left = reinsert(env, st, left, keep_free)?;
        assert!(left.len() <= 2 * (SECOND_CHANCE_MAX_BLOCKS + SHARE_RESCUE_MAX_BLOCKS));
        if batches == SHARE_BATCHES_MAX {
            return Ok(left);
        }
    }
}

/// The volumes whose clean blocks the tail moves forward instead of
/// evicting: those holding less than their share of the cache (an equal
/// split among the volumes) while another volume holds more than its own.
/// So one volume's burst, longer than the cache, evicts its own older
/// blocks and not another volume's working set. With every volume within
/// its share they are protected only while at most 3/4 of the log is live
/// (a small area rewritten laps the log too); with one volume eviction is
/// plain second chance, as it always was.
fn protected_volumes(st: &State) -> VolumeSet {
    let volumes = st.volumes.volumes();
    if volumes.len() < 2 {
        return VolumeSet::EMPTY;
    }
    let share_blocks = st.log.slot_count() / volumes.len() as u64;
    let mut under = VolumeSet::EMPTY;
    let mut someone_over = false;
    for v in volumes {
        let blocks = st.index.volume_blocks(v.id);
        let held = blocks.dirty + blocks.clean;
        if held < share_blocks {
            under.insert(v.id);
        } else if held > share_blocks {
            someone_over = true;
        }
    }
    // With nobody over, moving is still right while most of the log is
    // dead (a volume rewriting a small area laps the log without growing):
    // evicting a live block then frees nothing another block needs. Past
    // the mark, moves would cost more than they keep (each freed slot
    // could take many), and eviction is plain second chance.
    let mostly_dead = st.index.live_blocks() * 4 <= st.log.slot_count() * 3;
    if someone_over || mostly_dead {
        under
    } else {
        VolumeSet::EMPTY
    }
}

/// Re-insert rescued blocks (second chance, share) at the head as clean
/// copies, if that still leaves `needed` blocks free; otherwise they stay
/// evicted.
fn reinsert(
    env: &Env,
    st: &mut State,
    rescued: Vec<(u64, Vec<u8>, bool)>,
    needed: u64,
) -> EngineResult<Vec<(u64, Vec<u8>, bool)>> {
    let mut rescued = rescued.into_iter();
    for (lba, block, for_share) in rescued.by_ref() {
        // A block of a volume being removed is not moved forward, nor one
        // written again since it was picked.
        if st.index.is_cached(lba) || !env.origins.takes_new_data(lba) {
            continue;
        }
        // Its origin fails write-back: at the head this copy could not be
        // reclaimed until the origin is back (it would sit among the
        // volume's dirty records), and writes need that room more. Its
        // data is on its origin.
        if env.health.origin_failing(key_volume(lba)) {
            continue;
        }
        // One block, a possible new header and lap skip, plus the room the
        // caller asked for. Without it, this block and the rest go back.
        if st.log.append_position() + 3 + needed > st.log.limit() {
            let mut left = vec![(lba, block, for_share)];
            left.extend(rescued);
            return Ok(left);
        }
        st.log.append_data(env, &mut st.index, lba, &block, true)?;
        if for_share {
            Counters::add(&env.counters.share_moves, 1);
        } else {
            Counters::add(&env.counters.second_chances, 1);
        }
    }
    Ok(Vec::new())
}

/// Insert a clean copy (a read fill or a repair). Returns false if there
/// was no room without evicting dirty data, or the cache is no longer
/// written (then nothing is inserted).
pub(crate) fn promote(env: &Env, st: &mut State, lba: u64, block: &[u8]) -> EngineResult<bool> {
    if !env.health.cache_writable() {
        return Ok(false);
    }
    // As for second chance (`reinsert`): while the volume's origin fails
    // write-back, a new clean copy would take room its writes need and
    // could not be reclaimed before the origin is back.
    if env.health.origin_failing(key_volume(lba)) {
        return Ok(false);
    }
    if !matches!(ensure_space(env, st, 1)?, Space::Ready) {
        return Ok(false);
    }
    st.log.append_data(env, &mut st.index, lba, block, true)?;
    Ok(true)
}
