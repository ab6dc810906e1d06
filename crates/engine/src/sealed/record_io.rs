//! Where threads wait for sealed record writes to complete.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

/// The lock holds the number of threads waiting, so a completion nobody
/// waits for (the usual case: a barrier's leader publishes the records it
/// wrote itself) makes no wake-up system call.
#[derive(Default)]
pub(crate) struct RecordIo {
    waiters: Mutex<usize>,
    changed: Condvar,
    /// The newest sequence sealed: readable without the engine lock, by a
    /// barrier deciding whether a failed sync may be retried.
    sealed_through: AtomicU64,
}

impl RecordIo {
    /// Record `sequence` was sealed (under the engine lock, in order).
    pub(crate) fn note_sealed(&self, sequence: u64) {
        self.sealed_through.fetch_max(sequence, Ordering::AcqRel);
    }

    /// The newest sequence sealed so far (0 before the first seal since
    /// open).
    pub(crate) fn sealed_through(&self) -> u64 {
        self.sealed_through.load(Ordering::Acquire)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, usize> {
        self.waiters.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait for the next change (a record's write completing).
    pub(crate) fn wait<'a>(&self, mut guard: MutexGuard<'a, usize>) -> MutexGuard<'a, usize> {
        *guard += 1;
        let mut guard = self.changed.wait(guard).unwrap_or_else(|p| p.into_inner());
        assert!(*guard > 0, "a waiter left that was never counted");
        *guard -= 1;
        guard
    }

    /// Publish a change; the caller holds the lock (and made its change
    /// under it), so no waiter misses it.
    /// `guard` must come from this `RecordIo`'s [`RecordIo::lock`]: it
    /// holds the count of waiters.
    pub(crate) fn notify(&self, guard: &MutexGuard<'_, usize>) {
        if **guard > 0 {
            self.changed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::RecordIo;

    /// A waiter that blocks before the change is woken by it; one that
    /// comes after sees the change without waiting.
    #[test]
    fn a_waiting_thread_is_woken_and_the_count_returns_to_zero() {
        let io = Arc::new(RecordIo::default());
        let done = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (io, done) = (io.clone(), done.clone());
            std::thread::spawn(move || {
                let mut guard = io.lock();
                while !done.load(Ordering::Acquire) {
                    guard = io.wait(guard);
                }
            })
        };
        let started = Instant::now();
        while *io.lock() == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the waiter never waited"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        {
            let guard = io.lock();
            done.store(true, Ordering::Release);
            io.notify(&guard);
        }
        let started = Instant::now();
        while !waiter.is_finished() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the waiter was not woken"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        waiter.join().expect("waiter");
        assert_eq!(*io.lock(), 0, "the waiter's count was given back");
    }
}
