//! [`ClaimGuard`]: records a caller claimed are published even if the
//! caller never gets to write them.

use std::sync::Arc;

use super::record::SealedRecord;
use super::record_io::RecordIo;

/// Held by whoever claimed `records` to write them (a record writer, a
/// barrier's leader, an in-order writer). On drop, any of them not yet
/// published is published as failed. On the normal path every record has
/// been published by then and the guard does nothing; it matters when the
/// writer unwinds from a panic halfway: a claimed record that is never
/// published would keep every later barrier, the sealed queue's bound and
/// the switch to degraded mode waiting for it forever. Published as
/// failed, it takes the path of any failed record write (the cache goes
/// degraded, the record's data stays in memory for the drain).
pub(crate) struct ClaimGuard<'a> {
    records: &'a [Arc<SealedRecord>],
    record_io: &'a RecordIo,
}

impl<'a> ClaimGuard<'a> {
    pub(crate) fn new(records: &'a [Arc<SealedRecord>], record_io: &'a RecordIo) -> Self {
        ClaimGuard { records, record_io }
    }
}

impl Drop for ClaimGuard<'_> {
    fn drop(&mut self) {
        for record in self.records {
            if !record.is_done() {
                // Only unwinding should get here; say so if it was not.
                let why = if std::thread::panicking() {
                    "its writer panicked"
                } else {
                    "its writer returned without writing it"
                };
                tracing::error!(
                    sequence = record.sequence,
                    "a log record was not written ({why}); marking its write failed"
                );
                record.publish_to(self.record_io, Err(format!("not written: {why}")));
            }
        }
    }
}
