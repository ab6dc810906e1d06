//! The seam between the NBD server and whatever stores the bytes.
//!
//! The server validates every request (bounds, flags, sizes) before it calls
//! an [`Export`] method, so an implementation only sees in-range offsets and
//! non-zero lengths. Calls arrive concurrently from several worker threads
//! and several connections.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};

/// A failed export operation. `errno` is a host errno (`libc::EIO`, ...);
/// the server maps it to the few error values NBD defines (unknown values
/// become EIO).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} (errno {errno})")]
pub struct ExportError {
    pub errno: i32,
    pub message: String,
}

impl ExportError {
    pub fn new(errno: i32, message: impl Into<String>) -> Self {
        ExportError {
            errno,
            message: message.into(),
        }
    }

    pub fn io(message: impl Into<String>) -> Self {
        Self::new(libc::EIO, message)
    }
}

/// What an extent of the export holds. The server derives the
/// `base:allocation` flags from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtentKind {
    /// Allocated, contents unknown: no flags.
    Data,
    /// Allocated and reads as zeroes: `NBD_STATE_ZERO`.
    Zero,
    /// Not allocated and reads as zeroes: `NBD_STATE_HOLE | NBD_STATE_ZERO`.
    Hole,
}

impl ExtentKind {
    /// The `base:allocation` status flags for this kind.
    pub fn allocation_flags(self) -> u32 {
        use crate::proto::{STATE_HOLE, STATE_ZERO};
        match self {
            ExtentKind::Data => 0,
            ExtentKind::Zero => STATE_ZERO,
            ExtentKind::Hole => STATE_HOLE | STATE_ZERO,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    pub kind: ExtentKind,
}

/// A block device as the NBD server sees it.
///
/// Contract (the server relies on it and advertises it to clients):
/// - Every method may be called concurrently from several threads.
/// - `offset + length <= size_bytes()` always holds; lengths are non-zero.
///   The size must not change while the export is served: each client is
///   told it once, in its handshake.
/// - `flush` makes every write to this export that *returned* before
///   `flush` was called durable, whichever connection issued it. The
///   server advertises `CAN_MULTI_CONN`, so flush and FUA must cover every
///   connection to the export, not just the caller's (a server with
///   several exports calls the flush of the connection's own export).
/// - `write(.., fua = true)` returns only once that data is durable.
/// - `write_zeroes`: the range must read back as zeroes. `may_trim` allows
///   deallocating it; with `fast_only` the call must fail quickly with
///   `ENOTSUP` (changing nothing) unless zeroing is much faster than writing.
/// - `trim` is a hint; contents of the range are unspecified afterwards.
/// - `cache` is a prefetch hint and must not change any contents.
/// - `block_status` returns consecutive extents starting at `offset`. They
///   may cover less than `length` (at least one non-empty extent) or more.
pub trait Export: Send + Sync + 'static {
    fn size_bytes(&self) -> u64;
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError>;
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError>;
    fn flush(&self) -> Result<(), ExportError>;
    fn trim(&self, offset: u64, length: u64) -> Result<(), ExportError>;
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
    ) -> Result<(), ExportError>;
    fn cache(&self, offset: u64, length: u64) -> Result<(), ExportError>;
    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, ExportError>;

    /// [`Export::read`] as a task on the connection's event loop: an
    /// export that waits for devices returns at once and completes when
    /// the data is there, so the connection keeps reading and starting
    /// further requests meanwhile. The data comes back in a buffer of the
    /// export's choosing, sent as it is. The default runs `read`.
    fn read_async(&self, offset: u64, length: u64) -> ExportFuture<'_, ReadBuffer> {
        let mut buf = vec![0u8; length as usize];
        let result = self
            .read(offset, &mut buf)
            .map(|()| Box::new(buf) as ReadBuffer);
        Box::pin(std::future::ready(result))
    }

    /// [`Export::write`] as a task (a FUA write waits for durability
    /// without holding the connection). The default runs `write`.
    fn write_async<'a>(&'a self, offset: u64, data: &'a [u8], fua: bool) -> ExportFuture<'a, ()> {
        Box::pin(std::future::ready(self.write(offset, data, fua)))
    }

    /// [`Export::flush`] as a task. The default runs `flush`.
    fn flush_async(&self) -> ExportFuture<'_, ()> {
        Box::pin(std::future::ready(self.flush()))
    }

    /// [`Export::trim`] as a task (an export that may wait for a slow
    /// device, a write-through to an origin, waits as a task). The default
    /// runs `trim`.
    fn trim_async(&self, offset: u64, length: u64) -> ExportFuture<'_, ()> {
        Box::pin(std::future::ready(self.trim(offset, length)))
    }

    /// [`Export::write_zeroes`] as a task. The default runs `write_zeroes`.
    fn write_zeroes_async(
        &self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
    ) -> ExportFuture<'_, ()> {
        Box::pin(std::future::ready(
            self.write_zeroes(offset, length, may_trim, fast_only),
        ))
    }

    /// [`Export::block_status`] as a task (an export may ask a remote
    /// server). The default runs `block_status`.
    fn block_status_async(&self, offset: u64, length: u64) -> ExportFuture<'_, Vec<Extent>> {
        Box::pin(std::future::ready(self.block_status(offset, length)))
    }

    /// [`Export::cache`] as a task (a prefetch reads a slow origin). The
    /// default runs `cache`.
    fn cache_async(&self, offset: u64, length: u64) -> ExportFuture<'_, ()> {
        Box::pin(std::future::ready(self.cache(offset, length)))
    }
}

/// The data of a read, in whatever buffer the export filled.
pub type ReadBuffer = Box<dyn AsRef<[u8]>>;

/// An export operation running as a task on a connection's event loop.
pub type ExportFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, ExportError>> + 'a>>;

/// Which operation [`MemExport::fail_next`] should fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemOp {
    Read,
    Write,
    Flush,
    Trim,
    WriteZeroes,
    Cache,
    BlockStatus,
}

/// Counters a test can check after driving a client against a [`MemExport`].
#[derive(Debug, Default)]
pub struct MemCounters {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub fua_writes: AtomicU64,
    pub flushes: AtomicU64,
    pub trims: AtomicU64,
    pub write_zeroes: AtomicU64,
    pub caches: AtomicU64,
    pub block_statuses: AtomicU64,
}

/// Granularity of [`MemExport`] allocation; also what `block_status`
/// reports extents in.
pub const MEM_CHUNK_BYTES: u64 = 4096;

/// A sparse in-memory export for tests and examples. Chunks that were never
/// written (or were trimmed) are holes and read as zeroes.
pub struct MemExport {
    size_bytes: u64,
    chunks: RwLock<BTreeMap<u64, Box<[u8]>>>,
    fail_next: Mutex<Option<(MemOp, i32)>>,
    pub counters: MemCounters,
}

impl MemExport {
    pub fn new(size_bytes: u64) -> Self {
        MemExport {
            size_bytes,
            chunks: RwLock::new(BTreeMap::new()),
            fail_next: Mutex::new(None),
            counters: MemCounters::default(),
        }
    }

    /// Make the next `op` fail with `errno` (one shot), to test error paths.
    pub fn fail_next(&self, op: MemOp, errno: i32) {
        *lock(&self.fail_next) = Some((op, errno));
    }

    /// Number of allocated chunks, for tests of trim and zeroing.
    pub fn allocated_chunks(&self) -> usize {
        read_lock(&self.chunks).len()
    }

    fn check_fault(&self, op: MemOp) -> Result<(), ExportError> {
        let mut slot = lock(&self.fail_next);
        match *slot {
            Some((want, errno)) if want == op => {
                *slot = None;
                Err(ExportError::new(errno, format!("injected {op:?} failure")))
            }
            _ => Ok(()),
        }
    }

    fn check_range(&self, offset: u64, length: u64) -> Result<(), ExportError> {
        match past_end(offset, length, self.size_bytes) {
            false => Ok(()),
            true => Err(ExportError::new(
                libc::EINVAL,
                format!(
                    "range {offset}+{length} is past the end ({} bytes)",
                    self.size_bytes
                ),
            )),
        }
    }

    /// Zero `[offset, offset+length)`; whole chunks are dropped when
    /// `deallocate`, otherwise they stay allocated (as zeroes).
    fn zero_range(&self, offset: u64, length: u64, deallocate: bool) {
        let mut chunks = write_lock(&self.chunks);
        let end = offset + length;
        let mut pos = offset;
        while pos < end {
            let index = pos / MEM_CHUNK_BYTES;
            let chunk_start = index * MEM_CHUNK_BYTES;
            let in_chunk = (pos - chunk_start) as usize;
            let take = (MEM_CHUNK_BYTES - pos % MEM_CHUNK_BYTES).min(end - pos);
            let whole = in_chunk == 0 && take == MEM_CHUNK_BYTES;
            if whole && deallocate {
                chunks.remove(&index);
            } else if let Some(chunk) = chunks.get_mut(&index) {
                chunk[in_chunk..in_chunk + take as usize].fill(0);
            } else if !deallocate {
                chunks.insert(
                    index,
                    vec![0u8; MEM_CHUNK_BYTES as usize].into_boxed_slice(),
                );
            }
            pos += take;
        }
    }
}

impl Export for MemExport {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        self.counters.reads.fetch_add(1, Ordering::Relaxed);
        self.check_fault(MemOp::Read)?;
        self.check_range(offset, buf.len() as u64)?;
        let chunks = read_lock(&self.chunks);
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let index = pos / MEM_CHUNK_BYTES;
            let in_chunk = (pos % MEM_CHUNK_BYTES) as usize;
            let take = (MEM_CHUNK_BYTES as usize - in_chunk).min(buf.len() - done);
            let dest = &mut buf[done..done + take];
            match chunks.get(&index) {
                Some(chunk) => dest.copy_from_slice(&chunk[in_chunk..in_chunk + take]),
                None => dest.fill(0),
            }
            done += take;
        }
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
        self.counters.writes.fetch_add(1, Ordering::Relaxed);
        if fua {
            self.counters.fua_writes.fetch_add(1, Ordering::Relaxed);
        }
        self.check_fault(MemOp::Write)?;
        if past_end(offset, data.len() as u64, self.size_bytes) {
            return Err(ExportError::new(libc::ENOSPC, "write past the end"));
        }
        let mut chunks = write_lock(&self.chunks);
        let mut done = 0usize;
        while done < data.len() {
            let pos = offset + done as u64;
            let index = pos / MEM_CHUNK_BYTES;
            let in_chunk = (pos % MEM_CHUNK_BYTES) as usize;
            let take = (MEM_CHUNK_BYTES as usize - in_chunk).min(data.len() - done);
            let chunk = chunks
                .entry(index)
                .or_insert_with(|| vec![0u8; MEM_CHUNK_BYTES as usize].into_boxed_slice());
            chunk[in_chunk..in_chunk + take].copy_from_slice(&data[done..done + take]);
            done += take;
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), ExportError> {
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        self.check_fault(MemOp::Flush)
    }

    fn trim(&self, offset: u64, length: u64) -> Result<(), ExportError> {
        self.counters.trims.fetch_add(1, Ordering::Relaxed);
        self.check_fault(MemOp::Trim)?;
        self.check_range(offset, length)?;
        self.zero_range(offset, length, true);
        Ok(())
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        may_trim: bool,
        _fast_only: bool,
    ) -> Result<(), ExportError> {
        // Zeroing memory is always faster than a write, so fast_only never
        // has to refuse.
        self.counters.write_zeroes.fetch_add(1, Ordering::Relaxed);
        self.check_fault(MemOp::WriteZeroes)?;
        if past_end(offset, length, self.size_bytes) {
            return Err(ExportError::new(libc::ENOSPC, "write_zeroes past the end"));
        }
        self.zero_range(offset, length, may_trim);
        Ok(())
    }

    fn cache(&self, offset: u64, length: u64) -> Result<(), ExportError> {
        self.counters.caches.fetch_add(1, Ordering::Relaxed);
        self.check_fault(MemOp::Cache)?;
        self.check_range(offset, length)
    }

    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, ExportError> {
        self.counters.block_statuses.fetch_add(1, Ordering::Relaxed);
        self.check_fault(MemOp::BlockStatus)?;
        self.check_range(offset, length)?;
        let chunks = read_lock(&self.chunks);
        let end = offset + length;
        let mut extents: Vec<Extent> = Vec::new();
        let mut pos = offset;
        while pos < end {
            let index = pos / MEM_CHUNK_BYTES;
            let take = (MEM_CHUNK_BYTES - pos % MEM_CHUNK_BYTES).min(end - pos);
            let kind = match chunks.get(&index) {
                None => ExtentKind::Hole,
                Some(chunk) if chunk.iter().all(|b| *b == 0) => ExtentKind::Zero,
                Some(_) => ExtentKind::Data,
            };
            match extents.last_mut() {
                Some(last) if last.kind == kind => last.length += take,
                _ => extents.push(Extent { length: take, kind }),
            }
            pos += take;
        }
        Ok(extents)
    }
}

fn past_end(offset: u64, length: u64, size_bytes: u64) -> bool {
    match offset.checked_add(length) {
        Some(end) => end > size_bytes,
        None => true,
    }
}

// A poisoned lock only means another thread panicked mid-operation; the
// byte map itself is still consistent enough for a test export.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn read_lock<T>(m: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

fn write_lock<T>(m: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_export_reads_back_writes_and_reports_extents() {
        let export = MemExport::new(64 * 1024);
        let mut buf = vec![0xffu8; 10_000];
        export.read(100, &mut buf).unwrap();
        assert!(buf.iter().all(|b| *b == 0), "fresh export reads zeroes");

        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        export.write(5000, &data, false).unwrap();
        let mut back = vec![0u8; 10_000];
        export.read(5000, &mut back).unwrap();
        assert_eq!(back, data);

        // 5000..15000 touches chunks 1, 2 and 3.
        let extents = export.block_status(0, 64 * 1024).unwrap();
        assert_eq!(
            extents[0],
            Extent {
                length: 4096,
                kind: ExtentKind::Hole
            }
        );
        assert_eq!(
            extents[1],
            Extent {
                length: 3 * 4096,
                kind: ExtentKind::Data
            }
        );
        assert_eq!(extents.iter().map(|e| e.length).sum::<u64>(), 64 * 1024);

        export.trim(4096, 3 * 4096).unwrap();
        assert_eq!(export.allocated_chunks(), 0);
        export.write_zeroes(0, 4096, false, false).unwrap();
        let extents = export.block_status(0, 8192).unwrap();
        assert_eq!(
            extents[0],
            Extent {
                length: 4096,
                kind: ExtentKind::Zero
            }
        );
        assert_eq!(
            extents[1],
            Extent {
                length: 4096,
                kind: ExtentKind::Hole
            }
        );
    }

    #[test]
    fn mem_export_refuses_out_of_range_and_injects_faults() {
        let export = MemExport::new(8192);
        assert_eq!(
            export.write(8000, &[0u8; 200], false).unwrap_err().errno,
            libc::ENOSPC
        );
        let mut buf = [0u8; 200];
        assert_eq!(export.read(8000, &mut buf).unwrap_err().errno, libc::EINVAL);
        assert_eq!(
            export.read(u64::MAX, &mut buf).unwrap_err().errno,
            libc::EINVAL
        );
        export.fail_next(MemOp::Flush, libc::EIO);
        assert_eq!(export.flush().unwrap_err().errno, libc::EIO);
        export.flush().unwrap();
    }
}
