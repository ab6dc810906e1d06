//! Where threads wait for sealed record writes to complete.

use std::sync::{Condvar, Mutex, MutexGuard};

#[derive(Default)]
pub(crate) struct RecordIo {
    lock: Mutex<()>,
    changed: Condvar,
}

impl RecordIo {
    pub(crate) fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait for the next change (a record's write completing).
    pub(crate) fn wait<'a>(&self, guard: MutexGuard<'a, ()>) -> MutexGuard<'a, ()> {
        self.changed.wait(guard).unwrap_or_else(|p| p.into_inner())
    }

    /// Publish a change; call with the guard held, so no waiter misses it.
    pub(crate) fn notify(&self) {
        self.changed.notify_all();
    }
}
