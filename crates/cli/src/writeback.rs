//! Background write-back policy: when to copy dirty data to the origin.
//!
//! - Idle (no foreground I/O for `idle_ms`): full speed.
//! - Dirty above the high watermark: clean until below the low watermark,
//!   except while clients write faster than write-back has been measured
//!   to drain (a burst, e.g. a sequential stream): then cleaning waits for
//!   the burst to end (idle) or for the urgent watermark. Cleaning during
//!   such a burst cannot keep the log from filling, it only reads the log
//!   back from the cache device while the burst is writing to it (the W3
//!   benchmark measured 681 -> 472 MB/s); a burst that fits in the free
//!   space then runs at full speed and is written back when it ends.
//! - Dirty data older than `max_age_ms`: written back regardless.
//! - Otherwise, while foreground I/O is busy, write-back pauses
//!   (dm-writecache's pause_writeback), so foreground latency holds up.
//! - A rate limit (bytes per second, 0 = none) caps write-back in every case.
//!
//! Space pressure is handled inside the engine and ignores all of this:
//! writers never fail for lack of space.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cairn_engine::Engine;

use crate::writeback_turns::{extra_thread_loop, step, Turns, WRITEBACK_THREADS_MAX};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WritebackPolicy {
    pub high_watermark_pct: u64,
    pub low_watermark_pct: u64,
    /// Above this, cleaning runs even during a write burst faster than
    /// write-back (see the module documentation).
    pub urgent_watermark_pct: u64,
    pub max_age_ms: u64,
    pub idle_ms: u64,
    pub rate_limit_bytes_per_sec: u64,
    /// End an epoch at least this often so unflushed dirty data can age out.
    pub epoch_interval_ms: u64,
}

impl Default for WritebackPolicy {
    fn default() -> Self {
        WritebackPolicy {
            high_watermark_pct: 50,
            low_watermark_pct: 10,
            urgent_watermark_pct: 90,
            max_age_ms: 30_000,
            idle_ms: 200,
            rate_limit_bytes_per_sec: 0,
            epoch_interval_ms: 1_000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Idle,
    Watermark,
    Age,
    Paused,
    Busy,
    /// Above the high watermark, but clients write faster than write-back
    /// drains: wait for the burst to end (or the urgent watermark).
    Burst,
    Clean,
}

/// What the planner looks at.
#[derive(Debug, Clone, Copy)]
pub struct Observation {
    pub dirty_blocks: u64,
    pub cache_blocks: u64,
    pub wb_offset: u64,
    pub durable_end: u64,
    pub idle_for: Duration,
    pub paused: bool,
    /// Bytes written by clients since the daemon started (a counter).
    pub client_write_bytes: u64,
}

/// How long a window the client write rate is measured over.
const WRITE_RATE_WINDOW: Duration = Duration::from_secs(1);
/// Samples kept for that window (decisions come every ~20 ms or faster).
const WRITE_RATE_SAMPLES_MAX: usize = 256;

/// The decision logic, separate from threads and clocks so it is testable.
pub struct Planner {
    policy: WritebackPolicy,
    cleaning: bool,
    /// (durable end offset, when it was first seen): ages of epochs.
    epochs: VecDeque<(u64, Instant)>,
    /// (when, client bytes written so far): the recent client write rate.
    writes: VecDeque<(Instant, u64)>,
    /// Write-back speed measured over its recent steps (bytes per second,
    /// smoothed); `None` until write-back has run.
    writeback_bytes_per_sec: Option<f64>,
}

impl Planner {
    pub fn new(policy: WritebackPolicy) -> Planner {
        Planner {
            policy,
            cleaning: false,
            epochs: VecDeque::new(),
            writes: VecDeque::new(),
            writeback_bytes_per_sec: None,
        }
    }

    pub fn set_policy(&mut self, policy: WritebackPolicy) {
        self.policy = policy;
    }

    /// Record a write-back step that copied `bytes` in `elapsed`.
    pub fn record_writeback(&mut self, bytes: u64, elapsed: Duration) {
        if bytes == 0 || elapsed.is_zero() {
            return;
        }
        let rate = bytes as f64 / elapsed.as_secs_f64();
        self.writeback_bytes_per_sec = Some(match self.writeback_bytes_per_sec {
            Some(old) => 0.7 * old + 0.3 * rate,
            None => rate,
        });
    }

    /// Client bytes per second over the last `WRITE_RATE_WINDOW`.
    fn client_write_rate(&self) -> f64 {
        match (self.writes.front(), self.writes.back()) {
            (Some(&(t0, b0)), Some(&(t1, b1))) if t1 > t0 => {
                b1.saturating_sub(b0) as f64 / t1.duration_since(t0).as_secs_f64()
            }
            _ => 0.0,
        }
    }

    /// Clients write faster than write-back has been seen to drain (or
    /// write-back has not run yet and clients are writing).
    fn burst_outpaces_writeback(&self) -> bool {
        let incoming = self.client_write_rate();
        incoming > 0.0 && incoming > self.writeback_bytes_per_sec.unwrap_or(0.0)
    }

    /// Decide whether to write back now.
    pub fn decide(&mut self, now: Instant, o: Observation) -> Decision {
        let Observation {
            dirty_blocks,
            cache_blocks,
            wb_offset,
            durable_end,
            idle_for,
            paused,
            client_write_bytes,
        } = o;
        // Bounded: samples older than the window go, and at most
        // WRITE_RATE_SAMPLES_MAX are kept.
        self.writes.push_back((now, client_write_bytes));
        while self.writes.len() > WRITE_RATE_SAMPLES_MAX
            || self
                .writes
                .front()
                .is_some_and(|&(t, _)| now.duration_since(t) > WRITE_RATE_WINDOW)
        {
            self.writes.pop_front();
        }
        if self.epochs.back().is_none_or(|&(end, _)| end < durable_end) {
            // Bounded: one entry per observed epoch end, trimmed below.
            if self.epochs.len() >= 4096 {
                self.epochs.pop_front();
            }
            self.epochs.push_back((durable_end, now));
        }
        while self
            .epochs
            .front()
            .is_some_and(|&(end, _)| end <= wb_offset)
        {
            self.epochs.pop_front();
        }
        if dirty_blocks == 0 || wb_offset >= durable_end {
            self.cleaning = false;
            return Decision::Clean;
        }
        if paused {
            return Decision::Paused;
        }
        let dirty_pct = dirty_blocks * 100 / cache_blocks.max(1);
        if dirty_pct >= self.policy.high_watermark_pct {
            self.cleaning = true;
        } else if dirty_pct <= self.policy.low_watermark_pct {
            self.cleaning = false;
        }
        if idle_for >= Duration::from_millis(self.policy.idle_ms) {
            return Decision::Idle;
        }
        let too_old = self.epochs.front().is_some_and(|&(_, seen)| {
            now.duration_since(seen) >= Duration::from_millis(self.policy.max_age_ms)
        });
        if self.cleaning {
            if dirty_pct < self.policy.urgent_watermark_pct
                && !too_old
                && self.burst_outpaces_writeback()
            {
                return Decision::Burst;
            }
            return Decision::Watermark;
        }
        if too_old {
            return Decision::Age;
        }
        Decision::Busy
    }
}

/// Run write-back until `stop`; `policy` gives the policy in force, read
/// every step (`cairn set` may change it while serving). This thread
/// decides and steps; up to `WRITEBACK_THREADS_MAX - 1` more step beside
/// it while there are several volumes (see `writeback_turns`).
pub fn writeback_loop(
    engine: &Engine,
    stop: &AtomicBool,
    policy_now: impl Fn() -> WritebackPolicy + Sync,
) {
    let turns = Turns::default();
    std::thread::scope(|s| {
        for index in 1..WRITEBACK_THREADS_MAX {
            let (turns, policy_now) = (&turns, &policy_now);
            let spawned = std::thread::Builder::new()
                .name(format!("writeback-{index}"))
                .spawn_scoped(s, move || {
                    extra_thread_loop(engine, stop, turns, index, || {
                        policy_now().rate_limit_bytes_per_sec
                    })
                });
            if let Err(e) = spawned {
                tracing::warn!("write-back runs on fewer threads: {e}");
                break;
            }
        }
        decide_and_step(engine, stop, &policy_now, &turns);
        // The extra threads see `stop` too; the scope waits for them, so
        // wake those asleep waiting for cleaning.
        turns.set_cleaning(false);
        turns.wake_all();
    });
}

fn decide_and_step(
    engine: &Engine,
    stop: &AtomicBool,
    policy_now: &impl Fn() -> WritebackPolicy,
    turns: &Turns,
) {
    let mut policy = policy_now();
    let mut planner = Planner::new(policy.clone());
    let mut last_epoch = Instant::now();
    let mut last_ops = 0u64;
    let mut last_activity = Instant::now();
    let mut backoff_ms = 10u64;
    let mut degraded = engine.is_degraded();
    while !stop.load(Ordering::SeqCst) {
        // `cairn set` may have changed the policy while serving.
        let now_policy = policy_now();
        if now_policy != policy {
            tracing::info!(?now_policy, "write-back policy changed");
            planner.set_policy(now_policy.clone());
            policy = now_policy;
        }
        if !degraded && engine.is_degraded() {
            degraded = true;
            tracing::error!(
                "the cache went degraded while serving; {}",
                crate::advice::degraded_cache(
                    std::path::Path::new(engine.cache_name()),
                    &engine.volume().origin_identity
                )
            );
        }
        for (bytes, elapsed) in turns.take_steps() {
            planner.record_writeback(bytes, elapsed);
        }
        let s = engine.stats();
        let ops = s.reads + s.writes + s.flushes + s.discards + s.write_zeroes;
        let now = Instant::now();
        if ops != last_ops {
            last_ops = ops;
            last_activity = now;
        }
        if last_epoch.elapsed() >= Duration::from_millis(policy.epoch_interval_ms)
            && s.dirty_blocks > 0
        {
            if let Err(e) = engine.end_epoch() {
                tracing::warn!("periodic epoch end failed: {e}");
            }
            last_epoch = Instant::now();
        }
        let decision = planner.decide(
            now,
            Observation {
                dirty_blocks: s.dirty_blocks,
                cache_blocks: s.cache_blocks,
                wb_offset: s.writeback_offset,
                durable_end: s.writeback_limit_offset,
                idle_for: now.duration_since(last_activity),
                paused: engine.writeback_paused(),
                client_write_bytes: s.write_bytes,
            },
        );
        let cleaning = !matches!(
            decision,
            Decision::Clean | Decision::Paused | Decision::Busy | Decision::Burst
        );
        turns.set_cleaning(cleaning);
        if !cleaning {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        if !turns.budget_allows(policy.rate_limit_bytes_per_sec) {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        if let Some((bytes, elapsed)) = step(engine, s.block_size_bytes, &mut backoff_ms) {
            planner.record_writeback(bytes, elapsed);
            turns.spend(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(d: u64, c: u64, w: u64, e: u64, idle_for: Duration, paused: bool) -> Observation {
        Observation {
            dirty_blocks: d,
            cache_blocks: c,
            wb_offset: w,
            durable_end: e,
            idle_for,
            paused,
            client_write_bytes: 0,
        }
    }

    fn writing(o: Observation, client_write_bytes: u64) -> Observation {
        Observation {
            client_write_bytes,
            ..o
        }
    }

    #[test]
    fn a_write_burst_faster_than_write_back_waits_until_urgent_or_idle() {
        let mut p = Planner::new(WritebackPolicy::default());
        let t0 = Instant::now();
        let busy = Duration::from_millis(0);
        let idle = Duration::from_secs(1);
        let ms = |n| t0 + Duration::from_millis(n);
        // Dirty above the high watermark, `bytes` written by clients so far.
        let at = |dirty, idle_for, bytes| writing(obs(dirty, 100, 0, 50, idle_for, false), bytes);
        expect_decisions(
            &mut p,
            &[
                // No write rate known yet: clean.
                (ms(0), at(60, busy, 0), Decision::Watermark),
                // 100 MB in 100 ms: a 1 GB/s stream, and write-back never ran.
                (ms(100), at(70, busy, 100_000_000), Decision::Burst),
                // At the urgent watermark cleaning runs even during the burst.
                (ms(200), at(90, busy, 200_000_000), Decision::Watermark),
            ],
        );
        // Write-back measured at 2 GB/s: faster than the stream, so it
        // cleans from the high watermark on.
        p.record_writeback(200_000_000, Duration::from_millis(100));
        expect_decisions(
            &mut p,
            &[(ms(300), at(60, busy, 300_000_000), Decision::Watermark)],
        );
        // A slow write-back again, then the burst ends: idle cleans.
        let mut p = Planner::new(WritebackPolicy::default());
        p.record_writeback(1_000_000, Duration::from_secs(1));
        expect_decisions(
            &mut p,
            &[
                (ms(0), at(60, busy, 0), Decision::Watermark),
                (ms(100), at(60, busy, 100_000_000), Decision::Burst),
                (ms(400), at(60, idle, 100_000_000), Decision::Idle),
                // No writes in the last second (reads keep it busy): cleaning runs.
                (ms(2000), at(60, busy, 100_000_000), Decision::Watermark),
            ],
        );
    }

    /// Feed the planner each observation in turn and check each decision.
    fn expect_decisions(p: &mut Planner, steps: &[(Instant, Observation, Decision)]) {
        for (i, &(at, o, want)) in steps.iter().enumerate() {
            assert_eq!(p.decide(at, o), want, "step {i}: {o:?}");
        }
    }

    #[test]
    fn planner_decisions() {
        let mut p = Planner::new(WritebackPolicy::default());
        let t0 = Instant::now();
        let busy = Duration::from_millis(0);
        let idle = Duration::from_secs(1);
        // Old dirty data is written back even when busy.
        let later = t0 + Duration::from_secs(31);
        expect_decisions(
            &mut p,
            &[
                (t0, obs(0, 100, 0, 0, busy, false), Decision::Clean),
                (t0, obs(10, 100, 0, 50, busy, false), Decision::Busy),
                (t0, obs(10, 100, 0, 50, idle, false), Decision::Idle),
                (t0, obs(10, 100, 0, 50, busy, true), Decision::Paused),
                // Above the high watermark: clean until the low one.
                (t0, obs(60, 100, 0, 50, busy, false), Decision::Watermark),
                (t0, obs(30, 100, 0, 50, busy, false), Decision::Watermark),
                (t0, obs(5, 100, 0, 50, busy, false), Decision::Busy),
                (later, obs(5, 100, 0, 50, busy, false), Decision::Age),
            ],
        );
    }
}
