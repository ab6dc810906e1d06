//! Opening: O_DIRECT and its alignment, or buffered I/O with one warning.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::OnceLock;

use super::bounce::BouncePool;
use super::{RingPool, UringDevice, UringOptions};
use crate::file::{open_locked, OpenedFile};
use crate::{BlockBuf, DeviceError, DeviceResult, OpenMode};

/// Opens the file (path, mode, extra open flags); injectable for tests.
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
        let mut device = Self::open_descriptors(path, mode, direct_io, rings, open_file)?;
        if mode.writes() {
            device.flush_lanes = flush_lanes(&device.file, path, &device.name);
        }
        Ok(device)
    }

    fn open_descriptors(
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
                Ok(Self::assemble(
                    opened,
                    rings,
                    Some(unaligned_file),
                    offset_align_bytes,
                    mem_align_bytes,
                ))
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
        Self::assemble(opened, rings, None, 1, 1)
    }

    /// The device: direct when it has a buffered descriptor for the
    /// unaligned rest, buffered (alignments of 1) otherwise.
    fn assemble(
        opened: OpenedFile,
        rings: RingPool,
        unaligned_file: Option<File>,
        offset_align_bytes: u64,
        mem_align_bytes: usize,
    ) -> UringDevice {
        UringDevice {
            file: opened.file,
            direct: unaligned_file.is_some(),
            unaligned_file,
            name: opened.name,
            identity: opened.identity,
            size_bytes: opened.size_bytes,
            is_block_device: opened.is_block_device,
            offset_align_bytes,
            mem_align_bytes,
            rings,
            bounce: BouncePool::new(),
            zeroes: OnceLock::new(),
            cacheable_reads_seen: AtomicBool::new(false),
            nowait_skips: AtomicU32::new(0),
            flush_lanes: Vec::new(),
        }
    }
}

/// Flushes that may overlap on a device opened for writing (the engine
/// overlaps at most `EngineConfig::barriers_in_flight_max` barriers, 1 in
/// the daemon, which then syncs through the first lane alone).
const FLUSH_LANES: usize = 2;

/// The flush lanes: the file opened apart once per lane, each a separate
/// open file description. Linux reports a failed write-back of cached
/// pages once to each open file description (`errseq_t`), so overlapping
/// fdatasyncs on separate ones each see it; on one shared descriptor only
/// the first would. Without them (a failed open is logged) the device has
/// one lane and its flushes do not overlap.
fn flush_lanes(file: &File, path: &Path, name: &str) -> Vec<File> {
    let fd = file.as_raw_fd();
    let lanes: io::Result<Vec<File>> = (0..FLUSH_LANES)
        .map(|_| {
            // Read-only is enough for fdatasync, and never writes.
            let mut options = OpenOptions::new();
            options.read(true).custom_flags(libc::O_CLOEXEC);
            let lane = options
                .open(format!("/proc/self/fd/{fd}"))
                .or_else(|_| options.open(path))?;
            // Opened by path, the name may since lead elsewhere (renamed,
            // replaced): an fdatasync of another file would vouch for
            // nothing. Only the very file, or block device, becomes a lane.
            if same_file(file, &lane)? {
                Ok(lane)
            } else {
                Err(io::Error::other(format!(
                    "{} is no longer the file the cache was opened from",
                    path.display()
                )))
            }
        })
        .collect();
    match lanes {
        Ok(lanes) => lanes,
        Err(err) => {
            tracing::warn!(
                device = %name,
                error = %err,
                "could not open the device again for concurrent flushes; barriers will not overlap"
            );
            Vec::new()
        }
    }
}

/// Are `a` and `b` the same file (the same inode), or the same block
/// device (perhaps through two device nodes)?
fn same_file(a: &File, b: &File) -> io::Result<bool> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let (a, b) = (a.metadata()?, b.metadata()?);
    Ok(if a.file_type().is_block_device() {
        b.file_type().is_block_device() && a.rdev() == b.rdev()
    } else {
        a.dev() == b.dev() && a.ino() == b.ino()
    })
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
        let mut probe = BlockBuf::zeroed(offset_align as usize);
        // SAFETY: pread into a live buffer of `offset_align` bytes.
        let n = unsafe {
            libc::pread(
                fd,
                probe.as_mut_ptr() as *mut libc::c_void,
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
    // SAFETY: F_GETFL on a descriptor we own; no memory is passed.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // As the direct descriptor was opened: a read-only one stays so.
    let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
    let mut options = OpenOptions::new();
    options
        .read(true)
        .write(writes)
        .custom_flags(libc::O_CLOEXEC);
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
