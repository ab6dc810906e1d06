//! Whether the engine may write the cache device: running, a degrade
//! pending (a cache write failed for good), degraded, or stopped.
//!
//! Kept apart from the index so that any part that writes the cache (the
//! log sealing records, in or out of the engine lock, checkpoints,
//! superblocks, tag pages) can report a failure it hit, and every request
//! can check the state with a few atomic loads. The reasons live behind a
//! small lock taken only when something went wrong; lock order: the engine
//! lock may be held while it is taken, never the other way round.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{EngineError, EngineResult};

#[derive(Default)]
struct Reasons {
    failed: Option<String>,
    degrade_pending: Option<String>,
    /// The last failed attempt at the switch to degraded mode, and when
    /// the next may start.
    degrade_failure: Option<(String, Instant)>,
}

#[derive(Default)]
pub(crate) struct Health {
    /// The engine is stopped: every request fails until restart.
    failed: AtomicBool,
    /// A cache write failed for good (after its retries). Nothing more may
    /// be written to the cache; `Engine::degrade` must run before any
    /// request proceeds.
    degrade_pending: AtomicBool,
    /// Degraded mode: every dirty block was written back, the DEGRADED flag
    /// is durable in the superblock, and writes go straight to the origin.
    /// The cache device is never written again.
    degraded: AtomicBool,
    /// Attempts at the switch to degraded mode that failed and left the
    /// degrade pending (see `crate::degrade`): those that count towards
    /// the limit (cache failures), and all of them (for the pace).
    degrade_attempts_failed: AtomicU32,
    degrade_failures_total: AtomicU32,
    /// A clean shutdown has begun: attempts at the switch are not paced.
    shutting_down: AtomicBool,
    /// The volumes whose origin fails write-back (one bit per id), mirrored
    /// from the write-back's own record for the space paths: while an
    /// origin fails, its volume's clean blocks are not moved or added at
    /// the head, where they could not be reclaimed before the origin is
    /// back and would take the room its writes need.
    origins_failing: AtomicU32,
    /// The volumes whose origin fenced this process (one bit per id, see
    /// `Device::fenced`): their writes are refused until a restart.
    origins_fenced: AtomicU32,
    reasons: Mutex<Reasons>,
}

impl Health {
    /// The health of a cache opened with the DEGRADED flag.
    pub(crate) fn degraded() -> Health {
        let health = Health::default();
        health.degraded.store(true, Ordering::SeqCst);
        health
    }

    fn reasons(&self) -> MutexGuard<'_, Reasons> {
        self.reasons.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Volume `id`'s origin failed (`true`) or took a write-back step.
    pub(crate) fn set_origin_failing(&self, id: u16, failing: bool) {
        set_volume_bit(&self.origins_failing, id, failing);
    }

    /// Volume `id`'s origin fenced this process (`true`), or the id starts
    /// afresh with another volume (`false`).
    pub(crate) fn set_origin_fenced(&self, id: u16, fenced: bool) {
        set_volume_bit(&self.origins_fenced, id, fenced);
    }

    /// Has volume `id`'s origin fenced this process?
    pub(crate) fn origin_fenced(&self, id: u16) -> bool {
        volume_bit(&self.origins_fenced, id)
    }

    /// Has any volume's origin fenced this process?
    pub(crate) fn any_origin_fenced(&self) -> bool {
        self.origins_fenced.load(Ordering::SeqCst) != 0
    }

    /// Is volume `id`'s origin failing write-back?
    pub(crate) fn origin_failing(&self, id: u16) -> bool {
        volume_bit(&self.origins_failing, id)
    }

    pub(crate) fn is_degraded(&self) -> bool {
        self.degraded.load(Ordering::SeqCst)
    }

    /// A cache write failed for good and the switch to degraded mode has
    /// not completed.
    pub(crate) fn is_degrade_pending(&self) -> bool {
        self.degrade_pending.load(Ordering::SeqCst)
    }

    pub(crate) fn is_failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    fn failed_error(&self) -> EngineError {
        let reason = self.reasons().failed.clone();
        EngineError::Failed(reason.unwrap_or_else(|| "the engine stopped".into()))
    }

    /// May the normal, cache-writing paths run? `Failed` once stopped,
    /// `DegradeRequired` once a cache write failed for good or the engine
    /// went degraded (the request is then re-run on the degraded path).
    pub(crate) fn check_normal(&self) -> EngineResult<()> {
        self.check_running()?;
        if self.degrade_pending.load(Ordering::SeqCst) || self.is_degraded() {
            return Err(EngineError::DegradeRequired);
        }
        Ok(())
    }

    /// May a path valid in every state but stopped run (reads, checks,
    /// degraded writes)?
    pub(crate) fn check_running(&self) -> EngineResult<()> {
        if self.is_failed() {
            return Err(self.failed_error());
        }
        Ok(())
    }

    /// May the cache device still be written (promotions, repairs)?
    pub(crate) fn cache_writable(&self) -> bool {
        !self.is_failed() && !self.degrade_pending.load(Ordering::SeqCst) && !self.is_degraded()
    }

    /// A cache write failed for good (its retries, if any, are spent; the
    /// errors were counted). No further cache write may happen: the next
    /// request switches the engine to degraded mode.
    pub(crate) fn cache_write_failed(
        &self,
        what: &str,
        e: cairn_device::DeviceError,
    ) -> EngineError {
        let reason = format!("{what}: {e}");
        if self.is_degraded() {
            // A write that started before the switch finished after it
            // (the switch took its record over from memory): nothing more
            // to do, but the request learns its write failed.
            tracing::debug!(
                "a cache write started before the switch to degraded mode failed: {reason}"
            );
            return EngineError::Cache(e);
        }
        let mut reasons = self.reasons();
        if reasons.degrade_pending.is_none() {
            tracing::error!(
                "cache device write failed for good ({reason}); switching to degraded mode"
            );
            reasons.degrade_pending = Some(reason);
            self.degrade_pending.store(true, Ordering::SeqCst);
        }
        EngineError::Cache(e)
    }

    /// Why a degrade is pending; `Err` if the engine is stopped.
    pub(crate) fn degrade_reason(&self) -> EngineResult<Option<String>> {
        self.check_running()?;
        Ok(self.reasons().degrade_pending.clone())
    }

    /// Is the degraded path due: a degrade pending, or done? `Err` if the
    /// engine is stopped.
    pub(crate) fn wants_degraded_path(&self) -> EngineResult<bool> {
        self.check_running()?;
        Ok(self.degrade_pending.load(Ordering::SeqCst) || self.is_degraded())
    }

    /// An attempt at the switch to degraded mode failed (`failure`), leaving
    /// the degrade pending; the next may start after `wait`. Returns how
    /// many `counted` failures there were so far, this one included.
    pub(crate) fn degrade_attempt_failed(
        &self,
        failure: String,
        wait: Duration,
        counted: bool,
    ) -> u32 {
        self.reasons().degrade_failure = Some((failure, Instant::now() + wait));
        self.degrade_failures_total.fetch_add(1, Ordering::SeqCst);
        if counted {
            self.degrade_attempts_failed.fetch_add(1, Ordering::SeqCst);
        }
        self.degrade_attempts_failed.load(Ordering::SeqCst)
    }

    /// How many attempts at the switch to degraded mode have failed, for
    /// any reason.
    pub(crate) fn degrade_failures_total(&self) -> u32 {
        self.degrade_failures_total.load(Ordering::SeqCst)
    }

    pub(crate) fn set_shutting_down(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    pub(crate) fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// If the last attempt at the switch failed less than its wait ago: how
    /// long until the next may start, and why the last one failed.
    pub(crate) fn degrade_retry_wait(&self) -> Option<(Duration, String)> {
        let reasons = self.reasons();
        let (failure, at) = reasons.degrade_failure.as_ref()?;
        let left = at.checked_duration_since(Instant::now())?;
        (!left.is_zero()).then(|| (left, failure.clone()))
    }

    /// The switch to degraded mode completed.
    pub(crate) fn set_degraded(&self) {
        let mut reasons = self.reasons();
        // Degraded first: a check between the two stores sees both set
        // (the degraded path), never neither (the normal one).
        self.degraded.store(true, Ordering::SeqCst);
        reasons.degrade_pending = None;
        self.degrade_pending.store(false, Ordering::SeqCst);
    }

    /// Stop the engine: every request fails from now on.
    pub(crate) fn stop(&self, reason: String) {
        self.reasons().failed = Some(reason);
        self.failed.store(true, Ordering::SeqCst);
    }
}

/// Set or clear volume `id`'s bit in a per-volume mask.
fn set_volume_bit(mask: &AtomicU32, id: u16, on: bool) {
    assert!((id as usize) < cairn_format::VOLUMES_MAX);
    let bit = 1u32 << id;
    if on {
        mask.fetch_or(bit, Ordering::SeqCst);
    } else {
        mask.fetch_and(!bit, Ordering::SeqCst);
    }
}

/// Volume `id`'s bit in a per-volume mask (false for an id past the
/// last volume).
fn volume_bit(mask: &AtomicU32, id: u16) -> bool {
    (id as usize) < cairn_format::VOLUMES_MAX && mask.load(Ordering::SeqCst) & (1u32 << id) != 0
}
