//! Group commit: barriers made outside the engine lock, shared by every
//! flush that arrives while one is in progress; with
//! `EngineConfig::barriers_in_flight_max` above 1 (the tests; the daemon
//! runs 1), several at once.
//!
//! A flush (or FUA write) seals what is open as an epoch-end record under
//! the engine lock, without writing it, and then waits until every record
//! up to it is durable. If a barrier in progress already covers its
//! record, it waits for that one (a *follower*). Otherwise it *leads* a
//! barrier, if one of the cache device's flush lanes is free: it takes
//! the records nobody is writing, writes them (adjacent records in one
//! `pwritev`), waits for those other barriers and record writers are
//! writing, and makes one `fdatasync` through its lane, all without the
//! engine lock, so reads and writes go on meanwhile. With every lane busy
//! it follows too. Whenever a barrier ends, its followers look again:
//! those it covered are answered, the rest follow or lead another. A flush
//! is answered only once its record and every record sealed before it are
//! durable; barriers may end out of order, and the newest covers the rest.
//!
//! Barriers overlap because this kind of disk answers overlapping
//! fdatasyncs far faster in all than the same ones in a row; each lane
//! syncs through its own open file description so that a write-back error
//! reaches every overlapping sync (see `cairn_device::Device::flush_lanes`).
//!
//! The leader makes the barrier in its own thread: on the fsync-bound
//! benchmark a hand-off to another thread per flush cost 25-30 us (see
//! `docs/design.md`). Followers wait as tasks (a oneshot), not threads.

use std::sync::{Arc, Mutex, MutexGuard};

use cairn_device::DeviceError;
use cairn_io::oneshot;

use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::flush_by::FlushBy;
use crate::log::BarrierPlan;
use crate::retry::retrying_cache_write;
use crate::sealed::SealedRecord;
use crate::state_lock::StateLock;
use crate::stats::Counters;

/// Rounds a flush waits at most: each round ends with a barrier completed,
/// and the second barrier after a record was sealed covers it.
const WAIT_ROUNDS_MAX: usize = 10_000;

/// Barriers in progress at once, at most, whatever the configuration
/// (`EngineConfig::barriers_in_flight_max`; fewer when the cache device
/// has fewer flush lanes).
const BARRIERS_IN_FLIGHT_LIMIT: usize = 4;

/// A barrier in progress.
struct InProgress {
    /// The cache device's flush lane it syncs through.
    lane: usize,
    /// The sequence it makes durable, once its plan is made.
    covers: Option<u64>,
}

#[derive(Default)]
struct CommitState {
    in_progress: Vec<InProgress>,
    /// Flushes waiting for a barrier in progress to end.
    followers: Vec<oneshot::Sender<()>>,
}

#[derive(Default)]
pub(crate) struct GroupCommit {
    state: Mutex<CommitState>,
}

/// What a flush does this round.
enum Role {
    /// Wait for a barrier in progress to end, then look again.
    Follow(oneshot::Receiver<()>),
    /// Make a barrier through this flush lane.
    Lead(usize),
}

impl GroupCommit {
    fn lock(&self) -> MutexGuard<'_, CommitState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait until every record up to `target` is durable, making a
    /// barrier when no barrier in progress covers it and a flush lane is
    /// free. A barrier counts in `flush_barriers` when a client's flush
    /// leads it.
    pub(crate) async fn wait_durable(
        &self,
        env: &Env,
        state: &StateLock,
        target: u64,
        by: FlushBy,
    ) -> EngineResult<()> {
        let lanes = env
            .cache
            .flush_lanes()
            .min(env.config.barriers_in_flight_max)
            .clamp(1, BARRIERS_IN_FLIGHT_LIMIT);
        let mut followed = false;
        for _ in 0..WAIT_ROUNDS_MAX {
            if state.normal(env)?.log.durable_sequence() >= target {
                if followed {
                    Counters::add(&env.counters.group_commit_joins, 1);
                }
                return Ok(());
            }
            match self.role(target, lanes, env) {
                Role::Follow(rx) => {
                    followed = true;
                    // Woken when a barrier ends (or its leader is gone):
                    // look again either way.
                    let _ = rx.await;
                }
                Role::Lead(lane) => {
                    // Gives up the lane and wakes the followers when the
                    // barrier ends, also if it unwinds.
                    let _leading = Leading { commit: self, lane };
                    barrier(env, state, by, lane, |covers| self.covers(lane, covers))?;
                }
            }
        }
        Err(EngineError::Failed(format!(
            "a flush waited for {WAIT_ROUNDS_MAX} barriers without becoming durable"
        )))
    }

    /// Follow a barrier in progress that covers `target`; else lead one
    /// through a free lane; else wait for a lane.
    fn role(&self, target: u64, lanes: usize, env: &Env) -> Role {
        let mut cs = self.lock();
        assert!(cs.in_progress.len() <= lanes);
        let covered = cs
            .in_progress
            .iter()
            .any(|b| b.covers.is_some_and(|c| c >= target));
        if !covered && cs.in_progress.len() < lanes {
            let lane = (0..lanes)
                .find(|l| cs.in_progress.iter().all(|b| b.lane != *l))
                .expect("fewer barriers in progress than lanes: one is free");
            if !cs.in_progress.is_empty() {
                Counters::add(&env.counters.overlapped_barriers, 1);
            }
            cs.in_progress.push(InProgress { lane, covers: None });
            return Role::Lead(lane);
        }
        let (tx, rx) = oneshot::channel();
        cs.followers.push(tx);
        Role::Follow(rx)
    }

    /// The barrier in `lane` made its plan: it makes `covers` durable.
    fn covers(&self, lane: usize, covers: u64) {
        let mut cs = self.lock();
        let barrier = cs
            .in_progress
            .iter_mut()
            .find(|b| b.lane == lane)
            .expect("a barrier plans while it holds its lane");
        assert!(barrier.covers.is_none(), "one plan per barrier");
        barrier.covers = Some(covers);
    }
}

/// The lead of a barrier: dropped when the barrier ends, however it ends,
/// it frees the lane and wakes the flushes that waited (each looks again:
/// answered, still covered by another barrier, or leading the next). A
/// leader that unwound from a panic without this kept its lane: with one
/// lane, every later flush and FUA write on every connection waited for
/// it forever.
struct Leading<'a> {
    commit: &'a GroupCommit,
    lane: usize,
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        let followers = {
            let mut cs = self.commit.lock();
            let before = cs.in_progress.len();
            cs.in_progress.retain(|b| b.lane != self.lane);
            assert_eq!(cs.in_progress.len() + 1, before, "a lane is held once");
            std::mem::take(&mut cs.followers)
        };
        for follower in followers {
            follower.send(());
        }
    }
}

/// One barrier over everything sealed so far, outside the engine lock,
/// synced through flush lane `lane`. `planned` learns the sequence it will
/// make durable as soon as that is known. Other barriers may be in
/// progress: this one waits for the records they write to be on the
/// device before its fdatasync, and for their outcome (their own syncs)
/// only after it, before it vouches for anything.
fn barrier(
    env: &Env,
    state: &StateLock,
    by: FlushBy,
    lane: usize,
    planned: impl FnOnce(u64),
) -> EngineResult<()> {
    let plan = {
        let mut st = state.normal(env)?;
        if st.log.durable_sequence() >= st.log.last_sequence() {
            return Ok(());
        }
        st.log.barrier_plan()
    };
    // The records this barrier took on are published whatever happens,
    // a panic in `planned` included.
    let _claimed = crate::sealed::ClaimGuard::new(&plan.to_write, &env.record_io);
    planned(plan.target);
    // Records another call is writing must be on the device before the
    // fdatasync that vouches for them; another barrier's sync need not
    // have ended yet (its outcome is waited for after ours).
    for record in &plan.in_flight {
        record.wait_on_device(env);
    }
    if let Err(e) = write_and_sync(env, &plan, lane) {
        return Err(env.health.cache_write_failed("sealing a log record", e));
    }
    // The others' records are done before this barrier moves the durable
    // position past them, so every record behind it has its outcome
    // published (write-back and degraded mode's drain rely on that). Since
    // the settle in `write_and_sync`, this wait no longer guards against a
    // failed sync beside ours (the settle does); a barrier in another lane
    // publishes its records right after its own settle.
    for record in &plan.in_flight {
        record.wait_done(env);
    }
    Counters::add(&env.counters.cache_barriers, 1);
    if by == FlushBy::Client {
        Counters::add(&env.counters.flush_barriers, 1);
    }
    let mut st = state.normal(env)?;
    // A record another call wrote may have failed: that is a failed
    // barrier too (the queue reports it).
    st.log.prune_sealed(env)?;
    st.log.barrier_done(plan.target);
    Ok(())
}

/// Write the plan's records, adjacent ones in one `pwritev`, then one
/// fdatasync through `lane`; publish each record's outcome. Once a run is
/// written its records are marked on the device, so a barrier in another
/// lane waits for this write (its own sync covers it), not for this sync.
/// A failed write may be retried (no barrier is involved); a failed sync
/// only together with a write of everything unsynced: after a failed
/// fsync, earlier writes may be gone (Linux drops cached pages whose
/// write-back failed), and syncing again cannot bring them back.
fn write_and_sync(env: &Env, plan: &BarrierPlan, lane: usize) -> Result<(), DeviceError> {
    let runs = adjacent_runs(&plan.to_write);
    let written_blocks: u64 = plan
        .to_write
        .iter()
        .map(|r| r.length_bytes() / env.block_size_bytes as u64)
        .sum();
    let whole =
        plan.in_flight.is_empty() && runs.len() == 1 && written_blocks == plan.unsynced_blocks;
    let write_run = |run: &[&SealedRecord]| -> Result<(), DeviceError> {
        let bufs = run_bufs(run);
        env.cache.write_vectored_inline(run[0].at_bytes, &bufs)?;
        for record in run {
            record.mark_on_device(env);
        }
        Ok(())
    };
    // Every sync of this barrier (a retry included) is watched: another
    // barrier vouches for nothing while it runs, and not at all if it
    // fails. A sync that succeeded vouches only once the syncs running
    // beside it ended and none of the device's ever failed (one that
    // failed may have lost this barrier's records before this sync was
    // served). Only then are the records published as written.
    let sync = || {
        if whole {
            // One client's flush alone (W1): a retry covers write and sync, as
            // long as nothing else went to the device since the plan. A failed
            // sync may have lost every write not yet durable, and records
            // sealed after the plan may have been written meanwhile (a record
            // writer's, another lane's barrier's): rewriting this run would
            // not bring them back, and a later sync would vouch for them. Any
            // write since the plan is of a record sealed since: a sync failure
            // then is final.
            let run = &runs[0];
            retrying_cache_write(env, "sealing a log record", true, || {
                write_run(run)?;
                match env.cache.flush_lane(lane) {
                    Ok(()) => Ok(Ok(())),
                    Err(e) if env.record_io.sealed_through() > plan.target => {
                        Counters::add(&env.counters.cache_write_errors, 1);
                        Ok(Err(e))
                    }
                    Err(e) => Err(e),
                }
            })
            .and_then(|synced| synced)
        } else {
            runs.iter()
                .try_for_each(|run| {
                    retrying_cache_write(env, "sealing a log record", true, || write_run(run))
                })
                .and_then(|()| {
                    retrying_cache_write(env, "flushing the cache device", false, || {
                        env.cache.flush_lane(lane)
                    })
                })
        }
    };
    let result = env.syncs.vouching(env.cache.name(), sync);
    let outcome = result.as_ref().map(|_| ()).map_err(|e| e.to_string());
    for record in &plan.to_write {
        record.publish(env, outcome.clone());
    }
    result
}

/// The records in runs that lie back to back on the device.
fn adjacent_runs(records: &[Arc<SealedRecord>]) -> Vec<Vec<&SealedRecord>> {
    runs_by(records.iter().map(|r| &**r), |r| {
        (r.at_bytes, r.length_bytes())
    })
}

/// Items split into runs of neighbours: each item starts where the one
/// before it in its run ends (`span` gives start and length in bytes).
fn runs_by<'a, T>(
    items: impl Iterator<Item = &'a T>,
    span: impl Fn(&T) -> (u64, u64),
) -> Vec<Vec<&'a T>> {
    let mut runs: Vec<Vec<&'a T>> = Vec::new();
    for item in items {
        let (at, _) = span(item);
        match runs.last_mut() {
            Some(run)
                if run.last().is_some_and(|prev| {
                    let (prev_at, prev_len) = span(prev);
                    prev_at + prev_len == at
                }) =>
            {
                run.push(item)
            }
            _ => runs.push(vec![item]),
        }
    }
    runs
}

fn run_bufs<'a>(run: &[&'a SealedRecord]) -> Vec<&'a [u8]> {
    run.iter().flat_map(|r| r.bufs()).collect()
}

#[cfg(test)]
mod tests {
    use super::runs_by;

    #[test]
    fn only_neighbours_share_a_run() {
        // (start, length): 0..8 and 8..12 touch; 20..24 stands alone (a lap
        // skip between records); 24..32 follows it; 0..4 after a wrap.
        let spans = [(0u64, 8u64), (8, 4), (20, 4), (24, 8), (0, 4)];
        let runs = runs_by(spans.iter(), |&(at, len)| (at, len));
        let starts: Vec<Vec<u64>> = runs
            .iter()
            .map(|run| run.iter().map(|s| s.0).collect())
            .collect();
        assert_eq!(starts, vec![vec![0, 8], vec![20, 24], vec![0]]);
        assert!(runs_by(std::iter::empty::<&(u64, u64)>(), |&(a, l)| (a, l)).is_empty());
    }
}
