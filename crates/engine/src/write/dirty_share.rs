//! A volume's share of the log for dirty data. While another volume holds
//! blocks in the cache, or while its own origin fails, a volume whose
//! dirty data is at its share writes back its own data before taking more:
//! its writers wait for its origin, and only them; the rest of the log
//! stays free for the other volumes. Alone in the cache, with an origin
//! that works, a volume may fill the whole log (a burst is what a
//! write-back cache is for).

use std::sync::MutexGuard;

use crate::error::EngineResult;
use crate::parts::Parts;
use crate::state::State;
use crate::stats::Counters;
use crate::volume_set::VolumeSet;
use crate::want::Want;

use super::{Room, WaitRounds, Waits, SPACE_RETRIES_MAX};

/// The default share of the log one volume's dirty data may hold, in
/// percent, with `volume_count` volumes: half with two, a third with
/// three, a quarter with four or more (a floor, so a volume still absorbs
/// a burst); all of it with one.
pub(crate) fn default_dirty_share_pct(volume_count: usize) -> u8 {
    match volume_count {
        0 | 1 => 100,
        n => (100 / n).max(25) as u8,
    }
}

/// The most dirty blocks `volume` may hold now, or `None` while no other
/// volume holds anything in the cache (no limit then), unless its origin
/// is failing (`origin_failing`): dirty data that cannot leave then stays
/// within the volume's share whatever the others hold, so the other
/// volumes keep room to write into (a failing origin's writers took 95% of
/// the log while the others were idle, found by a black-box test).
pub(crate) fn dirty_limit_blocks(st: &State, volume: u16, origin_failing: bool) -> Option<u64> {
    let entries = st.volumes.volumes();
    let others_cached = entries.iter().any(|v| {
        let b = st.index.volume_blocks(v.id);
        v.id != volume && b.dirty + b.clean > 0
    });
    let shared = others_cached || (origin_failing && entries.len() > 1);
    if !shared {
        return None;
    }
    let pct = st
        .volumes
        .by_id(volume)
        .and_then(|v| v.dirty_share_pct)
        .unwrap_or_else(|| default_dirty_share_pct(entries.len()));
    assert!((1..=100).contains(&pct), "dirty share {pct}% out of range");
    Some(st.log.slot_count() * pct as u64 / 100)
}

/// Wait until `blocks` more dirty blocks of `volume` fit its share,
/// running write-back of that volume (and only it) meanwhile, or with
/// [`Waits::Caller`] returning the step to wait for. A volume with no dirty
/// data left always goes on, so a write larger than the share still makes
/// progress; an origin that fails fails the wait (like a full log does),
/// never another volume's writes.
pub(super) fn wait_within<'a>(
    p: Parts<'a>,
    mut st: MutexGuard<'a, State>,
    volume: u16,
    blocks: u64,
    waits: Waits,
    rounds: &mut WaitRounds,
) -> EngineResult<Room<'a>> {
    let env = p.env;
    while rounds.dirty_share < SPACE_RETRIES_MAX {
        let dirty = st.index.volume_blocks(volume).dirty;
        let failing = p.writeback.volume_origin_failing(volume);
        match dirty_limit_blocks(&st, volume, failing) {
            Some(limit) if dirty > 0 && dirty + blocks > limit => {}
            _ => return Ok(Room::Ready(st)),
        }
        if rounds.dirty_share == 0 {
            // Writes that waited, not rounds.
            Counters::add(&env.counters.dirty_share_waits, 1);
        }
        rounds.dirty_share += 1;
        if st.log.volume_writeback_position(volume) >= Some(st.log.writeback_limit()) {
            // Its dirty data is all after the last epoch end: end one now
            // so write-back can take it.
            Counters::add(&env.counters.internal_flushes, 1);
            st.flush(env)?;
        }
        drop(st);
        let want = Want::Progress(VolumeSet::single(volume));
        if waits == Waits::Caller {
            return Ok(Room::Wait(want));
        }
        if let Err(e) = p.writeback.run_group(env, p.state, want) {
            std::thread::sleep(rounds.step_failed(env, e)?);
        }
        st = p.state.normal(env)?;
    }
    Err(crate::error::EngineError::Failed(format!(
        "volume {volume} stayed over its dirty share after many write-back rounds"
    )))
}
