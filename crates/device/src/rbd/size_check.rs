//! [`SizeCheck`]: an image resized under cairn by another client.
//!
//! The volume is the size the image had when the cache was formatted.
//! Shrunk (`rbd resize --allow-shrink`), the image has lost its data past
//! the new end, and a write-back there would fail with a bare EINVAL;
//! worse, one inside it would carry on as if nothing happened. So while
//! the image is smaller than the volume every write is refused with an
//! error that says what happened and how to undo it: write-back holds
//! (the volume's origin is failing, nothing is dropped) until the image
//! has its size back. Reads past the new end are refused the same way;
//! reads inside it go on. Grown, the image still holds the whole volume:
//! requests go on, and the next open serves it at the volume's size (the
//! engine accepts a grown image whose id matches), which the log says now.
//! The volume's size is the size the image opened with, or the recorded
//! one when the image had grown before the open
//! ([`SizeCheck::set_volume_bytes`]).
//!
//! Reading the size after a header change asks the cluster (librbd
//! refreshes the header first), so it is never done on the reactor, whose
//! one thread serves every connection's reads: there the last size seen
//! is used, and the new one is read on a thread of its own. Requests that
//! may block (writes, on the engine's workers) read it themselves before
//! they go on, so a write that follows the notice of a shrink is refused.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::handles::Handles;

/// After the size could not be read, how long before it is tried again:
/// a cluster that does not answer must not add its timeout to every
/// request.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// What a request does to the image.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Access {
    Read,
    /// Writes, zeroes and discards; not flushes, which change nothing.
    Write,
}

/// Whether the caller may wait for the cluster.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Caller {
    /// An engine worker or a blocking call: reads the new size itself.
    MayBlock,
    /// The reactor: uses the last size seen, never waits.
    Reactor,
}

/// The volume's size and the image's size as last seen.
pub(super) struct SizeCheck {
    /// `POOL/[NAMESPACE/]IMAGE`, for the advice.
    image_path: String,
    volume_bytes: AtomicU64,
    seen_bytes: AtomicU64,
    /// Held from taking the watch's flag to storing the size it led to,
    /// so sizes are stored in the order they were read (a stale shrink
    /// never outlives the growth read after it); holds when a read of
    /// the size last failed.
    look: Mutex<Option<Instant>>,
    /// A reactor-started look is running on its own thread.
    look_queued: AtomicBool,
}

impl SizeCheck {
    pub fn new(image_path: String, volume_bytes: u64) -> SizeCheck {
        SizeCheck {
            image_path,
            volume_bytes: AtomicU64::new(volume_bytes),
            seen_bytes: AtomicU64::new(volume_bytes),
            look: Mutex::new(None),
            look_queued: AtomicBool::new(false),
        }
    }

    /// The volume is `volume_bytes`, less than the image's size at open:
    /// it grew before this open, and the engine serves the recorded size.
    pub fn set_volume_bytes(&self, volume_bytes: u64) {
        debug_assert!(volume_bytes <= self.seen_bytes.load(Ordering::Acquire));
        self.volume_bytes.store(volume_bytes, Ordering::Release);
    }

    fn volume_bytes(&self) -> u64 {
        self.volume_bytes.load(Ordering::Acquire)
    }

    /// Whether a request over `offset..offset + len` may go to the image.
    pub fn check(
        self: &Arc<Self>,
        handles: &Arc<Handles>,
        caller: Caller,
        access: Access,
        offset: u64,
        len: u64,
    ) -> io::Result<()> {
        if handles.watch().is_some_and(|w| w.is_raised()) {
            match caller {
                Caller::MayBlock => self.look_again(handles),
                Caller::Reactor => self.look_again_elsewhere(handles),
            }
        }
        let seen = self.seen_bytes.load(Ordering::Acquire);
        if seen >= self.volume_bytes() {
            return Ok(());
        }
        if access == Access::Read && offset.saturating_add(len) <= seen {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            self.shrunk_message(seen),
        ))
    }

    /// The shrink, if the image is smaller than the volume as last seen;
    /// a change not yet looked at is looked at on a thread of its own (the
    /// caller, status, must not wait for the cluster).
    pub fn known_problem(self: &Arc<Self>, handles: &Arc<Handles>) -> Option<String> {
        if handles.watch().is_some_and(|w| w.is_raised()) {
            self.look_again_elsewhere(handles);
        }
        let seen = self.seen_bytes.load(Ordering::Acquire);
        (seen < self.volume_bytes()).then(|| self.shrunk_message(seen))
    }

    fn shrunk_message(&self, seen: u64) -> String {
        format!(
            "the image {image} was shrunk from {volume} to {seen} bytes by another client while cairn served it, and its data past {seen} bytes is gone; cairn holds the volume's writes (nothing is dropped) until the image has its size back: `rbd resize --size {volume}B {image}`",
            image = self.image_path,
            volume = self.volume_bytes(),
        )
    }

    /// Read the new size on a thread of its own, one at a time.
    fn look_again_elsewhere(self: &Arc<Self>, handles: &Arc<Handles>) {
        if self.look_queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let check = Arc::clone(self);
        let handles = Arc::clone(handles);
        let spawned = std::thread::Builder::new()
            .name("rbd-size".into())
            .spawn(move || {
                check.look_again(&handles);
                check.look_queued.store(false, Ordering::Release);
            });
        if let Err(e) = spawned {
            // The next request that may block reads it instead.
            tracing::warn!(image = %self.image_path, error = %e, "cannot start a thread to read the image's size");
            self.look_queued.store(false, Ordering::Release);
        }
    }

    /// After writes (or zeroes, discards) to the image completed: whether
    /// the image still holds the whole volume. librbd cuts a write that
    /// crosses the image's end short and reports success, so a shrink
    /// carried out while a write-back was on its way would otherwise lose
    /// the cut part silently; reading the size now (librbd's own, which
    /// the cut used) turns it into a failed write, held and written again
    /// once the image has its size back. A size that cannot be read fails
    /// the writes too: they are written again, which is harmless.
    pub fn confirm_written(&self, handles: &Handles) -> io::Result<()> {
        let mut failed_at = self.look.lock().unwrap_or_else(PoisonError::into_inner);
        let now = self.read_size(handles, &mut failed_at)?;
        drop(failed_at);
        if now < self.volume_bytes() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                self.shrunk_message(now),
            ));
        }
        Ok(())
    }

    /// Read the image's size after its header changed, and say so if it
    /// is not the volume's.
    fn look_again(&self, handles: &Handles) {
        let mut failed_at = self.look.lock().unwrap_or_else(PoisonError::into_inner);
        if failed_at.is_some_and(|at| at.elapsed() < RETRY_AFTER) {
            return;
        }
        // Another caller may have dealt with the change while this one
        // waited for the lock.
        if !handles.watch().is_some_and(|w| w.is_raised()) {
            return;
        }
        if let Err(e) = self.read_size(handles, &mut failed_at) {
            tracing::warn!(image = %self.image_path, error = %e, "the image's header changed, and its size cannot be read; trying again");
        }
    }

    /// Take the watch's flag, read the size and record it; the caller
    /// holds `look` (given as `failed_at`). A failed read raises the flag
    /// again, so the change is looked at once more.
    fn read_size(&self, handles: &Handles, failed_at: &mut Option<Instant>) -> io::Result<u64> {
        let watch = handles.watch();
        if let Some(watch) = watch {
            watch.take();
        }
        match handles.size_bytes() {
            Ok(now) => {
                *failed_at = None;
                self.record(now);
                Ok(now)
            }
            Err(e) => {
                if let Some(watch) = watch {
                    watch.raise();
                }
                *failed_at = Some(Instant::now());
                Err(e)
            }
        }
    }

    /// Store the size just read (the caller holds `look`, so sizes are
    /// stored in the order they were read), and say so if it changed.
    fn record(&self, now: u64) {
        let before = self.seen_bytes.swap(now, Ordering::AcqRel);
        if now == before {
            return;
        }
        let volume = self.volume_bytes();
        if now < volume {
            tracing::error!(image = %self.image_path, volume_bytes = volume, image_bytes = now, "{}", self.shrunk_message(now));
        } else if now > volume {
            tracing::warn!(image = %self.image_path, volume_bytes = volume, image_bytes = now,
                "the image grew past the volume; cairn goes on serving {volume} bytes, and serves that much after a restart too (to use the new size: `cairn flush`, stop cairn, `cairn format --force` the cache)");
        } else {
            tracing::info!(image = %self.image_path, volume_bytes = volume, "the image has the volume's size again; writes go on");
        }
    }
}
