//! The records sealed without a barrier whose write may not be complete,
//! in sequence order: the suffix of the log from the first record not
//! known to be written.

use std::collections::VecDeque;
use std::sync::Arc;

use super::record::SealedRecord;
use crate::env::Env;
use crate::error::EngineResult;

/// Most sealed records kept in memory before the sealing call writes them
/// itself under the lock (the old, synchronous behaviour): 16 records of at
/// most 256 KiB, 4 MiB.
pub(crate) const SEALED_RECORDS_MAX: usize = 16;

/// A queued record and whether a thread has taken it on to write it.
struct Queued {
    record: Arc<SealedRecord>,
    claimed: bool,
}

#[derive(Default)]
pub(crate) struct SealedQueue {
    queued: VecDeque<Queued>,
}

impl SealedQueue {
    pub(crate) fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }

    /// Queue a record sealed without a barrier. Keeps the queue bounded by
    /// writing records here (under the engine lock) when it is full.
    pub(crate) fn push(&mut self, env: &Env, record: SealedRecord) -> EngineResult<()> {
        if let Some(last) = self.queued.back() {
            assert!(
                last.record.sequence < record.sequence,
                "records are queued in sequence order"
            );
        }
        self.queued.push_back(Queued {
            record: Arc::new(record),
            claimed: false,
        });
        self.prune(env)?;
        if self.queued.len() > SEALED_RECORDS_MAX {
            self.write_unclaimed(env)?;
            self.wait_until(env, SEALED_RECORDS_MAX)?;
        }
        Ok(())
    }

    /// Take on every unclaimed record, to be written by the caller once it
    /// has dropped the engine lock (with [`super::write_claimed`]).
    pub(crate) fn claim(&mut self) -> Vec<Arc<SealedRecord>> {
        let mut claimed = Vec::new();
        for queued in self.queued.iter_mut().filter(|q| !q.claimed) {
            queued.claimed = true;
            claimed.push(queued.record.clone());
        }
        claimed
    }

    /// Take on the unclaimed records that were sealed because they were
    /// full, leaving epoch ends to the barrier a flush sealed them for: its
    /// leader writes them with the fdatasync, in its own thread, where a
    /// write or read that took them on handed them to the record writers
    /// (two thread switches) and, a write, waited for another client's
    /// record. Once the queue is half full epoch ends are taken too, so
    /// neither many flushing clients nor an epoch end left at the front
    /// (which keeps written records behind it from leaving the queue) fill
    /// it and make a seal write records under the lock.
    pub(crate) fn claim_filled(&mut self) -> Vec<Arc<SealedRecord>> {
        let take_epoch_ends = self.queued.len() > SEALED_RECORDS_MAX / 2;
        let mut claimed = Vec::new();
        for queued in self.queued.iter_mut().filter(|q| !q.claimed) {
            if queued.record.header_fields.epoch_end() && !take_epoch_ends {
                continue;
            }
            queued.claimed = true;
            claimed.push(queued.record.clone());
        }
        claimed
    }

    /// Records another call claimed and is still writing.
    pub(crate) fn in_flight(&self) -> Vec<Arc<SealedRecord>> {
        self.queued
            .iter()
            .filter(|q| q.claimed && !q.record.is_done())
            .map(|q| q.record.clone())
            .collect()
    }

    /// Write every unclaimed record here, in sequence order.
    fn write_unclaimed(&mut self, env: &Env) -> EngineResult<()> {
        super::write_in_order(env, &self.claim())
            .map_err(|e| env.health.cache_write_failed("sealing a log record", e))
    }

    /// Wait (holding the engine lock: writers do not need it) until at most
    /// `keep` records are queued, dropping the written ones from the front.
    fn wait_until(&mut self, env: &Env, keep: usize) -> EngineResult<()> {
        loop {
            self.prune(env)?;
            if self.queued.len() <= keep {
                return Ok(());
            }
            let guard = env.record_io.lock();
            let front = self.queued.front().expect("more than `keep` queued");
            if front.record.is_done() {
                continue;
            }
            assert!(front.claimed, "waiting for a record nobody will write");
            drop(env.record_io.wait(guard));
        }
    }

    /// Drop written records from the front of the queue (only the front:
    /// the queue stays the suffix of the log from the first record not
    /// known written, which degraded mode relies on). A failed write
    /// anywhere marks the cache failed (degraded mode follows); the failed
    /// record stays queued, so its data is still in memory.
    pub(crate) fn prune(&mut self, env: &Env) -> EngineResult<()> {
        while self.queued.front().is_some_and(|q| q.record.is_written()) {
            self.queued.pop_front();
        }
        let failed = self.queued.iter().find_map(|q| {
            q.record.failure().map(|reason| {
                (
                    q.record.at_bytes,
                    q.record.length_bytes(),
                    reason.to_string(),
                )
            })
        });
        match failed {
            None => Ok(()),
            Some((offset, len, reason)) => {
                let e = cairn_device::DeviceError::Io {
                    device: env.cache.name().to_string(),
                    offset,
                    len,
                    source: std::io::Error::other(reason),
                };
                Err(env.health.cache_write_failed("sealing a log record", e))
            }
        }
    }

    /// Before a barrier: every sealed record is written and complete, so
    /// the barrier covers them.
    pub(crate) fn complete_all(&mut self, env: &Env) -> EngineResult<()> {
        self.write_unclaimed(env)?;
        self.wait_until(env, 0)?;
        assert!(
            self.queued.is_empty(),
            "a barrier follows every sealed record"
        );
        Ok(())
    }

    /// For degraded mode: wait for every record a thread is writing, and
    /// return where the queue starts in the log (`None` if it is empty).
    /// With the engine lock held the queue cannot change after this (only
    /// a sealing call or a prune, both under the lock, change it), so the
    /// log before that start can be read from the device and then the
    /// queue taken with [`SealedQueue::take_all`].
    pub(crate) fn settle(&self, env: &Env) -> Option<u64> {
        let mut guard = env.record_io.lock();
        while self.queued.iter().any(|q| q.claimed && !q.record.is_done()) {
            guard = env.record_io.wait(guard);
        }
        drop(guard);
        self.queued.front().map(|q| q.record.start)
    }

    /// For degraded mode: take the whole queue (written, failed or never
    /// written alike), in log order, once [`SealedQueue::settle`] waited
    /// for the writes in flight. Their data goes to the origin from memory.
    pub(crate) fn take_all(&mut self) -> Vec<Arc<SealedRecord>> {
        assert!(
            self.queued.iter().all(|q| !q.claimed || q.record.is_done()),
            "the queue is taken only once settled"
        );
        self.queued.drain(..).map(|q| q.record).collect()
    }

    /// The data block at `logical`, if a queued record holds it.
    pub(crate) fn block(&self, logical: u64, block_bytes: usize) -> Option<&[u8]> {
        self.queued
            .iter()
            .find_map(|q| q.record.block(logical, block_bytes))
    }
}
