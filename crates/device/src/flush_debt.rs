//! [`FlushDebt`]: whether a write finished since the last FLUSH covered it.
//!
//! A backend that answers allocation questions from somewhere that sees
//! only flushed writes (an NBD server's second connection, the OSDs behind
//! librbd's cache) flushes first when it owes one.

use std::sync::atomic::{AtomicU64, Ordering};

/// Write-type calls finished, and how many of them the last successful
/// flush covered.
#[derive(Debug, Default)]
pub(crate) struct FlushDebt {
    finished: AtomicU64,
    flushed: AtomicU64,
}

impl FlushDebt {
    /// A write, trim or zeroing call returned, successfully or not (a
    /// failed one may still have reached the medium).
    pub fn write_finished(&self) {
        self.finished.fetch_add(1, Ordering::AcqRel);
    }

    /// Taken before a flush starts: what that flush will cover.
    pub fn flush_starts(&self) -> u64 {
        self.finished.load(Ordering::Acquire)
    }

    /// The flush begun at `covers` succeeded.
    pub fn flushed(&self, covers: u64) {
        self.flushed.fetch_max(covers, Ordering::AcqRel);
    }

    /// A write finished that no successful flush covers yet.
    pub fn owed(&self) -> bool {
        self.finished.load(Ordering::Acquire) != self.flushed.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flush_pays_only_for_writes_finished_before_it() {
        let debt = FlushDebt::default();
        assert!(!debt.owed());
        debt.write_finished();
        assert!(debt.owed());
        let covers = debt.flush_starts();
        debt.write_finished();
        debt.flushed(covers);
        assert!(debt.owed(), "the second write came after the flush began");
        let covers = debt.flush_starts();
        debt.flushed(covers);
        assert!(!debt.owed());
        // An older flush finishing late changes nothing.
        debt.flushed(1);
        assert!(!debt.owed());
    }
}
