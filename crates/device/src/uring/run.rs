//! Running a batch: submit, wait, reap, finish short transfers.

use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::Ordering;

use io_uring::types;

use super::ops::{build_entry, for_each_piece_after, Op, OpKind, MAX_IOVECS};
use super::ring_pool::{submit_and_wait, InFlightGuard, Ring};
use super::UringDevice;
use crate::{Device, DeviceError, DeviceResult};

/// Scratch entries a ring keeps between calls.
const SCRATCH_KEEP_OPS: usize = 1024;

impl UringDevice {
    /// Run every op queued on `ring`, then clear the queue, which returns
    /// the bounce buffers to their pool. Returns the first error.
    pub(super) fn run(&self, ring: &mut Ring) -> DeviceResult<()> {
        let result = self.run_queued(ring);
        if self.is_block_device && self.cacheable_reads_seen.load(Ordering::Relaxed) {
            self.drop_written_pages(&ring.ops);
        }
        ring.ops.clear();
        ring.iovecs.clear();
        // A huge batch (write_zeroes of gigabytes) must not pin its scratch
        // memory on the ring for ever.
        ring.ops.shrink_to(SCRATCH_KEEP_OPS);
        ring.iovecs.shrink_to(MAX_IOVECS);
        result
    }

    /// On a raw block device Linux invalidates cached pages before an
    /// asynchronous direct write but not after it, so a buffered read
    /// racing the write may have cached the old contents: do the second
    /// invalidation ourselves, as the kernel does for files (the engine's
    /// checksums catch what this still misses). One call per run of
    /// adjacent writes (a record split into several ops is one run); only
    /// once page-cache reads are in use at all.
    fn drop_written_pages(&self, ops: &[Op]) {
        let mut ranges: Vec<(u64, u64)> = ops
            .iter()
            .filter(|op| matches!(op.kind, OpKind::Write | OpKind::Writev))
            .map(|op| (op.offset, op.offset + op.len as u64))
            .collect();
        ranges.sort_unstable();
        let mut merged: Option<(u64, u64)> = None;
        for (start, end) in ranges {
            merged = match merged {
                Some((s, e)) if start <= e => Some((s, e.max(end))),
                Some((s, e)) => {
                    self.drop_cached_pages(s, e - s);
                    Some((start, end))
                }
                None => Some((start, end)),
            };
        }
        if let Some((s, e)) = merged {
            self.drop_cached_pages(s, e - s);
        }
    }

    fn run_queued(&self, ring: &mut Ring) -> DeviceResult<()> {
        let Ring {
            ring: uring,
            ops,
            iovecs,
        } = ring;
        let total = ops.len();
        if total == 0 {
            return Ok(());
        }
        let depth = uring.params().sq_entries() as usize;
        let fd = types::Fd(self.file.as_raw_fd());
        let buffered_fd = types::Fd(self.sync_file().as_raw_fd());
        let has_fsync = ops.iter().any(|op| op.kind == OpKind::Fsync);
        let mut next = 0usize;
        let mut completed = 0usize;
        let mut guard = InFlightGuard { in_flight: 0 };
        let mut first_error: Option<DeviceError> = None;
        let mut wrote_outside_ring = false;
        while completed < total {
            {
                let mut sq = uring.submission();
                // Never more in flight than the SQ holds, so the completion
                // queue (twice as large) cannot overflow.
                while next < total && guard.in_flight < depth {
                    let op_fd = if ops[next].buffered { buffered_fd } else { fd };
                    let entry = build_entry(&ops[next], op_fd, iovecs).user_data(next as u64);
                    // SAFETY: every pointer in the entry (caller buffers,
                    // bounce buffers owned by `ops`, the zero buffer, the
                    // iovecs) stays valid until the entry's completion is
                    // reaped: this loop does not end before every submitted
                    // entry completed (InFlightGuard aborts on unwinding),
                    // the caller's borrows outlive this call, and neither
                    // `ops` nor `iovecs` is resized until then.
                    if unsafe { sq.push(&entry) }.is_err() {
                        break;
                    }
                    next += 1;
                    guard.in_flight += 1;
                }
            }
            // One system call submits the batch and waits for all of it; a
            // batch larger than the ring waits for one completion at a time
            // to refill the queue.
            let want = if next < total { 1 } else { guard.in_flight };
            submit_and_wait(uring, want, &self.name);
            for cqe in uring.completion() {
                guard.in_flight -= 1;
                completed += 1;
                let Some(op) = ops.get_mut(cqe.user_data() as usize) else {
                    continue;
                };
                if let Err(err) = self.complete(op, cqe.result(), iovecs, &mut wrote_outside_ring) {
                    first_error.get_or_insert(err);
                }
            }
        }
        if wrote_outside_ring && has_fsync && first_error.is_none() {
            // Part of a write was finished with pwrite after the ring's
            // fdatasync may already have run: sync again so the flush covers it.
            self.file.sync_data().map_err(|e| self.io_error(0, 0, e))?;
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Account for one completion; finish a short or retryable transfer
    /// outside the ring.
    fn complete(
        &self,
        op: &mut Op,
        result: i32,
        iovecs: &[libc::iovec],
        wrote_outside_ring: &mut bool,
    ) -> DeviceResult<()> {
        if op.kind == OpKind::Fsync {
            if result < 0 {
                return Err(self.io_error(0, 0, io::Error::from_raw_os_error(-result)));
            }
            return Ok(());
        }
        let done_bytes = if result < 0 {
            let errno = -result;
            if errno != libc::EAGAIN && errno != libc::EINTR {
                return Err(self.io_error(
                    op.offset,
                    op.len as u64,
                    io::Error::from_raw_os_error(errno),
                ));
            }
            0
        } else {
            result as usize
        };
        if op.kind == OpKind::Read && result == 0 && op.len > 0 {
            let err = io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read past the end of the file",
            );
            return Err(self.io_error(op.offset, op.len as u64, err));
        }
        if done_bytes < op.len {
            self.finish_outside_ring(op, done_bytes, iovecs)?;
            if op.kind != OpKind::Read {
                *wrote_outside_ring = true;
            }
        }
        if op.kind == OpKind::Read && !op.copy_back.is_null() {
            // SAFETY: `copy_back` is the caller's buffer of `op.len` bytes,
            // borrowed for this call; `ptr` is the bounce buffer the read
            // filled with `op.len` bytes. They are different allocations.
            unsafe { std::ptr::copy_nonoverlapping(op.ptr, op.copy_back, op.len) };
        }
        Ok(())
    }

    fn finish_outside_ring(
        &self,
        op: &Op,
        done_bytes: usize,
        iovecs: &[libc::iovec],
    ) -> DeviceResult<()> {
        let err = |e| self.io_error(op.offset, op.len as u64, e);
        let file = self.sync_file();
        match op.kind {
            OpKind::Read => {
                // SAFETY: `ptr` points at `len` writable bytes (caller or
                // bounce memory) that nothing else uses during this call.
                let rest = unsafe {
                    std::slice::from_raw_parts_mut(op.ptr.add(done_bytes), op.len - done_bytes)
                };
                file.read_exact_at(rest, op.offset + done_bytes as u64)
                    .map_err(err)
            }
            OpKind::Write => {
                // SAFETY: `ptr` points at `len` readable bytes borrowed for
                // this call.
                let rest = unsafe {
                    std::slice::from_raw_parts(op.ptr.add(done_bytes), op.len - done_bytes)
                };
                file.write_all_at(rest, op.offset + done_bytes as u64)
                    .map_err(err)
            }
            OpKind::Writev => {
                let bufs = iovecs[op.iov_start..op.iov_start + op.iov_count]
                    .iter()
                    .map(|iov| {
                        // SAFETY: each iovec describes a caller buffer
                        // borrowed for this call.
                        unsafe {
                            std::slice::from_raw_parts(iov.iov_base as *const u8, iov.iov_len)
                        }
                    });
                for_each_piece_after(op.offset, bufs, done_bytes, |at, piece| {
                    file.write_all_at(piece, at).map_err(err)
                })
            }
            OpKind::Fsync => Ok(()),
        }
    }
}
