//! Sealed records whose write to the cache device happens outside the
//! engine lock, so that several records can be in flight at once while
//! other writers keep filling the next one.
//!
//! A record sealed without a barrier (it was full) is queued in
//! `Inner::sealed`. The engine call that sealed it *claims* it before
//! dropping the lock and writes it afterwards ([`Engine::write_claimed`]);
//! a record nobody claimed is written by the next barrier, or at once when
//! the queue is at its bound. Until its write is known to be complete a
//! record's blocks are served from its memory, never from the device.
//!
//! Ordering: records sealed without a barrier were never promised to be
//! durable in any order (the crash harness drops, tears and reorders
//! every write not yet flushed), so they may be written concurrently and
//! complete in any order. A barrier (a flush, a FUA write, a checkpoint)
//! first writes every unclaimed record and waits for every claimed one,
//! then writes its epoch-end record with the fdatasync: everything sealed
//! before it is on the device when the barrier is issued, as before.
//! Write-back only reads up to the last barrier, and eviction never passes
//! it, so neither ever reads a record still in flight.
//!
//! Waiting never needs the engine lock: a writer marks its record done and
//! signals [`RecordIo`] before it takes the engine lock again (only to
//! report a failure), so a barrier may wait while holding the engine lock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use cairn_device::PooledBuf;
use cairn_format::RecordHeader;

use crate::engine::*;
use crate::error::{EngineError, EngineResult};
use crate::log::retrying_cache_write;

/// Most sealed records kept in memory before the sealing call writes them
/// itself under the lock (the old, synchronous behaviour): 16 records of at
/// most 256 KiB, 4 MiB.
pub(crate) const SEALED_RECORDS_MAX: usize = 16;

/// A record sealed but not yet known to be written.
pub(crate) struct SealedRecord {
    pub sequence: u64,
    /// Logical offset of its header block; data blocks follow.
    pub start: u64,
    pub data_count: u64,
    /// Byte offset on the cache device.
    pub at_bytes: u64,
    pub header: PooledBuf,
    /// The header, decoded: degraded mode copies a record that may never
    /// have reached the cache from memory.
    pub header_fields: RecordHeader,
    pub data: PooledBuf,
    /// Set once the write completed (successfully or not); `outcome` says.
    done: AtomicBool,
    outcome: OnceLock<Result<(), String>>,
}

/// A queued record and whether a thread has taken it on to write it.
pub(crate) struct Queued {
    pub record: Arc<SealedRecord>,
    pub claimed: bool,
}

/// Where threads wait for record writes to complete.
#[derive(Default)]
pub(crate) struct RecordIo {
    lock: Mutex<()>,
    changed: Condvar,
}

impl SealedRecord {
    pub(crate) fn new(
        env: &Env,
        start: u64,
        at_bytes: u64,
        header_fields: RecordHeader,
        header: PooledBuf,
        data: PooledBuf,
    ) -> SealedRecord {
        let sequence = header_fields.sequence;
        let bs = env.bs;
        assert!(data.len().is_multiple_of(bs));
        SealedRecord {
            sequence,
            start,
            data_count: (data.len() / bs) as u64,
            at_bytes,
            header,
            header_fields,
            data,
            done: AtomicBool::new(false),
            outcome: OnceLock::new(),
        }
    }

    fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// The data block at `logical`, if this record holds it.
    fn block(&self, logical: u64, bs: usize) -> Option<&[u8]> {
        if logical > self.start && logical <= self.start + self.data_count {
            let k = (logical - self.start - 1) as usize;
            Some(&self.data[k * bs..(k + 1) * bs])
        } else {
            None
        }
    }

    /// Write it (header and data in one vectored write, no barrier) and
    /// publish the outcome. Never takes the engine lock.
    fn write(&self, env: &Env) -> Result<(), cairn_device::DeviceError> {
        assert!(!self.is_done(), "record {} written twice", self.sequence);
        let bufs: &[&[u8]] = if self.data.is_empty() {
            &[&self.header]
        } else {
            &[&self.header, &self.data]
        };
        // No barrier is involved, so a failed attempt can be retried.
        let result = retrying_cache_write(env, "sealing a log record", true, || {
            env.cache.write_vectored_at(self.at_bytes, bufs)
        });
        let outcome = result.as_ref().map(|_| ()).map_err(|e| e.to_string());
        assert!(self.outcome.set(outcome).is_ok(), "one outcome per record");
        {
            let _guard = env.record_io.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.done.store(true, Ordering::Release);
            env.record_io.changed.notify_all();
        }
        result
    }
}

impl Inner {
    /// Queue a record sealed without a barrier. Keeps the queue bounded by
    /// writing records here (under the lock) when it is full.
    pub(crate) fn queue_sealed(&mut self, env: &Env, record: SealedRecord) -> EngineResult<()> {
        if let Some(last) = self.sealed.back() {
            assert!(
                last.record.sequence < record.sequence,
                "records are queued in sequence order"
            );
        }
        self.sealed.push_back(Queued {
            record: Arc::new(record),
            claimed: false,
        });
        self.prune_sealed(env)?;
        if self.sealed.len() > SEALED_RECORDS_MAX {
            self.write_unclaimed(env)?;
            self.wait_sealed(env, SEALED_RECORDS_MAX)?;
        }
        Ok(())
    }

    /// Take on every unclaimed record, to be written by the caller once it
    /// has dropped the lock (with [`Engine::write_claimed`]).
    pub(crate) fn claim_sealed(&mut self) -> Vec<Arc<SealedRecord>> {
        let mut claimed = Vec::new();
        for queued in self.sealed.iter_mut().filter(|q| !q.claimed) {
            queued.claimed = true;
            claimed.push(queued.record.clone());
        }
        claimed
    }

    /// Write every unclaimed record here, in sequence order.
    fn write_unclaimed(&mut self, env: &Env) -> EngineResult<()> {
        for record in self.claim_sealed() {
            if let Err(e) = record.write(env) {
                return Err(self.fail(env, "sealing a log record", e));
            }
        }
        Ok(())
    }

    /// Wait (holding the engine lock: writers do not need it) until at most
    /// `keep` records are queued, dropping the written ones from the front.
    fn wait_sealed(&mut self, env: &Env, keep: usize) -> EngineResult<()> {
        loop {
            self.prune_sealed(env)?;
            if self.sealed.len() <= keep {
                return Ok(());
            }
            let guard = env.record_io.lock.lock().unwrap_or_else(|p| p.into_inner());
            let front = self.sealed.front().expect("more than `keep` queued");
            if front.record.is_done() {
                continue;
            }
            assert!(front.claimed, "waiting for a record nobody will write");
            drop(
                env.record_io
                    .changed
                    .wait(guard)
                    .unwrap_or_else(|p| p.into_inner()),
            );
        }
    }

    /// Drop written records from the front of the queue (only the front:
    /// the queue stays the suffix of the log from the first record not
    /// known written, which degraded mode relies on). A failed write
    /// anywhere marks the cache failed (degraded mode follows); the failed
    /// record stays queued, so its data is still in memory.
    fn prune_sealed(&mut self, env: &Env) -> EngineResult<()> {
        while self
            .sealed
            .front()
            .is_some_and(|q| q.record.is_done() && matches!(q.record.outcome.get(), Some(Ok(()))))
        {
            self.sealed.pop_front();
        }
        let failed = self
            .sealed
            .iter()
            .find_map(|q| match q.record.outcome.get() {
                Some(Err(reason)) if q.record.is_done() => Some((
                    q.record.at_bytes,
                    q.record.header.len() + q.record.data.len(),
                    reason.clone(),
                )),
                _ => None,
            });
        match failed {
            None => Ok(()),
            Some((at, len, reason)) => {
                let e = cairn_device::DeviceError::Io {
                    device: env.cache.name().to_string(),
                    offset: at,
                    len: len as u64,
                    source: std::io::Error::other(reason),
                };
                Err(self.fail(env, "sealing a log record", e))
            }
        }
    }

    /// For degraded mode: wait for every record a thread is writing, then
    /// take the whole queue (written, failed or never written alike), in
    /// log order. Their data goes to the origin from memory.
    pub(crate) fn take_sealed(&mut self, env: &Env) -> Vec<Arc<SealedRecord>> {
        {
            let mut guard = env.record_io.lock.lock().unwrap_or_else(|p| p.into_inner());
            while self.sealed.iter().any(|q| q.claimed && !q.record.is_done()) {
                guard = env
                    .record_io
                    .changed
                    .wait(guard)
                    .unwrap_or_else(|p| p.into_inner());
            }
        }
        self.sealed.drain(..).map(|q| q.record).collect()
    }

    /// Before a barrier: every sealed record is written and complete, so
    /// the barrier covers them.
    pub(crate) fn complete_sealed(&mut self, env: &Env) -> EngineResult<()> {
        self.write_unclaimed(env)?;
        self.wait_sealed(env, 0)?;
        assert!(
            self.sealed.is_empty(),
            "a barrier follows every sealed record"
        );
        Ok(())
    }

    /// A data block still in memory: in the open record, or in a sealed
    /// record whose write may not be complete.
    pub(crate) fn block_in_memory(&self, slot: u32, bs: usize) -> Option<&[u8]> {
        if let Some(k) = self.open_slot_index(slot) {
            let open = self.open.as_ref().expect("open record");
            return Some(&open.data[k * bs..(k + 1) * bs]);
        }
        if self.sealed.is_empty() {
            return None;
        }
        let logical = self.logical_of(slot);
        self.sealed.iter().find_map(|q| q.record.block(logical, bs))
    }
}

impl Engine {
    /// Write records this call claimed, outside the engine lock. A failure
    /// fails the engine, as a failed seal always did.
    pub(crate) fn write_claimed(&self, records: Vec<Arc<SealedRecord>>) -> EngineResult<()> {
        for record in records {
            if let Err(e) = record.write(&self.env) {
                let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
                return Err(match inner.prune_sealed(&self.env) {
                    Err(failed) => failed,
                    Ok(()) => EngineError::Cache(e),
                });
            }
        }
        Ok(())
    }
}
