//! Sealed records whose write to the cache device happens outside the
//! engine lock, so that several records can be in flight at once while
//! other writers keep filling the next one.
//!
//! A record sealed without a barrier (it was full) is queued in the log's
//! [`SealedQueue`]. The engine call that sealed it *claims* it before
//! dropping the lock and writes it afterwards ([`write_claimed`]); a record
//! nobody claimed is written by the next barrier, or at once when the queue
//! is at its bound. Until its write is known to be complete a record's
//! blocks are served from its memory, never from the device.
//!
//! Ordering: records sealed without a barrier were never promised to be
//! durable in any order (the crash harness drops, tears and reorders
//! every write not yet flushed), so they may be written concurrently and
//! complete in any order. A barrier (a flush, a FUA write, a checkpoint)
//! first writes every unclaimed record and waits for every claimed one,
//! then writes its epoch-end record with the fdatasync: everything sealed
//! before it is on the device when the barrier is issued.
//! Write-back only reads up to the last barrier, and eviction never passes
//! it, so neither ever reads a record still in flight.
//!
//! Waiting never needs the engine lock: a writer marks its record done and
//! signals [`RecordIo`] without it, and reports a failure to the engine's
//! health, so a barrier may wait while holding the engine lock.

mod claim_guard;
mod queue;
mod record;
mod record_io;
mod writers;

pub(crate) use claim_guard::ClaimGuard;
pub(crate) use queue::SealedQueue;
pub(crate) use record::SealedRecord;
pub(crate) use record_io::RecordIo;
pub(crate) use writers::RecordWriters;

use writers::RecordJob;

use std::sync::Arc;

use crate::env::Env;
use crate::error::EngineResult;
use crate::retry_policy::RetryPolicy;
use cairn_device::DeviceError;

/// Write records this call claimed, outside the engine lock. Inside a
/// reactor task the record writer threads write them (all at once) while
/// the task waits and its loop goes on; elsewhere they are written here,
/// in order. A failure marks the cache failed, as a failed seal always did
/// (the record stays queued with its data, for degraded mode).
pub(crate) async fn write_claimed(env: &Env, records: Vec<Arc<SealedRecord>>) -> EngineResult<()> {
    if records.is_empty() {
        return Ok(());
    }
    if cairn_io::Reactor::current().is_none() {
        return write_in_order(env, &records)
            .map_err(|e| env.health.cache_write_failed("sealing a log record", e));
    }
    hand_off(env, &records);
    for record in &records {
        record.written().await;
    }
    match records
        .iter()
        .find_map(|r| r.failure().map(|f| (r, f.to_string())))
    {
        None => Ok(()),
        Some((record, reason)) => {
            let e = DeviceError::Io {
                device: env.cache.name().to_string(),
                offset: record.at_bytes,
                len: record.length_bytes(),
                source: std::io::Error::other(reason),
            };
            Err(env.health.cache_write_failed("sealing a log record", e))
        }
    }
}

/// Write claimed `records` here, in order. At the first failure the rest
/// are not tried: each is published as failed, since a claimed record that
/// is never done would keep whoever waits for it (a barrier, the switch to
/// degraded mode) waiting forever. Their data stays in memory, queued, for
/// degraded mode.
pub(crate) fn write_in_order(env: &Env, records: &[Arc<SealedRecord>]) -> Result<(), DeviceError> {
    let _claimed = ClaimGuard::new(records, &env.record_io);
    for (k, record) in records.iter().enumerate() {
        if let Err(e) = record.write(env) {
            for rest in &records[k + 1..] {
                rest.publish(
                    env,
                    Err(format!(
                        "not written: the write of record {} before it failed",
                        record.sequence
                    )),
                );
            }
            return Err(e);
        }
    }
    Ok(())
}

/// [`write_claimed`] for records a read's fills completed, inside a
/// reactor task: handed to the writer threads and not waited for, so the
/// read's reply does not wait for a 256 KiB record write (one miss in 64
/// did). A record that fails is found by the next barrier or seal (the
/// queue's `prune`), and the cache goes degraded then, as for any failed
/// record write. Without a reactor it is [`write_claimed`].
pub(crate) async fn start_claimed(env: &Env, records: Vec<Arc<SealedRecord>>) -> EngineResult<()> {
    if records.is_empty() || cairn_io::Reactor::current().is_none() {
        return write_claimed(env, records).await;
    }
    hand_off(env, &records);
    Ok(())
}

/// Queue the records' writes on the writer threads, at once, before
/// anything can wait: whoever waits for one of these records (holding the
/// engine lock or not) only waits for a writer thread.
fn hand_off(env: &Env, records: &[Arc<SealedRecord>]) {
    let policy = RetryPolicy {
        attempts: env.config.cache_write_attempts.max(1),
        backoff_us: env.config.cache_write_backoff_us,
    };
    for record in records {
        env.record_writers.submit(RecordJob {
            record: record.clone(),
            cache: env.cache.clone(),
            counters: env.counters.clone(),
            record_io: env.record_io.clone(),
            policy,
        });
    }
}
