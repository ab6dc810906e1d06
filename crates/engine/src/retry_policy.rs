//! How a failed cache write or read is retried: a value, so a thread
//! without the engine's `Env` (a record writer) retries exactly like the
//! engine does.

use std::sync::atomic::AtomicU64;

use cairn_device::DeviceError;

use crate::stats::Counters;

/// How often and how patiently a cache I/O is retried; a value, so a
/// thread without the engine's `Env` (a record writer) retries alike.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RetryPolicy {
    pub(crate) attempts: u32,
    pub(crate) backoff_us: u64,
}

impl RetryPolicy {
    /// Run `op` until it succeeds or `attempts` are used up, counting
    /// every failed attempt in `errors` and every retry in `retries`.
    pub(crate) fn run<T>(
        self,
        errors: &AtomicU64,
        retries: &AtomicU64,
        what: &str,
        mut op: impl FnMut() -> Result<T, DeviceError>,
    ) -> Result<T, DeviceError> {
        let attempts = self.attempts.max(1);
        let mut backoff_us = self.backoff_us;
        // Bounded: at most `attempts` rounds.
        for attempt in 1..=attempts {
            match op() {
                Ok(value) => {
                    if attempt > 1 {
                        tracing::warn!("{what}: succeeded on attempt {attempt} of {attempts}");
                    }
                    return Ok(value);
                }
                Err(e) => {
                    Counters::add(errors, 1);
                    if attempt >= attempts {
                        return Err(e);
                    }
                    tracing::warn!(
                        "{what} failed (attempt {attempt} of {attempts}), retrying: {e}"
                    );
                    Counters::add(retries, 1);
                    backoff(&mut backoff_us);
                }
            }
        }
        unreachable!("the last attempt returns")
    }
}

/// Sleep for the current backoff and double it. The engine owns no clock:
/// this only waits, and zero (the simulation tests) does not wait at all.
fn backoff(backoff_us: &mut u64) {
    if *backoff_us > 0 {
        std::thread::sleep(std::time::Duration::from_micros(*backoff_us));
        *backoff_us = backoff_us.saturating_mul(2);
    }
}
