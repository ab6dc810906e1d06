//! One volume's write-back lane: at most one write-back step of the
//! volume runs at a time. Taking a lane is a flag under a mutex, not the
//! mutex itself, so a writer that only needs the volume to move on can
//! wait for the running step to end (a condition variable) instead of
//! racing the lane's other takers for it: with a mutex held across a step,
//! a slow origin's own writers and the background won it again and again
//! and a writer of another volume waited for many steps (measured:
//! 15-1,100 IOPS instead of ~3,000 in `bench/slow_origin.sh`).

use std::sync::{Condvar, Mutex, MutexGuard};

#[derive(Debug, Default)]
struct LaneState {
    busy: bool,
    /// Steps ended so far: what a waiter for "the running step" watches.
    steps_ended: u64,
}

#[derive(Debug, Default)]
pub(crate) struct WriteLane {
    state: Mutex<LaneState>,
    changed: Condvar,
}

/// The lane, taken: dropping it ends the step (also on unwinding).
pub(crate) struct LaneTaken<'a> {
    lane: &'a WriteLane,
}

impl WriteLane {
    fn state(&self) -> MutexGuard<'_, LaneState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, g: MutexGuard<'a, LaneState>) -> MutexGuard<'a, LaneState> {
        self.changed.wait(g).unwrap_or_else(|p| p.into_inner())
    }

    /// Take the lane if no step runs.
    pub(crate) fn try_take(&self) -> Option<LaneTaken<'_>> {
        let mut g = self.state();
        if g.busy {
            return None;
        }
        g.busy = true;
        Some(LaneTaken { lane: self })
    }

    /// Take the lane, waiting for running steps to end.
    pub(crate) fn take(&self) -> LaneTaken<'_> {
        let mut g = self.state();
        // Not bounded by a count: each wake-up is a step that ended, and
        // a step ends when its origin answers (every origin has deadlines).
        while g.busy {
            g = self.wait(g);
        }
        g.busy = true;
        LaneTaken { lane: self }
    }

    /// Take the lane if no step runs; otherwise wait for the running step
    /// to end and return `None` (the caller checks whether it still needs
    /// a step).
    pub(crate) fn take_or_wait(&self) -> Option<LaneTaken<'_>> {
        let mut g = self.state();
        if !g.busy {
            g.busy = true;
            return Some(LaneTaken { lane: self });
        }
        let running = g.steps_ended;
        while g.busy && g.steps_ended == running {
            g = self.wait(g);
        }
        None
    }
}

impl Drop for LaneTaken<'_> {
    fn drop(&mut self) {
        let mut g = self.lane.state();
        assert!(g.busy, "a taken lane is busy");
        g.busy = false;
        g.steps_ended += 1;
        drop(g);
        self.lane.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::WriteLane;
    use std::time::Duration;

    #[test]
    fn a_lane_runs_one_step_and_waiters_see_it_end() {
        let lane = WriteLane::default();
        let taken = lane.try_take().expect("free");
        assert!(lane.try_take().is_none(), "one step at a time");
        std::thread::scope(|s| {
            let waiter = s.spawn(|| lane.take_or_wait().is_none());
            let taker = s.spawn(|| {
                drop(lane.take());
                true
            });
            std::thread::sleep(Duration::from_millis(50));
            assert!(!waiter.is_finished() && !taker.is_finished());
            drop(taken);
            assert!(
                waiter.join().expect("waiter"),
                "the waiter saw the step end"
            );
            assert!(taker.join().expect("taker"));
        });
        assert!(lane.try_take().is_some(), "free again");
    }
}
