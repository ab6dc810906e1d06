//! Regular files and block devices through io_uring, with O_DIRECT.
//!
//! # Threading model: a small, fixed pool of rings per device
//!
//! Each [`UringDevice`] owns `ring_count` rings (default 16), created at
//! open. A caller takes a free ring (try-lock, starting from a ring chosen
//! per thread so that a thread keeps finding its own ring free, then a
//! blocking lock on that one if all are busy), pushes *all* the I/Os of its call (`read_many`,
//! `write_many`, a vectored write plus its fdatasync...), submits them with one
//! `io_uring_enter` that also waits for them, reaps its own completions and
//! releases the ring. So:
//!
//! - several callers have I/O in flight at once (one per ring), and one caller
//!   has a whole batch in flight with a single system call;
//! - nothing spins: there is no SQPOLL thread and no completion-polling loop,
//!   a caller sleeps in the kernel until its I/O is done. On 2 cores a polling
//!   thread would steal a whole core from the engine;
//! - no thread per request and no completion thread: a completion is always
//!   reaped by the thread that waits for it, so there is no hand-off (no extra
//!   context switch) and no dispatch table shared between threads;
//! - resources are bounded and allocated at open: rings are not tied to the
//!   caller's threads (a thread-local ring per caller would grow with however
//!   many threads the NBD front end or the engine spawn, and would fail to set
//!   up in the middle of an I/O instead of at open, where we can still fall
//!   back to pread/pwrite).
//!
//! The cost is that a caller's batch is limited to the ring's queue depth in
//! flight at a time (larger batches are fed in as completions free slots), and
//! that more concurrent callers than rings queue on a lock rather than in the
//! kernel. A ring holds one caller's I/O for the whole of its call, so the
//! pool has more rings than the daemon has threads doing I/O (8 NBD workers,
//! the connection readers and write-back): with fewer, callers queued on the
//! ring locks and the device saw at most `ring_count` I/Os at a time (the
//! benchmark measured 4, and 12.7% of daemon CPU in the contended lock).
//! A ring costs a few pages of kernel memory.
//!
//! # Buffers
//!
//! O_DIRECT needs the offset, the length and the memory aligned. Offsets and
//! lengths aligned to the logical block size go straight to the kernel; the
//! caller's memory is used in place when it is aligned too, otherwise the data
//! goes through a bounce buffer, a [`crate::BlockBuf`] from one of the
//! device's [`crate::BufPool`]s (a pool per size class) that are reused (no
//! allocation per I/O once the pool is warm). An offset or length that is
//! not aligned at all is served by pread/pwrite on a second, buffered
//! descriptor of the same file: Linux keeps the page cache coherent with direct
//! I/O on the same inode, and fdatasync covers both.
//!
//! # Durability
//!
//! `flush` is fdatasync(2), called by the thread that wants it.
//! `write_vectored_and_flush` (a log record and its barrier) is pwritev(2)
//! on the direct descriptor then fdatasync(2), in the calling thread, when
//! the buffers are aligned (they always are for log records): io_uring
//! cannot run an fsync without handing it to a kernel worker thread, and
//! the extra wake-ups cost more than the system call saves.
//! `write_many_and_flush`, and a vectored barrier write whose memory is not
//! aligned, submit the writes and an IORING_OP_FSYNC (FSYNC_DATASYNC) in
//! one system call: the fsync carries IOSQE_IO_DRAIN, so it starts only
//! once every write before it has completed.

mod bounce;
mod open;
mod ops;
mod options;
mod ring_pool;
mod run;

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::OnceLock;

use cairn_io::Reactor;

use crate::file::{discard_range, pwritev_at, zero_range_in_kernel};
use crate::{check_range, BlockBuf, BufSlice, Device, DeviceError, DeviceFuture, DeviceResult};
use bounce::{BouncePool, BOUNCE_CHUNK_BYTES};
use ops::{for_each_piece_after, Op, OpKind, MAX_IOVECS};

pub(crate) use open::OpenFileFn;
pub use options::UringOptions;
pub(crate) use ring_pool::RingPool;

/// The all-zero buffer used to write zeroes when the kernel cannot zero a
/// range itself.
const ZERO_CHUNK_BYTES: usize = 1 << 20;

/// A regular file or block device served through io_uring (see the module
/// documentation). Open it with [`UringDevice::open`], or let
/// [`crate::open_local`] choose between it and [`crate::FileDevice`].
pub struct UringDevice {
    /// The descriptor the rings use (O_DIRECT unless the filesystem refused).
    file: File,
    /// A buffered descriptor of the same file for I/O that O_DIRECT cannot
    /// take (unaligned offset or length, or the tail of a short transfer).
    /// `None` when `file` is buffered itself.
    unaligned_file: Option<File>,
    name: String,
    identity: String,
    size_bytes: u64,
    is_block_device: bool,
    direct: bool,
    /// Offsets and lengths of direct I/O must be multiples of this (1 when
    /// buffered).
    offset_align_bytes: u64,
    /// Memory of direct I/O must be aligned to this (1 when buffered).
    mem_align_bytes: usize,
    rings: RingPool,
    /// Bounce buffers for memory O_DIRECT cannot take as it is.
    bounce: BouncePool,
    /// [`ZERO_CHUNK_BYTES`] of zeroes, mapped on first use.
    zeroes: OnceLock<BlockBuf>,
    /// Set by the first `read_many_cacheable`: until then no page of the
    /// device is cached by us, so writes need not drop any.
    cacheable_reads_seen: AtomicBool,
    /// Cacheable reads left to send straight to the ring, without first
    /// trying the page cache at once (see `read_cached_now`).
    nowait_skips: AtomicU32,
    /// Descriptors of the same file opened apart, one per flush lane
    /// (empty: one lane, `file`'s; see `open::flush_lanes`).
    flush_lanes: Vec<File>,
}

/// After a cacheable read found its pages missing, this many more go
/// straight to the ring: a working set that is not in the page cache then
/// pays the failed attempt on one read in 17, not on every one.
const NOWAIT_SKIPS_AFTER_MISS: u32 = 16;

impl UringDevice {
    /// Whether I/O bypasses the page cache (O_DIRECT).
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// The offset and length granularity of direct I/O (1 when buffered).
    pub fn direct_offset_align_bytes(&self) -> u64 {
        self.offset_align_bytes
    }

    fn io_error(&self, offset: u64, len: u64, source: io::Error) -> DeviceError {
        DeviceError::Io {
            device: self.name.clone(),
            offset,
            len,
            source,
        }
    }

    fn range_aligned(&self, offset: u64, len: usize) -> bool {
        offset.is_multiple_of(self.offset_align_bytes)
            && (len as u64).is_multiple_of(self.offset_align_bytes)
    }

    fn mem_aligned(&self, ptr: *const u8) -> bool {
        (ptr as usize).is_multiple_of(self.mem_align_bytes)
    }

    /// A read on the current thread's reactor, when there is one and the
    /// read can go to the kernel as it is (direct reads need an aligned
    /// range and memory; cacheable reads go to the buffered descriptor);
    /// otherwise `None`, and the caller reads synchronously.
    fn reactor_read<'a>(
        &'a self,
        offset: u64,
        slice: BufSlice,
        cacheable: bool,
    ) -> Result<DeviceFuture<'a, (DeviceResult<()>, BufSlice)>, BufSlice> {
        let Some(reactor) = Reactor::current() else {
            return Err(slice);
        };
        let len = slice.len();
        if len == 0 || check_range(&self.name, "read", offset, len as u64, self.size_bytes).is_err()
        {
            return Err(slice);
        }
        let fd = match (&self.unaligned_file, cacheable) {
            (Some(buffered), true) => {
                self.cacheable_reads_seen.store(true, Ordering::Relaxed);
                buffered.as_raw_fd()
            }
            _ if self.range_aligned(offset, len) && self.mem_aligned(slice.as_slice().as_ptr()) => {
                self.file.as_raw_fd()
            }
            _ => return Err(slice),
        };
        let mut slice = slice;
        if cacheable && self.read_cached_now(fd, offset, &mut slice) {
            return Ok(Box::pin(std::future::ready((Ok(()), slice))));
        }
        Ok(Box::pin(async move {
            let (result, mut slice) = reactor.read_at(fd, offset, slice).await;
            let result = match result {
                Ok(n) if n == len => Ok(()),
                // A short transfer (never at the end: the range was
                // checked): finish it outside the ring, like the sync path.
                Ok(n) => self.sync_read(offset + n as u64, &mut slice.as_mut_slice()[n..]),
                Err(e) => Err(self.io_error(offset, len as u64, e)),
            };
            (result, slice)
        }))
    }

    /// Serve a cacheable read from the page cache at once, if every page
    /// of it is there (`preadv2` with `RWF_NOWAIT`): true if `slice` is
    /// filled. The request then finishes in the loop turn it started in,
    /// without a ring operation, its completion and a task wake-up; that
    /// was about a tenth of a busy connection's CPU on cached 4 KiB reads.
    /// Anything short of the whole read (pages missing, a short read, an
    /// error) leaves it to the ring, which reads it all again.
    fn read_cached_now(&self, fd: i32, offset: u64, slice: &mut BufSlice) -> bool {
        let skips = self.nowait_skips.load(Ordering::Relaxed);
        if skips > 0 {
            self.nowait_skips.store(skips - 1, Ordering::Relaxed);
            return false;
        }
        let buf = slice.as_mut_slice();
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: `iov` covers exactly the slice's bytes, which the slice
        // owns and nothing else touches during the call; `fd` is our
        // buffered descriptor, open for the device's lifetime.
        let n = unsafe { libc::preadv2(fd, &iov, 1, offset as libc::off_t, libc::RWF_NOWAIT) };
        if n >= 0 && n as usize == buf.len() {
            return true;
        }
        self.nowait_skips
            .store(NOWAIT_SKIPS_AFTER_MISS, Ordering::Relaxed);
        false
    }

    /// The descriptor for I/O outside the rings: it takes any alignment.
    fn sync_file(&self) -> &File {
        self.unaligned_file.as_ref().unwrap_or(&self.file)
    }

    fn sync_read(&self, offset: u64, buf: &mut [u8]) -> DeviceResult<()> {
        self.sync_file()
            .read_exact_at(buf, offset)
            .map_err(|e| self.io_error(offset, buf.len() as u64, e))
    }

    fn sync_write(&self, offset: u64, buf: &[u8]) -> DeviceResult<()> {
        self.sync_file()
            .write_all_at(buf, offset)
            .map_err(|e| self.io_error(offset, buf.len() as u64, e))
    }

    /// Fail with [`DeviceError::OutOfRange`] on the first of the
    /// (offset, length) ranges past the end.
    fn check_ranges(
        &self,
        op: &'static str,
        ranges: impl IntoIterator<Item = (u64, u64)>,
    ) -> DeviceResult<()> {
        for (offset, len) in ranges {
            check_range(&self.name, op, offset, len, self.size_bytes)?;
        }
        Ok(())
    }

    fn check_read_ranges(&self, requests: &[(u64, &mut [u8])]) -> DeviceResult<()> {
        let ranges = requests.iter().map(|(o, b)| (*o, b.len() as u64));
        self.check_ranges("read", ranges)
    }

    fn write_batch(&self, requests: &[(u64, &[u8])], flush: bool) -> DeviceResult<()> {
        self.check_ranges("write", requests.iter().map(|(o, b)| (*o, b.len() as u64)))?;
        // Unaligned pieces first, outside the ring: they complete before the
        // ring's fdatasync is even submitted, so it covers them.
        for (offset, buf) in requests {
            if !buf.is_empty() && !self.range_aligned(*offset, buf.len()) {
                self.sync_write(*offset, buf)?;
            }
        }
        let mut guard = self.rings.acquire();
        let ring = &mut *guard;
        for (offset, buf) in requests {
            if !buf.is_empty() && self.range_aligned(*offset, buf.len()) {
                self.push_write(ring, *offset, buf);
            }
        }
        if flush {
            Self::push_fsync(ring);
        }
        self.run(ring)
    }

    /// Write runs of buffers (each run back to back from its offset), then
    /// with `flush` an fdatasync, in one ring submission. Runs the direct
    /// descriptor cannot take go first through the buffered one: they
    /// complete before the ring's fdatasync is even submitted, so it covers
    /// them.
    fn writev_runs(&self, runs: &[(u64, &[&[u8]])], flush: bool) -> DeviceResult<()> {
        let total_of = |bufs: &[&[u8]]| bufs.iter().map(|b| b.len()).sum::<usize>();
        self.check_ranges("write", runs.iter().map(|(o, b)| (*o, total_of(b) as u64)))?;
        for (offset, bufs) in runs {
            let total = total_of(bufs);
            if total > 0 && !self.range_aligned(*offset, total) {
                let pieces = bufs.iter().copied();
                for_each_piece_after(*offset, pieces, 0, |at, p| self.sync_write(at, p))?;
            }
        }
        let mut guard = self.rings.acquire();
        let ring = &mut *guard;
        for (offset, bufs) in runs {
            let total = total_of(bufs);
            if total > 0 && self.range_aligned(*offset, total) {
                self.push_writev(ring, *offset, bufs);
            }
        }
        if flush {
            Self::push_fsync(ring);
        }
        self.run(ring)
    }

    /// A write in the calling thread: pwritev on the direct descriptor;
    /// None when the buffers do not suit O_DIRECT as they are (the ring
    /// then bounces them). A barrier's write goes this way, then its
    /// fdatasync: through the ring the fdatasync waits for the write with
    /// IO_DRAIN and then runs on a kernel worker thread, and each step
    /// wakes another thread: on the fsync-bound W1 benchmark (4 KiB
    /// writes, each flushed) that cost 25-30 us per flush, 7.8-8.2k IOPS
    /// against 10.3-10.9k this way.
    fn inline_write(&self, offset: u64, bufs: &[&[u8]]) -> Option<DeviceResult<()>> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if !self.direct
            || bufs.len() > MAX_IOVECS
            || total > BOUNCE_CHUNK_BYTES
            || !self.range_aligned(offset, total)
            || !bufs
                .iter()
                .all(|b| self.mem_aligned(b.as_ptr()) && self.range_aligned(0, b.len()))
        {
            return None;
        }
        if let Err(e) = check_range(&self.name, "write", offset, total as u64, self.size_bytes) {
            return Some(Err(e));
        }
        let written = match pwritev_at(&self.file, offset, bufs) {
            Ok(written) => written,
            // Signals kept interrupting it: let the ring do the write.
            Err(err) if err.kind() == io::ErrorKind::Interrupted => return None,
            Err(err) => return Some(Err(self.io_error(offset, total as u64, err))),
        };
        if written < total {
            // Finish the rest through the buffered descriptor, like a short
            // ring transfer; the flush that follows covers it.
            let pieces = bufs.iter().copied();
            let rest =
                for_each_piece_after(offset, pieces, written, |at, p| self.sync_write(at, p));
            if let Err(e) = rest {
                return Some(Err(e));
            }
        }
        Some(Ok(()))
    }

    fn zero_buffer(&self) -> &BlockBuf {
        self.zeroes
            .get_or_init(|| BlockBuf::zeroed(ZERO_CHUNK_BYTES))
    }
}

impl Device for UringDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn backend(&self) -> &'static str {
        if self.direct {
            "uring-direct"
        } else {
            "uring-buffered"
        }
    }

    fn identity(&self) -> String {
        self.identity.clone()
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn alignment_bytes(&self) -> u32 {
        (self.offset_align_bytes as u32).max(512)
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> DeviceResult<()> {
        self.read_many(&mut [(offset, buf)])
    }

    fn read_into<'a>(
        &'a self,
        offset: u64,
        slice: BufSlice,
    ) -> DeviceFuture<'a, (DeviceResult<()>, BufSlice)> {
        match self.reactor_read(offset, slice, false) {
            Ok(future) => future,
            Err(mut slice) => {
                let result = self.read_at(offset, slice.as_mut_slice());
                Box::pin(std::future::ready((result, slice)))
            }
        }
    }

    fn read_into_cacheable<'a>(
        &'a self,
        offset: u64,
        slice: BufSlice,
    ) -> DeviceFuture<'a, (DeviceResult<()>, BufSlice)> {
        match self.reactor_read(offset, slice, true) {
            Ok(future) => future,
            Err(mut slice) => {
                let result = self.read_many_cacheable(&mut [(offset, slice.as_mut_slice())]);
                Box::pin(std::future::ready((result, slice)))
            }
        }
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> DeviceResult<()> {
        self.write_batch(&[(offset, buf)], false)
    }

    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        self.writev_runs(&[(offset, bufs)], false)
    }

    fn write_vectored_inline(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        match self.inline_write(offset, bufs) {
            Some(result) => result,
            None => self.writev_runs(&[(offset, bufs)], false),
        }
    }

    fn write_vectored_and_flush(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        match self.inline_write(offset, bufs) {
            Some(result) => result.and_then(|()| self.flush()),
            None => self.writev_runs(&[(offset, bufs)], true),
        }
    }

    fn read_many(&self, requests: &mut [(u64, &mut [u8])]) -> DeviceResult<()> {
        self.check_read_ranges(requests)?;
        for (offset, buf) in requests.iter_mut() {
            if !buf.is_empty() && !self.range_aligned(*offset, buf.len()) {
                self.sync_read(*offset, buf)?;
            }
        }
        let mut guard = self.rings.acquire();
        let ring = &mut *guard;
        for (offset, buf) in requests.iter_mut() {
            if !buf.is_empty() && self.range_aligned(*offset, buf.len()) {
                self.push_read(ring, *offset, buf);
            }
        }
        self.run(ring)
    }

    /// Through the buffered descriptor when the device is direct, so hot
    /// blocks are served from the page cache. Coherence: every write to
    /// the file goes through O_DIRECT (or the same buffered descriptor), and
    /// Linux invalidates cached pages over a range when a direct write to it
    /// completes; the caller verifies checksums and re-reads a mismatch
    /// with [`Device::read_at`], which is direct.
    fn read_many_cacheable(&self, requests: &mut [(u64, &mut [u8])]) -> DeviceResult<()> {
        if self.unaligned_file.is_none() {
            // Buffered already: read_many goes through the page cache.
            return self.read_many(requests);
        }
        self.cacheable_reads_seen.store(true, Ordering::Relaxed);
        self.check_read_ranges(requests)?;
        let mut guard = self.rings.acquire();
        let ring = &mut *guard;
        for (offset, buf) in requests.iter_mut() {
            if !buf.is_empty() {
                Self::push_buffered_read(ring, *offset, buf);
            }
        }
        self.run(ring)
    }

    fn drop_cached_pages(&self, offset: u64, len: u64) {
        // A zero length would mean "to the end of the file" to fadvise.
        if len == 0 {
            return;
        }
        let Some(buffered) = &self.unaligned_file else {
            return;
        };
        // DONTNEED drops whole pages only: round out to the page size.
        // SAFETY: sysconf has no preconditions.
        let page = (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as u64;
        let start = offset / page * page;
        let end = (offset + len).div_ceil(page) * page;
        // SAFETY: posix_fadvise on a descriptor we own; no memory is
        // passed. Advice only: a failure changes nothing we rely on.
        let _ = unsafe {
            libc::posix_fadvise(
                buffered.as_raw_fd(),
                start as libc::off_t,
                (end - start) as libc::off_t,
                libc::POSIX_FADV_DONTNEED,
            )
        };
    }

    fn write_many(&self, requests: &[(u64, &[u8])]) -> DeviceResult<()> {
        self.write_batch(requests, false)
    }

    /// Every aligned run in one ring submission; unaligned runs first,
    /// through the buffered descriptor.
    fn write_many_vectored(&self, requests: &[(u64, &[&[u8]])]) -> DeviceResult<()> {
        self.writev_runs(requests, false)
    }

    fn write_many_and_flush(&self, requests: &[(u64, &[u8])]) -> DeviceResult<()> {
        self.write_batch(requests, true)
    }

    /// fdatasync in the calling thread: io_uring has no non-blocking
    /// fsync, so through the ring it is always handed to a kernel worker
    /// thread and its completion handed back, two wake-ups for nothing.
    fn flush(&self) -> DeviceResult<()> {
        self.file.sync_data().map_err(|e| self.io_error(0, 0, e))
    }

    fn flush_lanes(&self) -> usize {
        self.flush_lanes.len().max(1)
    }

    /// fdatasync through the lane's own open file description, so each
    /// lane is told of every write-back error (see `open::flush_lanes`).
    fn flush_lane(&self, lane: usize) -> DeviceResult<()> {
        match self.flush_lanes.get(lane) {
            Some(file) => file.sync_data().map_err(|e| self.io_error(0, 0, e)),
            None => {
                assert!(
                    self.flush_lanes.is_empty() && lane == 0,
                    "flush lane {lane} out of range"
                );
                self.flush()
            }
        }
    }

    fn allocation(&self, offset: u64, len: u64) -> DeviceResult<Vec<crate::AllocationRun>> {
        check_range(&self.name, "allocation", offset, len, self.size_bytes)?;
        Ok(crate::allocation::file_allocation(
            &self.file,
            self.is_block_device,
            offset,
            len,
        ))
    }

    fn discard(&self, offset: u64, len: u64) -> DeviceResult<()> {
        check_range(&self.name, "discard", offset, len, self.size_bytes)?;
        if len > 0 {
            discard_range(&self.file, self.is_block_device, &self.name, offset, len);
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> DeviceResult<()> {
        check_range(&self.name, "write_zeroes", offset, len, self.size_bytes)?;
        if len == 0 || zero_range_in_kernel(&self.file, self.is_block_device, offset, len) {
            return Ok(());
        }
        let zeroes = self.zero_buffer();
        let end = offset + len;
        if !offset.is_multiple_of(self.offset_align_bytes)
            || !len.is_multiple_of(self.offset_align_bytes)
        {
            let mut at = offset;
            while at < end {
                let n = (end - at).min(ZERO_CHUNK_BYTES as u64) as usize;
                self.sync_write(at, &zeroes[..n])?;
                at += n as u64;
            }
            return Ok(());
        }
        let mut guard = self.rings.acquire();
        let ring = &mut *guard;
        let mut at = offset;
        while at < end {
            let n = (end - at).min(ZERO_CHUNK_BYTES as u64) as usize;
            // The kernel only reads the shared zero buffer.
            let ptr = zeroes.as_ptr() as *mut u8;
            ring.ops.push(Op::rw(OpKind::Write, at, ptr, n));
            at += n as u64;
        }
        self.run(ring)
    }
}
