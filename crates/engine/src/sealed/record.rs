//! One record sealed but not yet known to be written.

use std::future::poll_fn;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::task::{Poll, Waker};

use cairn_device::DeviceError;
use cairn_format::RecordHeader;

use super::record_io::RecordIo;
use crate::env::Env;
use crate::retry::retrying_cache_write;
use cairn_device::PooledBuf;

pub(crate) struct SealedRecord {
    pub(crate) sequence: u64,
    /// Logical offset of its header block; data blocks follow.
    pub(crate) start: u64,
    pub(crate) data_count: u64,
    /// Byte offset on the cache device.
    pub(crate) at_bytes: u64,
    pub(crate) header: PooledBuf,
    /// The header, decoded: degraded mode copies a record that may never
    /// have reached the cache from memory.
    pub(crate) header_fields: RecordHeader,
    pub(crate) data: PooledBuf,
    /// Set once the write completed (successfully or not); `outcome` says.
    done: AtomicBool,
    /// Set by a barrier once its write of the record succeeded, before its
    /// sync: another barrier's sync then covers the record too, so that
    /// barrier need not wait for this one's (see `crate::commit`). The
    /// record stays unpublished, its data in memory, until this sync ends.
    on_device: AtomicBool,
    outcome: OnceLock<Result<(), String>>,
    /// Tasks waiting for the write (see [`SealedRecord::written`]).
    wakers: Mutex<Vec<Waker>>,
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
        let block_bytes = env.block_size_bytes;
        assert!(data.len().is_multiple_of(block_bytes));
        SealedRecord {
            sequence: header_fields.sequence,
            start,
            data_count: (data.len() / block_bytes) as u64,
            at_bytes,
            header,
            header_fields,
            data,
            done: AtomicBool::new(false),
            on_device: AtomicBool::new(false),
            outcome: OnceLock::new(),
            wakers: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Written, and successfully.
    pub(crate) fn is_written(&self) -> bool {
        self.is_done() && matches!(self.outcome.get(), Some(Ok(())))
    }

    /// Why its write failed, once it did.
    pub(crate) fn failure(&self) -> Option<&str> {
        match self.outcome.get() {
            Some(Err(reason)) if self.is_done() => Some(reason),
            _ => None,
        }
    }

    /// Bytes on the device: the header block and the data blocks.
    pub(crate) fn length_bytes(&self) -> u64 {
        (self.header.len() + self.data.len()) as u64
    }

    /// The data block at `logical`, if this record holds it.
    pub(crate) fn block(&self, logical: u64, block_bytes: usize) -> Option<&[u8]> {
        if logical > self.start && logical <= self.start + self.data_count {
            let k = (logical - self.start - 1) as usize;
            Some(&self.data[k * block_bytes..(k + 1) * block_bytes])
        } else {
            None
        }
    }

    /// The buffers to write, back to back from `at_bytes`: the header
    /// block, then the data blocks.
    pub(crate) fn bufs(&self) -> Vec<&[u8]> {
        if self.data.is_empty() {
            vec![&self.header]
        } else {
            vec![&self.header, &self.data]
        }
    }

    /// Write it (header and data in one vectored write, no barrier) and
    /// publish the outcome. Never takes the engine lock.
    pub(crate) fn write(&self, env: &Env) -> Result<(), DeviceError> {
        assert!(!self.is_done(), "record {} written twice", self.sequence);
        let bufs = self.bufs();
        // No barrier is involved, so a failed attempt can be retried.
        let result = retrying_cache_write(env, "sealing a log record", true, || {
            env.cache.write_vectored_at(self.at_bytes, &bufs)
        });
        self.publish(env, result.as_ref().map(|_| ()).map_err(|e| e.to_string()));
        result
    }

    /// Publish the outcome of its write (made by [`SealedRecord::write`] or
    /// as part of a barrier's) and wake whoever waits for it.
    pub(crate) fn publish(&self, env: &Env, outcome: Result<(), String>) {
        self.publish_to(&env.record_io, outcome);
    }

    /// [`SealedRecord::publish`] for a thread without the engine's `Env`.
    pub(crate) fn publish_to(&self, record_io: &RecordIo, outcome: Result<(), String>) {
        assert!(!self.is_done(), "record {} written twice", self.sequence);
        assert!(self.outcome.set(outcome).is_ok(), "one outcome per record");
        {
            let guard = record_io.lock();
            self.done.store(true, Ordering::Release);
            record_io.notify(&guard);
        }
        let wakers = std::mem::take(&mut *self.lock_wakers());
        for waker in wakers {
            waker.wake();
        }
    }

    fn lock_wakers(&self) -> std::sync::MutexGuard<'_, Vec<Waker>> {
        self.wakers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait as a task until its write completed (successfully or not).
    pub(crate) async fn written(&self) {
        poll_fn(|cx| {
            if self.is_done() {
                return Poll::Ready(());
            }
            let mut wakers = self.lock_wakers();
            // Checked again under the lock `publish_to` takes after it set
            // `done`: a completion in between is never missed.
            if self.is_done() {
                return Poll::Ready(());
            }
            if !wakers.iter().any(|w| w.will_wake(cx.waker())) {
                wakers.push(cx.waker().clone());
            }
            Poll::Pending
        })
        .await
    }

    /// A barrier wrote it and has yet to sync: it is on the device, not
    /// yet known durable. Wakes [`SealedRecord::wait_on_device`].
    pub(crate) fn mark_on_device(&self, env: &Env) {
        assert!(
            !self.is_done(),
            "record {} marked after its outcome",
            self.sequence
        );
        let guard = env.record_io.lock();
        self.on_device.store(true, Ordering::Release);
        env.record_io.notify(&guard);
    }

    /// Wait (without the engine lock) until its outcome is published: its
    /// write completed (a record writer's), or the barrier that wrote it
    /// ended its sync. A barrier whose sync overlapped another's waits for
    /// this before it vouches for anything: a failed sync may have lost
    /// every write the device had not made durable, this one included,
    /// and only that barrier's outcome says so.
    pub(crate) fn wait_done(&self, env: &Env) {
        let mut guard = env.record_io.lock();
        while !self.is_done() {
            guard = env.record_io.wait(guard);
        }
    }

    /// Wait (without the engine lock) until its write completed, or a
    /// barrier's write of it did and that barrier's sync is still to come.
    /// Either way a flush that starts now covers what was written.
    pub(crate) fn wait_on_device(&self, env: &Env) {
        let mut guard = env.record_io.lock();
        while !self.is_done() && !self.on_device.load(Ordering::Acquire) {
            guard = env.record_io.wait(guard);
        }
    }
}
