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
//! goes through a bounce buffer from a pool of aligned buffers that are reused
//! (no allocation per I/O once the pool is warm). An offset or length that is
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

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError, TryLockError};
use std::time::Duration;

use io_uring::{opcode, squeue, types, IoUring, Probe};

use crate::file::{discard_range, open_locked, pwritev_at, zero_range_in_kernel, OpenedFile};
use crate::{check_range, Device, DeviceError, DeviceResult, OpenMode};

/// Alignment of bounce buffers: a page satisfies every O_DIRECT memory rule.
const BOUNCE_ALIGN_BYTES: usize = 4096;
/// Bounce buffers are at most this large; a larger unaligned I/O is split
/// into several I/Os of this size (still one submission).
const BOUNCE_CHUNK_BYTES: usize = 1 << 20;
/// Size classes of the pool: 4 KiB, 8 KiB, ... 1 MiB.
const POOL_CLASS_MIN_BYTES: usize = 4096;
const POOL_CLASS_COUNT: usize = 9;
/// Each size class keeps at most this many bytes of idle buffers (and at
/// least a few buffers), which bounds the pool at about 28 MiB.
const POOL_CLASS_BUDGET_BYTES: usize = 4 << 20;
/// Largest single read or write op: the SQE length field is 32 bits and
/// Linux caps one transfer just under 2 GiB.
const MAX_OP_BYTES: usize = 1 << 30;
/// Most iovecs in one writev (UIO_MAXIOV).
const MAX_IOVECS: usize = 1024;
/// The all-zero buffer used to write zeroes when the kernel cannot zero a
/// range itself.
const ZERO_CHUNK_BYTES: usize = 1 << 20;
/// Scratch entries a ring keeps between calls.
const SCRATCH_KEEP_OPS: usize = 1024;
/// How long io_uring_enter may keep failing with EAGAIN/EBUSY (the kernel is
/// out of memory for requests) before we give up.
const ENTER_RETRY_BUDGET_MS: u64 = 5_000;

/// Tuning for [`UringDevice`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UringOptions {
    /// Rings in the pool: how many callers can have I/O in flight at once.
    pub ring_count: usize,
    /// Submission queue entries per ring: how many I/Os one caller keeps in
    /// flight at once.
    pub queue_depth: u32,
    /// Open with O_DIRECT. If the filesystem refuses it, the device falls
    /// back to buffered I/O (still through io_uring) with one warning.
    pub direct_io: bool,
}

impl Default for UringOptions {
    fn default() -> Self {
        UringOptions {
            ring_count: 16,
            queue_depth: 128,
            direct_io: true,
        }
    }
}

// ---------------------------------------------------------------------------
// Aligned buffers and their pool

/// A heap buffer aligned to [`BOUNCE_ALIGN_BYTES`].
struct AlignedBuf {
    ptr: NonNull<u8>,
    capacity_bytes: usize,
}

// SAFETY: the buffer owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only read through the pointer (the zero buffer).
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    fn layout(capacity_bytes: usize) -> Layout {
        Layout::from_size_align(capacity_bytes.max(1), BOUNCE_ALIGN_BYTES)
            .expect("bounce buffers are at most a few MiB, far below isize::MAX")
    }

    fn zeroed(capacity_bytes: usize) -> AlignedBuf {
        let layout = Self::layout(capacity_bytes);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            handle_alloc_error(layout)
        };
        AlignedBuf {
            ptr,
            capacity_bytes,
        }
    }

    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this same layout.
        unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.capacity_bytes)) }
    }
}

/// Reusable aligned bounce buffers, by power-of-two size class.
struct BufferPool {
    classes: Mutex<[Vec<AlignedBuf>; POOL_CLASS_COUNT]>,
}

impl BufferPool {
    fn new() -> BufferPool {
        BufferPool {
            classes: Mutex::new(Default::default()),
        }
    }

    fn class_of(len: usize) -> usize {
        let rounded = len.max(POOL_CLASS_MIN_BYTES).next_power_of_two();
        (rounded.trailing_zeros() - POOL_CLASS_MIN_BYTES.trailing_zeros()) as usize
    }

    fn class_bytes(class: usize) -> usize {
        POOL_CLASS_MIN_BYTES << class
    }

    fn class_cap(class: usize) -> usize {
        (POOL_CLASS_BUDGET_BYTES / Self::class_bytes(class)).clamp(4, 64)
    }

    /// A buffer of at least `len` bytes (`len <= BOUNCE_CHUNK_BYTES`).
    fn take(&self, len: usize) -> AlignedBuf {
        debug_assert!(len <= BOUNCE_CHUNK_BYTES);
        let class = Self::class_of(len);
        let reused = self.classes.lock().unwrap_or_else(PoisonError::into_inner)[class].pop();
        reused.unwrap_or_else(|| AlignedBuf::zeroed(Self::class_bytes(class)))
    }

    fn give(&self, buf: AlignedBuf) {
        let class = Self::class_of(buf.capacity_bytes);
        if Self::class_bytes(class) != buf.capacity_bytes {
            return;
        }
        let mut classes = self.classes.lock().unwrap_or_else(PoisonError::into_inner);
        if classes[class].len() < Self::class_cap(class) {
            classes[class].push(buf);
        }
    }

    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.classes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(Vec::len)
            .sum()
    }
}

// ---------------------------------------------------------------------------
// Rings

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpKind {
    Read,
    Write,
    Writev,
    Fsync,
}

/// One I/O of a batch, kept in the ring's scratch list until it completes.
struct Op {
    kind: OpKind,
    offset: u64,
    /// Read/Write: the memory the kernel fills or reads (the caller's buffer,
    /// a bounce buffer, or the shared zero buffer). Unused for Writev/Fsync.
    ptr: *mut u8,
    /// Read/Write/Writev: bytes to transfer.
    len: usize,
    /// Writev: the iovecs are `iovecs[iov_start..iov_start + iov_count]`.
    iov_start: usize,
    iov_count: usize,
    /// The bounce buffer `ptr` points into, returned to the pool afterwards.
    bounce: Option<AlignedBuf>,
    /// Read through a bounce buffer: the caller's memory to fill once the
    /// read completes (null otherwise).
    copy_back: *mut u8,
    /// Start only after every earlier I/O of the batch completed.
    drain: bool,
    /// Run on the buffered descriptor (through the page cache) instead of
    /// the direct one: reads from [`Device::read_many_cacheable`].
    buffered: bool,
}

impl Op {
    fn rw(kind: OpKind, offset: u64, ptr: *mut u8, len: usize) -> Op {
        Op {
            kind,
            offset,
            ptr,
            len,
            iov_start: 0,
            iov_count: 0,
            bounce: None,
            copy_back: std::ptr::null_mut(),
            drain: false,
            buffered: false,
        }
    }
}

struct Ring {
    ring: IoUring,
    /// Scratch space reused by every call, so a batch allocates nothing once
    /// these have grown to the workload's batch size.
    ops: Vec<Op>,
    iovecs: Vec<libc::iovec>,
}

// SAFETY: the raw pointers in `ops` and `iovecs` are only set while one
// caller holds the ring's mutex, point into memory that caller borrows for
// the duration of its call, and are cleared before the mutex is released.
unsafe impl Send for Ring {}

/// The rings of one device. See the module documentation for why a pool.
pub(crate) struct RingPool {
    rings: Box<[Mutex<Ring>]>,
}

/// Hands each thread its home ring index (see [`RingPool::acquire`]).
static NEXT_HOME: AtomicUsize = AtomicUsize::new(0);

impl RingPool {
    /// Set up `ring_count` rings. Fails when io_uring is unavailable (old
    /// kernel, seccomp, `kernel.io_uring_disabled`) or lacks an opcode we use.
    pub(crate) fn new(ring_count: usize, queue_depth: u32) -> io::Result<RingPool> {
        let ring_count = ring_count.max(1);
        let mut rings = Vec::with_capacity(ring_count);
        for _ in 0..ring_count {
            let ring = IoUring::new(queue_depth.max(2))?;
            if rings.is_empty() {
                check_opcodes(&ring)?;
            }
            rings.push(Mutex::new(Ring {
                ring,
                ops: Vec::new(),
                iovecs: Vec::new(),
            }));
        }
        Ok(RingPool {
            rings: rings.into_boxed_slice(),
        })
    }

    fn acquire(&self) -> MutexGuard<'_, Ring> {
        thread_local! {
            /// This thread's first choice of ring, the same in every pool.
            static HOME: usize = NEXT_HOME.fetch_add(1, Ordering::Relaxed);
        }
        let count = self.rings.len();
        let start = HOME.with(|home| *home) % count;
        for i in 0..count {
            match self.rings[(start + i) % count].try_lock() {
                Ok(guard) => return guard,
                // A panic never leaves I/O in flight (see `InFlightGuard`),
                // so a poisoned ring is still usable.
                Err(TryLockError::Poisoned(poisoned)) => return poisoned.into_inner(),
                Err(TryLockError::WouldBlock) => {}
            }
        }
        self.rings[start]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

fn check_opcodes(ring: &IoUring) -> io::Result<()> {
    let mut probe = Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    for (code, name) in [
        (opcode::Read::CODE, "READ"),
        (opcode::Write::CODE, "WRITE"),
        (opcode::Writev::CODE, "WRITEV"),
        (opcode::Fsync::CODE, "FSYNC"),
    ] {
        if !probe.is_supported(code) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("this kernel's io_uring lacks IORING_OP_{name}"),
            ));
        }
    }
    Ok(())
}

/// Aborts the process if dropped while the kernel may still use memory we
/// lent it: unwinding past in-flight I/O would free buffers the kernel is
/// about to write into.
struct InFlightGuard {
    in_flight: usize,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self.in_flight > 0 {
            tracing::error!(
                in_flight = self.in_flight,
                "unwinding with io_uring I/O in flight; aborting"
            );
            std::process::abort();
        }
    }
}

/// Submit what is queued and wait for `want` completions, retrying the
/// transient failures. Any other failure aborts: our SQEs reference borrowed
/// memory, so returning while they may still run would be unsound, and
/// io_uring_enter only fails otherwise on a broken ring (EBADF, EFAULT...),
/// which is a bug, not a device error.
fn submit_and_wait(ring: &IoUring, want: usize, device: &str) {
    let mut waited_ms = 0u64;
    let mut backoff_ms = 1u64;
    loop {
        match ring.submit_and_wait(want) {
            Ok(_) => return,
            Err(err) => match err.raw_os_error() {
                Some(libc::EINTR) => {}
                Some(libc::EAGAIN) | Some(libc::EBUSY) if waited_ms < ENTER_RETRY_BUDGET_MS => {
                    std::thread::sleep(Duration::from_millis(backoff_ms));
                    waited_ms += backoff_ms;
                    backoff_ms = (backoff_ms * 2).min(64);
                }
                _ => {
                    tracing::error!(
                        device,
                        "io_uring_enter failed with I/O in flight: {err}; aborting"
                    );
                    std::process::abort();
                }
            },
        }
    }
}

// ---------------------------------------------------------------------------
// The device

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
    pool: BufferPool,
    zeroes: OnceLock<AlignedBuf>,
    /// Set by the first `read_many_cacheable`: until then no page of the
    /// device is cached by us, so writes need not drop any.
    cacheable_reads_seen: AtomicBool,
}

pub(crate) type OpenFileFn<'a> =
    &'a dyn Fn(&Path, OpenMode, libc::c_int) -> DeviceResult<OpenedFile>;

impl UringDevice {
    /// Open `path` through io_uring. Fails (rather than falling back) when
    /// io_uring is unavailable; [`crate::open_local`] applies the fallback
    /// policy.
    pub fn open(path: &Path, mode: OpenMode, options: &UringOptions) -> DeviceResult<UringDevice> {
        let rings = RingPool::new(options.ring_count, options.queue_depth).map_err(|err| {
            DeviceError::Unsupported {
                device: path.display().to_string(),
                message: format!("io_uring is unavailable: {err}"),
            }
        })?;
        Self::open_with_rings(path, mode, options.direct_io, rings, &open_locked)
    }

    pub(crate) fn open_with_rings(
        path: &Path,
        mode: OpenMode,
        direct_io: bool,
        rings: RingPool,
        open_file: OpenFileFn<'_>,
    ) -> DeviceResult<UringDevice> {
        if !direct_io {
            return Ok(Self::buffered(open_file(path, mode, 0)?, rings));
        }
        let opened = match open_file(path, mode, libc::O_DIRECT) {
            Ok(opened) => opened,
            Err(DeviceError::Open { source, .. })
                if source.raw_os_error() == Some(libc::EINVAL) =>
            {
                tracing::warn!(
                    device = %path.display(),
                    "the filesystem refuses O_DIRECT; using buffered I/O through io_uring"
                );
                return Ok(Self::buffered(open_file(path, mode, 0)?, rings));
            }
            Err(err) => return Err(err),
        };
        match direct_alignment(&opened) {
            Ok((offset_align_bytes, mem_align_bytes)) => {
                let unaligned_file =
                    reopen_buffered(&opened.file, path).map_err(|source| DeviceError::Open {
                        device: opened.name.clone(),
                        source,
                    })?;
                Ok(UringDevice {
                    file: opened.file,
                    unaligned_file: Some(unaligned_file),
                    name: opened.name,
                    identity: opened.identity,
                    size_bytes: opened.size_bytes,
                    is_block_device: opened.is_block_device,
                    direct: true,
                    offset_align_bytes,
                    mem_align_bytes,
                    rings,
                    pool: BufferPool::new(),
                    zeroes: OnceLock::new(),
                    cacheable_reads_seen: AtomicBool::new(false),
                })
            }
            Err(reason) => {
                tracing::warn!(
                    device = %opened.name,
                    "O_DIRECT does not work here ({reason}); using buffered I/O through io_uring"
                );
                clear_o_direct(&opened.file).map_err(|source| DeviceError::Open {
                    device: opened.name.clone(),
                    source,
                })?;
                Ok(Self::buffered(opened, rings))
            }
        }
    }

    fn buffered(opened: OpenedFile, rings: RingPool) -> UringDevice {
        UringDevice {
            file: opened.file,
            unaligned_file: None,
            name: opened.name,
            identity: opened.identity,
            size_bytes: opened.size_bytes,
            is_block_device: opened.is_block_device,
            direct: false,
            offset_align_bytes: 1,
            mem_align_bytes: 1,
            rings,
            pool: BufferPool::new(),
            zeroes: OnceLock::new(),
            cacheable_reads_seen: AtomicBool::new(false),
        }
    }

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

    // -- building a batch --------------------------------------------------

    /// Queue a read of an aligned range.
    fn push_read(&self, ring: &mut Ring, offset: u64, buf: &mut [u8]) {
        if self.mem_aligned(buf.as_ptr()) {
            let mut at = 0;
            for chunk in buf.chunks_mut(MAX_OP_BYTES) {
                ring.ops.push(Op::rw(
                    OpKind::Read,
                    offset + at as u64,
                    chunk.as_mut_ptr(),
                    chunk.len(),
                ));
                at += chunk.len();
            }
        } else {
            let mut at = 0;
            for chunk in buf.chunks_mut(BOUNCE_CHUNK_BYTES) {
                let bounce = self.pool.take(chunk.len());
                let mut op = Op::rw(
                    OpKind::Read,
                    offset + at as u64,
                    bounce.as_ptr(),
                    chunk.len(),
                );
                op.bounce = Some(bounce);
                op.copy_back = chunk.as_mut_ptr();
                ring.ops.push(op);
                at += chunk.len();
            }
        }
    }

    /// Queue a read of any range through the buffered descriptor, straight
    /// into the caller's memory (the page cache has no alignment rules).
    fn push_buffered_read(ring: &mut Ring, offset: u64, buf: &mut [u8]) {
        let mut at = 0;
        for chunk in buf.chunks_mut(MAX_OP_BYTES) {
            let mut op = Op::rw(
                OpKind::Read,
                offset + at as u64,
                chunk.as_mut_ptr(),
                chunk.len(),
            );
            op.buffered = true;
            ring.ops.push(op);
            at += chunk.len();
        }
    }

    /// Queue a write of an aligned range.
    fn push_write(&self, ring: &mut Ring, offset: u64, buf: &[u8]) {
        if self.mem_aligned(buf.as_ptr()) {
            let mut at = 0;
            for chunk in buf.chunks(MAX_OP_BYTES) {
                // The kernel only reads through this pointer (IORING_OP_WRITE).
                let ptr = chunk.as_ptr() as *mut u8;
                ring.ops
                    .push(Op::rw(OpKind::Write, offset + at as u64, ptr, chunk.len()));
                at += chunk.len();
            }
        } else {
            self.push_coalesced(ring, offset, &[buf]);
        }
    }

    /// Queue the bytes of `bufs`, back to back from `offset`, copied into
    /// bounce buffers of at most [`BOUNCE_CHUNK_BYTES`]. The whole range must
    /// be aligned; chunk boundaries then are too.
    fn push_coalesced(&self, ring: &mut Ring, offset: u64, bufs: &[&[u8]]) {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut chunk_at = 0usize;
        let mut current: Option<(AlignedBuf, usize, usize)> = None; // (buffer, size, filled)
        for buf in bufs {
            let mut src: &[u8] = buf;
            while !src.is_empty() {
                let (bounce, size, filled) = current.get_or_insert_with(|| {
                    let size = BOUNCE_CHUNK_BYTES.min(total - chunk_at);
                    (self.pool.take(size), size, 0)
                });
                let n = (*size - *filled).min(src.len());
                // SAFETY: the bounce buffer holds at least `size` bytes and
                // `filled + n <= size`; `src` is a different allocation.
                unsafe {
                    std::ptr::copy_nonoverlapping(src.as_ptr(), bounce.as_ptr().add(*filled), n)
                };
                *filled += n;
                src = &src[n..];
                if *filled == *size {
                    if let Some((bounce, size, _)) = current.take() {
                        let mut op = Op::rw(
                            OpKind::Write,
                            offset + chunk_at as u64,
                            bounce.as_ptr(),
                            size,
                        );
                        op.bounce = Some(bounce);
                        ring.ops.push(op);
                        chunk_at += size;
                    }
                }
            }
        }
        debug_assert!(current.is_none());
    }

    /// Queue a vectored write of an aligned range.
    fn push_writev(&self, ring: &mut Ring, offset: u64, bufs: &[&[u8]]) {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let each_aligned = bufs
            .iter()
            .all(|b| self.mem_aligned(b.as_ptr()) && self.range_aligned(0, b.len()));
        if !each_aligned {
            self.push_coalesced(ring, offset, bufs);
            return;
        }
        if total > MAX_OP_BYTES {
            let mut at = offset;
            for buf in bufs {
                self.push_write(ring, at, buf);
                at += buf.len() as u64;
            }
            return;
        }
        let mut at = offset;
        let mut group_start = ring.iovecs.len();
        let mut group_bytes = 0usize;
        for buf in bufs.iter().filter(|b| !b.is_empty()) {
            ring.iovecs.push(libc::iovec {
                iov_base: buf.as_ptr() as *mut libc::c_void,
                iov_len: buf.len(),
            });
            group_bytes += buf.len();
            if ring.iovecs.len() - group_start == MAX_IOVECS {
                ring.ops
                    .push(Self::writev_op(at, group_start, MAX_IOVECS, group_bytes));
                at += group_bytes as u64;
                group_start = ring.iovecs.len();
                group_bytes = 0;
            }
        }
        let count = ring.iovecs.len() - group_start;
        if count > 0 {
            ring.ops
                .push(Self::writev_op(at, group_start, count, group_bytes));
        }
    }

    fn writev_op(offset: u64, iov_start: usize, iov_count: usize, len: usize) -> Op {
        let mut op = Op::rw(OpKind::Writev, offset, std::ptr::null_mut(), len);
        op.iov_start = iov_start;
        op.iov_count = iov_count;
        op
    }

    fn push_fsync(ring: &mut Ring) {
        let mut op = Op::rw(OpKind::Fsync, 0, std::ptr::null_mut(), 0);
        // Drain: start only after every write queued before it completed,
        // which is what makes "writes + flush" one submission.
        op.drain = !ring.ops.is_empty();
        ring.ops.push(op);
    }

    // -- running a batch ---------------------------------------------------

    /// Run every op queued on `ring`, then clear the queue and return the
    /// bounce buffers to the pool. Returns the first error.
    fn run(&self, ring: &mut Ring) -> DeviceResult<()> {
        let result = self.run_queued(ring);
        if self.is_block_device && self.cacheable_reads_seen.load(Ordering::Relaxed) {
            // On a raw block device Linux invalidates cached pages before
            // an asynchronous direct write but not after it, so a buffered
            // read racing the write may have cached the old contents: do
            // the second invalidation ourselves, as the kernel does for
            // files (the engine's checksums catch what this still misses).
            // One call per run of adjacent writes (a record split into
            // several ops is one run); only once page-cache reads are in
            // use at all.
            let mut ranges: Vec<(u64, u64)> = ring
                .ops
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
        for op in ring.ops.drain(..) {
            if let Some(bounce) = op.bounce {
                self.pool.give(bounce);
            }
        }
        ring.iovecs.clear();
        // A huge batch (write_zeroes of gigabytes) must not pin its scratch
        // memory on the ring for ever.
        ring.ops.shrink_to(SCRATCH_KEEP_OPS);
        ring.iovecs.shrink_to(MAX_IOVECS);
        result
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
                let mut skip = done_bytes;
                let mut at = op.offset;
                for iov in &iovecs[op.iov_start..op.iov_start + op.iov_count] {
                    // SAFETY: each iovec describes a caller buffer borrowed
                    // for this call.
                    let buf = unsafe {
                        std::slice::from_raw_parts(iov.iov_base as *const u8, iov.iov_len)
                    };
                    if skip >= buf.len() {
                        skip -= buf.len();
                        at += buf.len() as u64;
                        continue;
                    }
                    file.write_all_at(&buf[skip..], at + skip as u64)
                        .map_err(err)?;
                    at += buf.len() as u64;
                    skip = 0;
                }
                Ok(())
            }
            OpKind::Fsync => Ok(()),
        }
    }

    fn acquire(&self) -> MutexGuard<'_, Ring> {
        let mut ring = self.rings.acquire();
        // A previous holder always leaves the scratch lists empty; clear
        // defensively so a stale pointer can never be submitted.
        if !ring.ops.is_empty() || !ring.iovecs.is_empty() {
            ring.ops.clear();
            ring.iovecs.clear();
        }
        ring
    }

    fn write_batch(&self, requests: &[(u64, &[u8])], flush: bool) -> DeviceResult<()> {
        for (offset, buf) in requests {
            check_range(
                &self.name,
                "write",
                *offset,
                buf.len() as u64,
                self.size_bytes,
            )?;
        }
        // Unaligned pieces first, outside the ring: they complete before the
        // ring's fdatasync is even submitted, so it covers them.
        for (offset, buf) in requests {
            if !buf.is_empty() && !self.range_aligned(*offset, buf.len()) {
                self.sync_write(*offset, buf)?;
            }
        }
        let mut guard = self.acquire();
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
        for (offset, bufs) in runs {
            let total = total_of(bufs) as u64;
            check_range(&self.name, "write", *offset, total, self.size_bytes)?;
        }
        for (offset, bufs) in runs {
            let total = total_of(bufs);
            if total > 0 && !self.range_aligned(*offset, total) {
                let mut at = *offset;
                for buf in bufs.iter() {
                    self.sync_write(at, buf)?;
                    at += buf.len() as u64;
                }
            }
        }
        let mut guard = self.acquire();
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

    /// A barrier write in the calling thread: pwritev on the direct
    /// descriptor, then fdatasync; None when the buffers do not suit
    /// O_DIRECT as they are (the ring then bounces them). Through the ring
    /// the fdatasync waits for the write with IO_DRAIN and then runs on a
    /// kernel worker thread, and each step wakes another thread: on the
    /// fsync-bound W1 benchmark (4 KiB writes, each flushed) that cost
    /// 25-30 us per flush, 7.8-8.2k IOPS against 10.3-10.9k this way.
    fn sync_barrier_write(&self, offset: u64, bufs: &[&[u8]]) -> Option<DeviceResult<()>> {
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
            // ring transfer; the fdatasync below covers it.
            let mut skip = written;
            let mut at = offset;
            for buf in bufs {
                if skip >= buf.len() {
                    skip -= buf.len();
                    at += buf.len() as u64;
                    continue;
                }
                if let Err(e) = self.sync_write(at + skip as u64, &buf[skip..]) {
                    return Some(Err(e));
                }
                at += buf.len() as u64;
                skip = 0;
            }
        }
        Some(self.file.sync_data().map_err(|e| self.io_error(0, 0, e)))
    }

    fn check_read_ranges(&self, requests: &[(u64, &mut [u8])]) -> DeviceResult<()> {
        for (offset, buf) in requests {
            check_range(
                &self.name,
                "read",
                *offset,
                buf.len() as u64,
                self.size_bytes,
            )?;
        }
        Ok(())
    }

    fn zero_buffer(&self) -> &AlignedBuf {
        self.zeroes
            .get_or_init(|| AlignedBuf::zeroed(ZERO_CHUNK_BYTES))
    }
}

fn build_entry(op: &Op, fd: types::Fd, iovecs: &[libc::iovec]) -> squeue::Entry {
    let entry = match op.kind {
        OpKind::Read => opcode::Read::new(fd, op.ptr, op.len as u32)
            .offset(op.offset)
            .build(),
        OpKind::Write => opcode::Write::new(fd, op.ptr as *const u8, op.len as u32)
            .offset(op.offset)
            .build(),
        OpKind::Writev => {
            opcode::Writev::new(fd, iovecs[op.iov_start..].as_ptr(), op.iov_count as u32)
                .offset(op.offset)
                .build()
        }
        OpKind::Fsync => opcode::Fsync::new(fd)
            .flags(types::FsyncFlags::DATASYNC)
            .build(),
    };
    if op.drain {
        entry.flags(squeue::Flags::IO_DRAIN)
    } else {
        entry
    }
}

/// The (offset, memory) alignment O_DIRECT needs on this file, or why
/// O_DIRECT does not work on it.
fn direct_alignment(opened: &OpenedFile) -> Result<(u64, usize), String> {
    let fd = opened.file.as_raw_fd();
    // SAFETY: an all-zero statx is a valid value of this plain C struct.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: statx on a descriptor we own with an empty, NUL-terminated
    // path and AT_EMPTY_PATH; it writes only into `stx`.
    let rc = unsafe {
        libc::statx(
            fd,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    let (offset_align, mem_align) = if rc == 0 && stx.stx_mask & libc::STATX_DIOALIGN != 0 {
        if stx.stx_dio_offset_align == 0 {
            return Err("statx reports no direct I/O support".into());
        }
        (
            stx.stx_dio_offset_align as u64,
            stx.stx_dio_mem_align.max(1) as usize,
        )
    } else if opened.is_block_device {
        let mut sector_bytes: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one int through the pointer, which points
        // at a live int.
        let rc = unsafe { libc::ioctl(fd, libc::BLKSSZGET, &mut sector_bytes as *mut libc::c_int) };
        if rc != 0 || sector_bytes <= 0 {
            (4096, 4096)
        } else {
            (sector_bytes as u64, sector_bytes as usize)
        }
    } else {
        // No statx answer: a page is safe for every filesystem and disk.
        (4096, 4096)
    };
    if !offset_align.is_power_of_two() || !mem_align.is_power_of_two() {
        return Err(format!(
            "unexpected direct I/O alignment (offset {offset_align}, memory {mem_align})"
        ));
    }
    // Some filesystems accept O_DIRECT at open and fail the first I/O: probe.
    if opened.size_bytes >= offset_align {
        let probe = AlignedBuf::zeroed(offset_align as usize);
        // SAFETY: pread into a live buffer of `offset_align` bytes.
        let n = unsafe {
            libc::pread(
                fd,
                probe.as_ptr() as *mut libc::c_void,
                offset_align as usize,
                0,
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINVAL) {
                return Err(format!("a direct read fails: {err}"));
            }
        }
    }
    Ok((offset_align, mem_align))
}

/// Turn O_DIRECT off on an open descriptor, keeping its lock.
fn clear_o_direct(file: &File) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own; no memory is passed.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags & !libc::O_DIRECT) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A second, buffered descriptor of the same inode. Through /proc so it is
/// the same file even if the path was replaced since; the path otherwise.
fn reopen_buffered(file: &File, path: &Path) -> io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true).write(true).custom_flags(libc::O_CLOEXEC);
    let buffered = options
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .or_else(|_| options.open(path))?;
    // Reads through this descriptor are cached blocks picked at random
    // (and the odd unaligned piece): read-ahead would only fill the page
    // cache with neighbours nobody asked for. Advice only, so a failure is
    // not an error.
    // SAFETY: posix_fadvise on a descriptor we own; no memory is passed.
    let _ = unsafe { libc::posix_fadvise(buffered.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
    Ok(buffered)
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

    fn write_at(&self, offset: u64, buf: &[u8]) -> DeviceResult<()> {
        self.write_batch(&[(offset, buf)], false)
    }

    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        self.writev_runs(&[(offset, bufs)], false)
    }

    fn write_vectored_and_flush(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        if let Some(result) = self.sync_barrier_write(offset, bufs) {
            return result;
        }
        self.writev_runs(&[(offset, bufs)], true)
    }

    fn read_many(&self, requests: &mut [(u64, &mut [u8])]) -> DeviceResult<()> {
        self.check_read_ranges(requests)?;
        for (offset, buf) in requests.iter_mut() {
            if !buf.is_empty() && !self.range_aligned(*offset, buf.len()) {
                self.sync_read(*offset, buf)?;
            }
        }
        let mut guard = self.acquire();
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
        let mut guard = self.acquire();
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
                // SAFETY: the zero buffer holds ZERO_CHUNK_BYTES bytes and is
                // never written after its allocation.
                let chunk = unsafe { std::slice::from_raw_parts(zeroes.as_ptr() as *const u8, n) };
                self.sync_write(at, chunk)?;
                at += n as u64;
            }
            return Ok(());
        }
        let mut guard = self.acquire();
        let ring = &mut *guard;
        let mut at = offset;
        while at < end {
            let n = (end - at).min(ZERO_CHUNK_BYTES as u64) as usize;
            // The kernel only reads the shared zero buffer.
            ring.ops.push(Op::rw(OpKind::Write, at, zeroes.as_ptr(), n));
            at += n as u64;
        }
        self.run(ring)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_reuses_buffers_by_class() {
        let pool = BufferPool::new();
        let a = pool.take(5000);
        assert_eq!(a.capacity_bytes, 8192);
        assert_eq!(a.as_ptr() as usize % BOUNCE_ALIGN_BYTES, 0);
        let a_ptr = a.as_ptr();
        pool.give(a);
        assert_eq!(pool.idle_count(), 1);
        let b = pool.take(8192);
        assert_eq!(b.as_ptr(), a_ptr, "the idle 8 KiB buffer is reused");
        let c = pool.take(1);
        assert_eq!(c.capacity_bytes, POOL_CLASS_MIN_BYTES);
        let d = pool.take(BOUNCE_CHUNK_BYTES);
        assert_eq!(d.capacity_bytes, BOUNCE_CHUNK_BYTES);
        pool.give(b);
        pool.give(c);
        pool.give(d);
        assert_eq!(pool.idle_count(), 3);
    }

    #[test]
    fn pool_is_bounded() {
        let pool = BufferPool::new();
        let class = BufferPool::class_of(BOUNCE_CHUNK_BYTES);
        let bufs: Vec<AlignedBuf> = (0..20).map(|_| pool.take(BOUNCE_CHUNK_BYTES)).collect();
        for buf in bufs {
            pool.give(buf);
        }
        assert_eq!(pool.idle_count(), BufferPool::class_cap(class));
    }
}
