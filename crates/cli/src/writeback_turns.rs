//! Write-back's extra threads. The engine runs one volume's steps one at
//! a time and different volumes' at once (a lane each), so while one
//! volume's step waits for a slow origin, another thread can write back
//! the others. The write-back loop decides *whether* to clean (the
//! policy); these threads follow its decision and report what they wrote,
//! so the policy's measured write-back speed and the rate limit see every
//! thread.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use cairn_engine::Engine;

/// Write-back threads at most, the loop's own included. One per volume
/// is enough (a volume's steps run one at a time); four lets three slow
/// origins hold a thread each while the fourth cleans the rest.
pub const WRITEBACK_THREADS_MAX: usize = 4;

/// Steps kept for the loop to read (it reads every 20 ms or sooner).
const STEPS_KEPT_MAX: usize = 1024;

/// How long an extra thread sleeps while the loop says there is nothing to
/// clean, unless the loop wakes it sooner. An idle daemon's extra threads
/// wake once a second each instead of 50 times (they polled every 20 ms).
/// Nothing depends on the timeout: cleaning starting and write-back
/// stopping both wake the threads; it is a safety net.
const IDLE_WAIT: Duration = Duration::from_secs(1);

/// What the loop and the extra threads share.
pub struct Turns {
    /// The loop's last decision lets write-back run.
    cleaning: Mutex<bool>,
    /// Signalled when cleaning starts and when write-back stops.
    cleaning_changed: Condvar,
    /// Steps the extra threads ran since the loop last looked:
    /// (bytes written, time taken).
    steps: Mutex<VecDeque<(u64, Duration)>>,
    /// The rate limit's window: (its start, bytes written in it).
    budget: Mutex<(Instant, u64)>,
}

impl Default for Turns {
    fn default() -> Self {
        Turns {
            cleaning: Mutex::new(false),
            cleaning_changed: Condvar::new(),
            steps: Mutex::new(VecDeque::new()),
            budget: Mutex::new((Instant::now(), 0)),
        }
    }
}

impl Turns {
    fn cleaning_flag(&self) -> std::sync::MutexGuard<'_, bool> {
        self.cleaning.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The loop's decision; the extra threads wake when cleaning starts.
    pub fn set_cleaning(&self, cleaning: bool) {
        let mut flag = self.cleaning_flag();
        let starts = cleaning && !*flag;
        *flag = cleaning;
        if starts {
            self.cleaning_changed.notify_all();
        }
    }

    /// Wake every extra thread (write-back is stopping: they look at the
    /// stop flag).
    pub fn wake_all(&self) {
        let _flag = self.cleaning_flag();
        self.cleaning_changed.notify_all();
    }

    fn cleaning(&self) -> bool {
        *self.cleaning_flag()
    }

    /// Sleep until the loop says clean, `stop` is set (with a
    /// [`Turns::wake_all`]), or `IDLE_WAIT` passes.
    fn wait_for_cleaning(&self, stop: &AtomicBool) {
        let flag = self.cleaning_flag();
        if *flag || stop.load(Ordering::SeqCst) {
            return;
        }
        // One wait: a spurious wake-up or the timeout just sends the
        // caller round its loop again.
        let _ = self
            .cleaning_changed
            .wait_timeout(flag, IDLE_WAIT)
            .unwrap_or_else(|p| p.into_inner());
    }

    /// A step of an extra thread wrote `bytes` in `elapsed`.
    fn record_step(&self, bytes: u64, elapsed: Duration) {
        let mut steps = self.steps.lock().unwrap_or_else(|p| p.into_inner());
        if steps.len() >= STEPS_KEPT_MAX {
            steps.pop_front();
        }
        steps.push_back((bytes, elapsed));
    }

    /// The extra threads' steps since the last call.
    pub fn take_steps(&self) -> Vec<(u64, Duration)> {
        let mut steps = self.steps.lock().unwrap_or_else(|p| p.into_inner());
        steps.drain(..).collect()
    }

    /// May write-back write more under a limit of `bytes_per_sec`
    /// (0: none)? The window restarts every 10 s.
    pub fn budget_allows(&self, bytes_per_sec: u64) -> bool {
        if bytes_per_sec == 0 {
            return true;
        }
        let mut budget = self.budget.lock().unwrap_or_else(|p| p.into_inner());
        let elapsed = budget.0.elapsed().as_secs_f64();
        if budget.1 > (elapsed * bytes_per_sec as f64) as u64 {
            return false;
        }
        if elapsed > 10.0 {
            *budget = (Instant::now(), 0);
        }
        true
    }

    pub fn spend(&self, bytes: u64) {
        self.budget.lock().unwrap_or_else(|p| p.into_inner()).1 += bytes;
    }
}

/// Extra write-back thread number `index` (1 and up; the loop is 0):
/// steps while the loop says clean and there are more volumes than
/// `index`, until `stop`.
pub fn extra_thread_loop(
    engine: &Engine,
    stop: &AtomicBool,
    turns: &Turns,
    index: usize,
    rate_limit_now: impl Fn() -> u64,
) {
    let block_bytes = engine.stats().block_size_bytes;
    let mut backoff_ms = 10u64;
    while !stop.load(Ordering::SeqCst) {
        if !turns.cleaning() {
            turns.wait_for_cleaning(stop);
            continue;
        }
        if index >= engine.volume_count() || !turns.budget_allows(rate_limit_now()) {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        if let Some((bytes, elapsed)) = step(engine, block_bytes, &mut backoff_ms) {
            turns.record_step(bytes, elapsed);
            turns.spend(bytes);
        }
    }
}

/// One write-back step: the bytes it wrote and the time it took. An empty
/// step sleeps 20 ms; a failed one is logged and sleeps `backoff_ms`,
/// which doubles up to 5 s until a step succeeds.
pub fn step(engine: &Engine, block_bytes: u64, backoff_ms: &mut u64) -> Option<(u64, Duration)> {
    let started = Instant::now();
    match engine.writeback_step() {
        Ok(p) => {
            *backoff_ms = 10;
            if p.groups == 0 {
                std::thread::sleep(Duration::from_millis(20));
            }
            Some((p.blocks_written * block_bytes, started.elapsed()))
        }
        Err(e) => {
            // The pause here is only this thread's; the engine also leaves a
            // failing volume out of the next steps, backing off up to about
            // 5 s, so no fixed retry time is promised.
            tracing::warn!("write-back failed; it is retried with a growing backoff: {e}");
            std::thread::sleep(Duration::from_millis(*backoff_ms));
            *backoff_ms = (*backoff_ms * 2).min(5_000);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Turns;
    use std::time::Duration;

    #[test]
    fn the_rate_limit_counts_every_threads_bytes() {
        let t = Turns::default();
        assert!(t.budget_allows(0));
        assert!(t.budget_allows(1_000));
        t.spend(1_000_000);
        assert!(!t.budget_allows(1_000), "a 1 MB step is far over 1 kB/s");
        assert!(t.budget_allows(0), "no limit");
    }

    /// How long a thread waiting for cleaning waits when `wake` runs 50 ms
    /// after it started waiting.
    fn wait_ended_by(
        t: &Turns,
        stop: &std::sync::atomic::AtomicBool,
        wake: impl FnOnce(),
    ) -> Duration {
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let started = std::time::Instant::now();
                t.wait_for_cleaning(stop);
                started.elapsed()
            });
            std::thread::sleep(Duration::from_millis(50));
            wake();
            waiter.join().expect("waiter")
        })
    }

    #[test]
    fn an_idle_extra_thread_wakes_when_cleaning_starts_or_write_back_stops() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let t = Turns::default();
        let stop = AtomicBool::new(false);
        let waited = wait_ended_by(&t, &stop, || t.set_cleaning(true));
        assert!(
            waited < super::IDLE_WAIT,
            "cleaning did not wake it ({waited:?})"
        );
        // Cleaning already: no wait at all.
        let started = std::time::Instant::now();
        t.wait_for_cleaning(&stop);
        assert!(started.elapsed() < super::IDLE_WAIT / 2);
        t.set_cleaning(false);
        let waited = wait_ended_by(&t, &stop, || {
            stop.store(true, Ordering::SeqCst);
            t.wake_all();
        });
        assert!(
            waited < super::IDLE_WAIT,
            "stopping did not wake it ({waited:?})"
        );
    }

    #[test]
    fn steps_are_handed_over_once_and_bounded() {
        let t = Turns::default();
        for i in 0..(super::STEPS_KEPT_MAX as u64 + 10) {
            t.record_step(i, Duration::from_millis(1));
        }
        let steps = t.take_steps();
        assert_eq!(steps.len(), super::STEPS_KEPT_MAX);
        assert_eq!(steps[0].0, 10, "the oldest went first");
        assert!(t.take_steps().is_empty());
    }
}
