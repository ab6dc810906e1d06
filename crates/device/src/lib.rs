//! The device layer: one trait for "a thing with blocks", and its backends.
//!
//! The engine knows devices only through [`Device`]. Backends:
//! - [`FileDevice`]: a regular file or a block device, with pread/pwrite.
//! - [`UringDevice`]: a regular file or a block device through io_uring with
//!   O_DIRECT and batched submission.
//! - [`NbdDevice`]: a remote export through an NBD client, so the origin can
//!   live on another machine.
//! - [`RbdDevice`]: a Ceph RBD image through librbd (loaded at run time).
//! - `SimDevice` (feature `sim`): an in-memory device for tests that can
//!   crash (dropping, tearing and reordering unflushed writes), flip bits,
//!   misdirect a write and fail the Nth I/O, all reproducible from a seed.
//!
//! [`open_local`] picks the best backend for a local path (io_uring, falling
//! back to pread/pwrite); [`open_path_or_uri`] also takes NBD URIs. These are
//! what the daemon should call.

mod allocation;
mod block_id;
mod buf;
mod claim;
mod claim_decision;
mod claim_mode;
mod file;
mod flush_debt;
mod identity;
mod local;
mod nbd;
mod rbd;
#[cfg(any(test, feature = "sim"))]
mod sim;
mod uring;

pub use allocation::AllocationRun;
pub use buf::{Backing, BlockBuf, BufPool, BufSlice, PooledBuf, SharedBuf, SizeClassPool};
pub use claim::OriginClaim;
pub use claim_decision::ClaimDecision;
pub use claim_mode::ClaimMode;
pub use file::{FileDevice, OpenMode};
pub use identity::{device_id_of_identity, identity_without_inode};
pub use local::{
    identity_is_lasting, open_local, open_local_with, open_path_or_uri, open_path_or_uri_with,
    spec_of_identity, IoBackend, LocalOptions, IO_BACKEND_ENV,
};
pub use nbd::{NbdDevice, NbdOptions, NbdStats, NbdTransport, NbdUri};
pub use rbd::{RbdDevice, RbdSpec};
#[cfg(any(test, feature = "sim"))]
pub use sim::{
    build_crash_image, CrashPlan, FaultMode, Journal, JournalEvent, OpKinds, PendingWrite,
    RangeFault, SimCounters, SimDevice, SECTOR_BYTES,
};
pub use uring::{UringDevice, UringOptions};

use std::future::Future;
use std::io;
use std::pin::Pin;

/// The advice after a failed open: about the path, for a local file only
/// (a remote origin's error already says what the server answered).
fn open_hint(device: &str) -> &'static str {
    if device.contains("://") || device.starts_with("rbd:") {
        ""
    } else {
        ". Check the path exists and you may read and write it"
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("{device}: I/O error at offset {offset} length {len}: {source}")]
    Io {
        device: String,
        offset: u64,
        len: u64,
        #[source]
        source: io::Error,
    },
    #[error(
        "{device}: {op} of {len} bytes at offset {offset} is past the end ({size_bytes} bytes)"
    )]
    OutOfRange {
        device: String,
        op: &'static str,
        offset: u64,
        len: u64,
        size_bytes: u64,
    },
    #[error("{device}: injected fault on I/O #{op_index} ({op})")]
    Injected {
        device: String,
        op: &'static str,
        op_index: u64,
    },
    #[error("{device}: cannot open: {source}{hint}", hint = open_hint(device))]
    Open {
        device: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "{device} is in use by another process (lock held). Stop the other cairn using it first"
    )]
    Busy { device: String },
    #[error("{device}: {message}")]
    Unsupported { device: String, message: String },
    /// The origin is claimed by another cache, or by none where this
    /// cache's claim was expected; the message says whose and what to do.
    #[error("{device}: {message}")]
    Claimed { device: String, message: String },
}

impl DeviceError {
    /// The errno a client should see for this error.
    pub fn errno(&self) -> i32 {
        match self {
            DeviceError::OutOfRange { .. } => libc::EINVAL,
            DeviceError::Unsupported { .. } => libc::ENOTSUP,
            DeviceError::Claimed { .. } => libc::EBUSY,
            _ => libc::EIO,
        }
    }
}

pub type DeviceResult<T> = Result<T, DeviceError>;

/// `requests` as runs of one buffer each, for a backend whose
/// [`Device::write_many`] is its [`Device::write_many_vectored`].
pub(crate) fn as_single_buffer_runs<R>(
    requests: &[(u64, &[u8])],
    write: impl FnOnce(&[(u64, &[&[u8]])]) -> R,
) -> R {
    let bufs: Vec<[&[u8]; 1]> = requests.iter().map(|(_, buf)| [*buf]).collect();
    let runs: Vec<(u64, &[&[u8]])> = requests
        .iter()
        .zip(&bufs)
        .map(|((offset, _), buf)| (*offset, buf.as_slice()))
        .collect();
    write(&runs)
}

/// An asynchronous device operation. It runs on the current thread's
/// reactor (see `cairn_io::Reactor::current`), so it is not `Send`.
pub type DeviceFuture<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// A thing with blocks. Offsets and lengths are in bytes; callers keep them
/// aligned to the device's `alignment_bytes`.
///
/// Methods take `&self` so one device can serve concurrent callers; batch
/// methods exist so an asynchronous backend (io_uring) can submit many
/// operations with one system call. Their default implementations loop.
pub trait Device: Send + Sync {
    /// A short human name for logs and errors (usually the path).
    fn name(&self) -> &str;

    /// Which implementation serves this device ("pread", "uring-direct",
    /// "uring-buffered", "nbd", "sim"), for logs and status output.
    fn backend(&self) -> &'static str {
        "unknown"
    }

    /// Stable identity recorded in the cache superblock, so a cache is never
    /// opened against a different origin by mistake.
    fn identity(&self) -> String {
        self.name().to_string()
    }

    fn size_bytes(&self) -> u64;

    /// This origin grew since the cache was formatted and is served at
    /// `volume_bytes`, the size recorded then (less than `size_bytes`).
    /// A device that watches its own size (an RBD image) measures a later
    /// resize against the volume, not against the size it opened with.
    fn serve_at_recorded_size(&self, volume_bytes: u64) {
        let _ = volume_bytes;
    }

    /// Mark this origin as written back to by `claim`'s cache, or check
    /// that it is (see [`OriginClaim`] and [`ClaimMode`]). Origins that can
    /// store nothing of the kind (a file, an NBD export) accept every
    /// claim: a file is locked while open, and an export's exclusivity is
    /// its server's job.
    fn claim(&self, claim: &OriginClaim) -> DeviceResult<()> {
        let _ = claim;
        Ok(())
    }

    /// Remove `cache_uuid`'s claim (its volume is gone, every block
    /// written back). Another cache's claim is left alone.
    fn release_claim(&self, cache_uuid: &str) -> DeviceResult<()> {
        let _ = cache_uuid;
        Ok(())
    }

    /// Smallest unit of I/O the backend accepts.
    fn alignment_bytes(&self) -> u32 {
        512
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> DeviceResult<()>;

    /// [`Device::read_at`] as a task: fill `slice` from `offset`. Inside a
    /// reactor task a backend that can submits the read and returns at once
    /// (io_uring on the reactor's own ring, a pipelined NBD command), so
    /// one task waits for its read and others run meanwhile; elsewhere,
    /// and by default, it reads synchronously. The slice comes back with
    /// the result.
    fn read_into<'a>(
        &'a self,
        offset: u64,
        mut slice: BufSlice,
    ) -> DeviceFuture<'a, (DeviceResult<()>, BufSlice)> {
        let result = self.read_at(offset, slice.as_mut_slice());
        Box::pin(std::future::ready((result, slice)))
    }

    /// [`Device::read_into`] for a read that may be served from the host's
    /// page cache (see [`Device::read_many_cacheable`]).
    fn read_into_cacheable<'a>(
        &'a self,
        offset: u64,
        mut slice: BufSlice,
    ) -> DeviceFuture<'a, (DeviceResult<()>, BufSlice)> {
        let result = self.read_many_cacheable(&mut [(offset, slice.as_mut_slice())]);
        Box::pin(std::future::ready((result, slice)))
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> DeviceResult<()>;

    /// Write several buffers back to back starting at `offset`, as one I/O
    /// where the backend can.
    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        let mut at = offset;
        for buf in bufs {
            self.write_at(at, buf)?;
            at += buf.len() as u64;
        }
        Ok(())
    }

    /// Read several independent ranges. A backend may run them concurrently.
    fn read_many(&self, requests: &mut [(u64, &mut [u8])]) -> DeviceResult<()> {
        for (offset, buf) in requests.iter_mut() {
            self.read_at(*offset, buf)?;
        }
        Ok(())
    }

    /// [`Device::read_many`] for reads that may be served from the host's
    /// page cache: hot cached blocks, read again and again, which the caller
    /// verifies (checksums) after reading. A backend that bypasses the page
    /// cache for everything else (O_DIRECT) reads these through a buffered
    /// descriptor, so the kernel keeps the hottest of them in RAM; anything
    /// that must see the medium itself (recovery, `cairn check`, a re-read
    /// after a checksum mismatch) uses [`Device::read_many`] or
    /// [`Device::read_at`]. The default is `read_many`.
    fn read_many_cacheable(&self, requests: &mut [(u64, &mut [u8])]) -> DeviceResult<()> {
        self.read_many(requests)
    }

    /// Drop whatever the host page cache holds of the range, so the next
    /// [`Device::read_many_cacheable`] reads the medium. For a page found
    /// stale: on a raw block device Linux invalidates cached pages only
    /// before an asynchronous direct write, so a buffered read racing the
    /// write can cache the old contents. Advice: a no-op by default.
    fn drop_cached_pages(&self, offset: u64, len: u64) {
        let _ = (offset, len);
    }

    /// Write several independent ranges. A backend may run them concurrently;
    /// nothing is durable until `flush`.
    fn write_many(&self, requests: &[(u64, &[u8])]) -> DeviceResult<()> {
        for (offset, buf) in requests {
            self.write_at(*offset, buf)?;
        }
        Ok(())
    }

    /// Make every completed write durable (a device barrier).
    fn flush(&self) -> DeviceResult<()>;

    /// How many flushes may run at once, each through its own lane (see
    /// [`Device::flush_lane`]). 1, the default: flushes must not overlap.
    /// On a file, Linux reports a failed write-back of cached pages to one
    /// `fdatasync` per open file description: of two overlapping calls on
    /// one descriptor, the second may succeed although pages it vouches
    /// for were lost.
    fn flush_lanes(&self) -> usize {
        1
    }

    /// [`Device::flush`] through lane `lane` (below
    /// [`Device::flush_lanes`]). Flushes in different lanes may overlap:
    /// each lane is told of every write error since its own last flush, so
    /// one cannot take the error another needed to see. Plain `flush` is
    /// a lane of its own.
    fn flush_lane(&self, lane: usize) -> DeviceResult<()> {
        let _ = lane;
        self.flush()
    }

    /// [`Device::write_vectored_at`] in the calling thread, in one system
    /// call, when the backend can (no hand-off to another thread: the
    /// write a barrier's thread makes and then flushes); otherwise the
    /// same as `write_vectored_at`. Not durable until a flush.
    fn write_vectored_inline(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        self.write_vectored_at(offset, bufs)
    }

    /// `write_vectored_at` followed by `flush`, in as few system calls or
    /// round trips as the backend can (io_uring submits the write and the
    /// fdatasync together). On error nothing is known to be durable.
    fn write_vectored_and_flush(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        self.write_vectored_at(offset, bufs)?;
        self.flush()
    }

    /// Write several independent runs, each given as buffers that go back
    /// to back from its offset: [`Device::write_many`] without first
    /// copying each run into one buffer. A backend may run them
    /// concurrently; nothing is durable until `flush`.
    fn write_many_vectored(&self, requests: &[(u64, &[&[u8]])]) -> DeviceResult<()> {
        for (offset, bufs) in requests {
            self.write_vectored_at(*offset, bufs)?;
        }
        Ok(())
    }

    /// `write_many` followed by `flush`, batched like
    /// [`Device::write_vectored_and_flush`].
    fn write_many_and_flush(&self, requests: &[(u64, &[u8])]) -> DeviceResult<()> {
        self.write_many(requests)?;
        self.flush()
    }

    /// Hint that the range is unused. Content afterwards is unspecified
    /// unless the backend says otherwise.
    fn discard(&self, offset: u64, len: u64) -> DeviceResult<()>;

    /// Which parts of `[offset, offset + len)` hold data: consecutive runs
    /// from `offset` whose lengths add up to `len`. A run reported not
    /// allocated reads as zeroes. A backend that cannot tell reports
    /// everything allocated (the default): a hole claimed over data would
    /// make a copy skip it.
    fn allocation(&self, offset: u64, len: u64) -> DeviceResult<Vec<AllocationRun>> {
        check_range(self.name(), "allocation", offset, len, self.size_bytes())?;
        Ok(AllocationRun::all_data(len))
    }

    /// Whether [`Device::allocation`] may wait on something slow (a round
    /// trip to a server), so an event loop should not call it on its own
    /// thread. Local backends answer from the file system at once.
    fn allocation_may_wait(&self) -> bool {
        false
    }

    /// Why the backend refuses this process for good, if it does: a
    /// distributed store that fenced it (Ceph blocklists a client whose
    /// lock another client broke) takes nothing from it until it is
    /// restarted, while another client may write there. The engine then
    /// stops taking writes for the volume (see the engine's fence).
    fn fenced(&self) -> Option<String> {
        None
    }

    /// A condition known without waiting for I/O that fails writes to the
    /// backend now (an RBD image shrunk by another client), for status to
    /// show before a write-back meets it. Never blocks.
    fn known_problem(&self) -> Option<String> {
        None
    }

    /// Make the range read back as zeroes.
    fn write_zeroes(&self, offset: u64, len: u64) -> DeviceResult<()> {
        const CHUNK: u64 = 1 << 20;
        let zeroes = vec![0u8; CHUNK.min(len) as usize];
        let mut at = offset;
        let end = offset + len;
        while at < end {
            let n = CHUNK.min(end - at);
            self.write_at(at, &zeroes[..n as usize])?;
            at += n;
        }
        Ok(())
    }
}

pub(crate) fn check_range(
    name: &str,
    op: &'static str,
    offset: u64,
    len: u64,
    size_bytes: u64,
) -> DeviceResult<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size_bytes => Ok(()),
        _ => Err(DeviceError::OutOfRange {
            device: name.to_string(),
            op,
            offset,
            len,
            size_bytes,
        }),
    }
}
