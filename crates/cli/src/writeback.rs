//! Background write-back policy: when to copy dirty data to the origin.
//!
//! - Idle (no foreground I/O for `idle_ms`): full speed.
//! - Dirty above the high watermark: clean until below the low watermark.
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

#[derive(Debug, Clone)]
pub struct WritebackPolicy {
    pub high_watermark_pct: u64,
    pub low_watermark_pct: u64,
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
}

/// The decision logic, separate from threads and clocks so it is testable.
pub struct Planner {
    policy: WritebackPolicy,
    cleaning: bool,
    /// (durable end offset, when it was first seen): ages of epochs.
    epochs: VecDeque<(u64, Instant)>,
}

impl Planner {
    pub fn new(policy: WritebackPolicy) -> Planner {
        Planner {
            policy,
            cleaning: false,
            epochs: VecDeque::new(),
        }
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
        } = o;
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
        if self.cleaning {
            return Decision::Watermark;
        }
        if let Some(&(_, seen)) = self.epochs.front() {
            if now.duration_since(seen) >= Duration::from_millis(self.policy.max_age_ms) {
                return Decision::Age;
            }
        }
        Decision::Busy
    }
}

pub fn writeback_loop(engine: &Engine, stop: &AtomicBool, policy: WritebackPolicy) {
    let mut planner = Planner::new(policy.clone());
    let mut last_epoch = Instant::now();
    let mut last_ops = 0u64;
    let mut last_activity = Instant::now();
    let mut backoff_ms = 10u64;
    let mut budget_start = Instant::now();
    let mut budget_bytes = 0u64;
    while !stop.load(Ordering::SeqCst) {
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
            if let Err(e) = engine.flush() {
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
            },
        );
        if matches!(
            decision,
            Decision::Clean | Decision::Paused | Decision::Busy
        ) {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        if policy.rate_limit_bytes_per_sec > 0 {
            let elapsed = budget_start.elapsed().as_secs_f64();
            let allowed = (elapsed * policy.rate_limit_bytes_per_sec as f64) as u64;
            if budget_bytes > allowed {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            if elapsed > 10.0 {
                budget_start = Instant::now();
                budget_bytes = 0;
            }
        }
        match engine.writeback_step() {
            Ok(p) => {
                backoff_ms = 10;
                budget_bytes += p.blocks_written * s.block_size_bytes;
                if p.groups == 0 {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            Err(e) => {
                tracing::warn!("write-back failed, retrying in {backoff_ms} ms: {e}");
                std::thread::sleep(Duration::from_millis(backoff_ms));
                backoff_ms = (backoff_ms * 2).min(5_000);
            }
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
        }
    }

    #[test]
    fn planner_decisions() {
        let mut p = Planner::new(WritebackPolicy::default());
        let t0 = Instant::now();
        let busy = Duration::from_millis(0);
        let idle = Duration::from_secs(1);
        assert_eq!(
            p.decide(t0, obs(0, 100, 0, 0, busy, false)),
            Decision::Clean
        );
        assert_eq!(
            p.decide(t0, obs(10, 100, 0, 50, busy, false)),
            Decision::Busy
        );
        assert_eq!(
            p.decide(t0, obs(10, 100, 0, 50, idle, false)),
            Decision::Idle
        );
        assert_eq!(
            p.decide(t0, obs(10, 100, 0, 50, busy, true)),
            Decision::Paused
        );
        // Above the high watermark: clean until the low one.
        assert_eq!(
            p.decide(t0, obs(60, 100, 0, 50, busy, false)),
            Decision::Watermark
        );
        assert_eq!(
            p.decide(t0, obs(30, 100, 0, 50, busy, false)),
            Decision::Watermark
        );
        assert_eq!(
            p.decide(t0, obs(5, 100, 0, 50, busy, false)),
            Decision::Busy
        );
        // Old dirty data is written back even when busy.
        let later = t0 + Duration::from_secs(31);
        assert_eq!(
            p.decide(later, obs(5, 100, 0, 50, busy, false)),
            Decision::Age
        );
    }
}
