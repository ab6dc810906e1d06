//! Group commit: barriers made outside the engine lock, shared by every
//! flush that arrives while one is in progress.
//!
//! A flush (or FUA write) seals what is open as an epoch-end record under
//! the engine lock, without writing it, and then waits until every record
//! up to it is durable. The first waiter becomes the *leader*: it takes the
//! records nobody is writing, writes them (adjacent records in one
//! `pwritev`) and makes one `fdatasync`, all without the engine lock, so
//! reads and writes go on meanwhile. Flushes that arrive during that
//! barrier register as followers; when it ends they all look again: those
//! it covered are answered, and one of the rest leads the next barrier,
//! which covers everything sealed before it started. A flush is answered
//! only once its record and every record sealed before it are durable.
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

#[derive(Default)]
struct CommitState {
    leading: bool,
    /// Flushes waiting for the barrier in progress to end.
    followers: Vec<oneshot::Sender<()>>,
}

#[derive(Default)]
pub(crate) struct GroupCommit {
    state: Mutex<CommitState>,
}

impl GroupCommit {
    fn lock(&self) -> MutexGuard<'_, CommitState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait until every record up to `target` is durable, making the
    /// barrier if nobody else is. A barrier counts in `flush_barriers`
    /// when a client's flush leads it.
    pub(crate) async fn wait_durable(
        &self,
        env: &Env,
        state: &StateLock,
        target: u64,
        by: FlushBy,
    ) -> EngineResult<()> {
        let mut followed = false;
        for _ in 0..WAIT_ROUNDS_MAX {
            if state.normal(env)?.log.durable_sequence() >= target {
                if followed {
                    Counters::add(&env.counters.group_commit_joins, 1);
                }
                return Ok(());
            }
            let follower = {
                let mut cs = self.lock();
                if cs.leading {
                    let (tx, rx) = oneshot::channel();
                    cs.followers.push(tx);
                    Some(rx)
                } else {
                    cs.leading = true;
                    None
                }
            };
            if let Some(rx) = follower {
                followed = true;
                // Woken when that barrier ends (or its leader is gone):
                // look again either way.
                let _ = rx.await;
                continue;
            }
            let result = {
                // Gives up the lead and wakes the followers when the
                // barrier ends, also if it unwinds.
                let _leading = Leading(self);
                barrier(env, state, by)
            };
            result?;
        }
        Err(EngineError::Failed(format!(
            "a flush waited for {WAIT_ROUNDS_MAX} barriers without becoming durable"
        )))
    }
}

/// The lead of a barrier: dropped when the barrier ends, however it ends,
/// it lets the next flush lead and wakes the flushes that waited. A leader
/// that unwound from a panic without this left `leading` set: every later
/// flush and FUA write on every connection waited for it forever.
struct Leading<'a>(&'a GroupCommit);

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        let followers = {
            let mut cs = self.0.lock();
            cs.leading = false;
            std::mem::take(&mut cs.followers)
        };
        for follower in followers {
            follower.send(());
        }
    }
}

/// One barrier over everything sealed so far, outside the engine lock.
fn barrier(env: &Env, state: &StateLock, by: FlushBy) -> EngineResult<()> {
    let plan = {
        let mut st = state.normal(env)?;
        if st.log.durable_sequence() >= st.log.last_sequence() {
            return Ok(());
        }
        st.log.barrier_plan()
    };
    // The records this barrier took on are published whatever happens.
    let _claimed = crate::sealed::ClaimGuard::new(&plan.to_write, &env.record_io);
    // Records another call is writing must be on the device before the
    // fdatasync that vouches for them.
    for record in &plan.in_flight {
        record.wait_done(env);
    }
    if let Err(e) = write_and_sync(env, &plan) {
        return Err(env.health.cache_write_failed("sealing a log record", e));
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

/// Write the plan's records, adjacent ones in one `pwritev`, the last run
/// together with the fdatasync; publish each record's outcome. One write
/// plus barrier that covers everything unsynced may be retried; anything
/// else may not (a failed fsync may have dropped earlier writes).
fn write_and_sync(env: &Env, plan: &BarrierPlan) -> Result<(), DeviceError> {
    let runs = adjacent_runs(&plan.to_write);
    let written_blocks: u64 = plan
        .to_write
        .iter()
        .map(|r| r.length_bytes() / env.block_size_bytes as u64)
        .sum();
    let whole =
        plan.in_flight.is_empty() && runs.len() == 1 && written_blocks == plan.unsynced_blocks;
    let result = match runs.split_last() {
        None => retrying_cache_write(env, "flushing the cache device", false, || {
            env.cache.flush()
        }),
        Some((last, rest)) => rest
            .iter()
            .try_for_each(|run| {
                let bufs = run_bufs(run);
                retrying_cache_write(env, "sealing a log record", true, || {
                    env.cache.write_vectored_at(run[0].at_bytes, &bufs)
                })
            })
            .and_then(|()| {
                let bufs = run_bufs(last);
                retrying_cache_write(env, "sealing a log record", whole, || {
                    env.cache.write_vectored_and_flush(last[0].at_bytes, &bufs)
                })
            }),
    };
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
