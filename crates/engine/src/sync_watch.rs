//! The cache device's syncs in progress, and whether one ever failed.
//!
//! A sync that fails may have cost the device every write it had not made
//! durable: a controller that resets drops its volatile cache. A sync in
//! another flush lane that succeeds around that moment proves nothing: it
//! may have been served after the loss, with nothing left to write. So a
//! barrier whose own sync succeeded vouches for its records only once
//! every sync that was still running has ended, and only if none of the
//! device's syncs ever failed for good (the cache then goes degraded, and
//! never back). Waiting for other *syncs*, not for other barriers, keeps
//! this free of cycles: a sync is one system call, which waits for no one.

use std::sync::{Condvar, Mutex, MutexGuard};

use cairn_device::DeviceError;

#[derive(Default)]
struct Syncs {
    running: Vec<u64>,
    next_ticket: u64,
    failed: bool,
    /// Threads asleep in [`SyncWatch::settle`]: a sync that ends wakes
    /// them only if there are any (the wake is a system call, and most
    /// barriers end with nobody settling beside them).
    settling: usize,
}

#[derive(Default)]
pub(crate) struct SyncWatch {
    syncs: Mutex<Syncs>,
    ended: Condvar,
}

/// A sync in progress; [`SyncTicket::end`] says how it ended. Dropped
/// without that (the sync unwound from a panic), it counts as failed: no
/// one can say what it left on the device.
pub(crate) struct SyncTicket<'a> {
    watch: &'a SyncWatch,
    ticket: u64,
    ended: bool,
}

impl SyncWatch {
    fn lock(&self) -> MutexGuard<'_, Syncs> {
        self.syncs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A sync of the cache device (with its retries, if any) starts.
    pub(crate) fn begin(&self) -> SyncTicket<'_> {
        let mut syncs = self.lock();
        let ticket = syncs.next_ticket;
        syncs.next_ticket += 1;
        // Bounded by the barriers in flight and the engine lock's holder.
        syncs.running.push(ticket);
        SyncTicket {
            watch: self,
            ticket,
            ended: false,
        }
    }

    fn finish(&self, ticket: u64, failed: bool) {
        let mut syncs = self.lock();
        let before = syncs.running.len();
        syncs.running.retain(|&t| t != ticket);
        assert_eq!(syncs.running.len() + 1, before, "a sync ends once");
        syncs.failed |= failed;
        // A settler counts itself under this lock before it sleeps, so it
        // is either counted here or has not yet looked at `running`.
        if syncs.settling > 0 {
            self.ended.notify_all();
        }
    }

    /// Run `sync` (a cache write with its flush, or a flush, retries
    /// included) as a watched sync that vouches for no log record itself:
    /// the superblock, the volume table, tag pages, a checkpoint. Its
    /// failure is one no barrier may vouch beside.
    pub(crate) fn watch<T, E>(&self, sync: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        let ticket = self.begin();
        let result = sync();
        ticket.end(result.is_err());
        result
    }

    /// Run `sync` (a barrier's writes and sync, retries included) as a
    /// watched sync and, if it succeeded, [`SyncWatch::settle`]: Ok only if
    /// the barrier may vouch for what it wrote.
    pub(crate) fn vouching(
        &self,
        device: &str,
        sync: impl FnOnce() -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        self.watch(sync)?;
        self.settle(device)
    }

    /// After a sync of one's own on `device` succeeded: wait until every
    /// sync running now has ended, then fail if any sync of the device
    /// failed for good. Never called with a ticket of one's own still open.
    pub(crate) fn settle(&self, device: &str) -> Result<(), DeviceError> {
        let mut syncs = self.lock();
        let waited_for: Vec<u64> = syncs.running.clone();
        // Bounded: tickets only end, and each is a system call in progress.
        while syncs.running.iter().any(|t| waited_for.contains(t)) {
            syncs.settling += 1;
            syncs = self.ended.wait(syncs).unwrap_or_else(|p| p.into_inner());
            assert!(syncs.settling > 0, "a settler counted itself");
            syncs.settling -= 1;
        }
        if syncs.failed {
            return Err(DeviceError::Io {
                device: device.to_string(),
                offset: 0,
                len: 0,
                source: std::io::Error::other(
                    "another sync of the cache device failed, so this one cannot vouch for what was written before it",
                ),
            });
        }
        Ok(())
    }

    /// Has a sync of the device ever failed for good?
    #[cfg(test)]
    fn any_failed(&self) -> bool {
        self.lock().failed
    }
}

impl SyncTicket<'_> {
    /// The sync returned: `failed` if it failed for good (no retry will
    /// cover what it may have lost).
    pub(crate) fn end(mut self, failed: bool) {
        self.ended = true;
        self.watch.finish(self.ticket, failed);
    }
}

impl Drop for SyncTicket<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.watch.finish(self.ticket, true);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::SyncWatch;

    #[test]
    fn settle_waits_for_the_syncs_running_and_reports_a_failure() {
        let watch = Arc::new(SyncWatch::default());
        assert!(
            watch.settle("cache").is_ok(),
            "nothing running, nothing failed"
        );
        let slow = watch.begin();
        let (settled_tx, settled) = std::sync::mpsc::channel();
        {
            let watch = watch.clone();
            std::thread::spawn(move || settled_tx.send(watch.settle("cache").is_ok()));
        }
        assert!(
            settled.recv_timeout(Duration::from_millis(50)).is_err(),
            "settle did not wait for the running sync"
        );
        slow.end(true);
        // Woken by the sync's end, not by a timeout of its own.
        let ok = settled
            .recv_timeout(Duration::from_secs(20))
            .expect("the settling thread was never woken");
        assert!(!ok, "the failure was not seen");
        assert!(watch.any_failed());
        // A sync that starts after a failure cannot undo it.
        watch.begin().end(false);
        assert!(watch.settle("cache").is_err());
    }

    #[test]
    fn a_sync_that_unwinds_counts_as_failed() {
        let watch = SyncWatch::default();
        drop(watch.begin());
        assert!(watch.settle("cache").is_err());
    }

    #[test]
    fn a_watched_sync_that_fails_is_seen_by_settle() {
        let watch = SyncWatch::default();
        assert_eq!(watch.watch(|| Ok::<u8, ()>(7)), Ok(7));
        assert!(watch.settle("cache").is_ok());
        assert_eq!(watch.watch(|| Err::<u8, ()>(())), Err(()));
        assert!(watch.settle("cache").is_err());
    }

    #[test]
    fn successful_syncs_settle() {
        let watch = SyncWatch::default();
        let a = watch.begin();
        let b = watch.begin();
        b.end(false);
        a.end(false);
        assert!(watch.settle("cache").is_ok());
        assert!(!watch.any_failed());
    }
}
