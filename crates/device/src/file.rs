//! Regular files and block devices through pread/pwrite.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// A held lock is retried this many times, this far apart (1 s in all).
const LOCK_RETRY_ATTEMPTS: u32 = 20;
const LOCK_RETRY_INTERVAL_MS: u64 = 50;

use crate::{check_range, Device, DeviceError, DeviceResult};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Take an exclusive advisory lock; fail if another process holds it.
    Exclusive,
    /// Shared lock: other readers may open too (status, check).
    Shared,
    /// Opened for reading only (`O_RDONLY`), with the shared lock: an
    /// inspection that must never change the device (offline `status`).
    /// A daemon's exclusive lock still refuses it, and the kernel refuses
    /// every write through it.
    ReadOnly,
}

impl OpenMode {
    /// Whether the device is opened for writing too.
    pub fn writes(self) -> bool {
        self != OpenMode::ReadOnly
    }
}

pub struct FileDevice {
    file: File,
    name: String,
    identity: String,
    size_bytes: u64,
    is_block_device: bool,
}

// From <linux/fs.h>: _IOR(0x12, 114, size_t).
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
/// `BLKROGET` from <linux/fs.h>: whether a block device is read-only.
const BLKROGET: libc::c_ulong = 0x125E;
// _IO(0x12, 119)
const BLKDISCARD: libc::c_ulong = 0x1277;
// _IO(0x12, 127)
const BLKZEROOUT: libc::c_ulong = 0x127f;

/// A regular file or block device opened and locked, before a backend wraps
/// it. Shared by [`FileDevice`] and the io_uring backend so both keep the same
/// locking, sizing and identity rules.
pub(crate) struct OpenedFile {
    pub(crate) file: File,
    pub(crate) name: String,
    pub(crate) identity: String,
    pub(crate) size_bytes: u64,
    pub(crate) is_block_device: bool,
}

/// Open `path` for reading and writing (reading only for
/// [`OpenMode::ReadOnly`]) with `extra_flags` (e.g. `O_DIRECT`) and take
/// the advisory lock `mode` asks for.
pub(crate) fn open_locked(
    path: &Path,
    mode: OpenMode,
    extra_flags: libc::c_int,
) -> DeviceResult<OpenedFile> {
    let name = path.display().to_string();
    // A directory opens for reading: say what opening it for writing says.
    if !mode.writes() && std::fs::metadata(path).is_ok_and(|m| m.is_dir()) {
        return Err(DeviceError::Open {
            device: name,
            source: io::Error::from_raw_os_error(libc::EISDIR),
        });
    }
    let file = OpenOptions::new()
        .read(true)
        .write(mode.writes())
        .custom_flags(libc::O_CLOEXEC | extra_flags)
        .open(path)
        .map_err(|source| DeviceError::Open {
            device: name.clone(),
            source,
        })?;
    take_lock(&file, mode, &name)?;
    let meta = file.metadata().map_err(|source| DeviceError::Open {
        device: name.clone(),
        source,
    })?;
    let is_block_device = meta.file_type().is_block_device();
    let size_bytes = if is_block_device {
        let mut size: u64 = 0;
        // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which
        // points at a live, properly aligned u64.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
        if rc != 0 {
            return Err(DeviceError::Open {
                device: name,
                source: std::io::Error::last_os_error(),
            });
        }
        // Root may open a read-only block device for writing; its writes
        // then fail. A cache must write, and so must an origin, to write
        // back what clients were told is safe: refuse it now, not after
        // acknowledging writes that can never reach it. An open that only
        // reads ([`OpenMode::ReadOnly`]) has no such problem.
        let mut read_only: libc::c_int = 0;
        // SAFETY: BLKROGET writes one int through the pointer, which points
        // at a live, properly aligned c_int.
        let rc = unsafe {
            libc::ioctl(
                file.as_raw_fd(),
                BLKROGET,
                &mut read_only as *mut libc::c_int,
            )
        };
        if rc == 0 && read_only != 0 && mode.writes() {
            return Err(DeviceError::Unsupported {
                device: name,
                message: "the block device is read-only (`blockdev --getro`); cairn writes to \
                          both its cache and its origin: make it writable \
                          (`blockdev --setrw`, or a loop device without -r)"
                    .into(),
            });
        }
        size
    } else if meta.file_type().is_file() {
        meta.len()
    } else {
        return Err(DeviceError::Unsupported {
            device: name,
            message: "not a regular file or block device".into(),
        });
    };
    Ok(OpenedFile {
        file,
        identity: identity_of(path, &meta, is_block_device),
        name,
        size_bytes,
        is_block_device,
    })
}

/// Take the advisory lock `mode` asks for on `file`. A process that just
/// exited can hold the lock a little longer: its io_uring instance is torn
/// down asynchronously and drops the file last. So a held lock is retried
/// briefly (bounded) before it counts as busy.
fn take_lock(file: &File, mode: OpenMode, name: &str) -> DeviceResult<()> {
    let lock = match mode {
        OpenMode::Exclusive => libc::LOCK_EX,
        OpenMode::Shared | OpenMode::ReadOnly => libc::LOCK_SH,
    };
    let mut attempts_left = LOCK_RETRY_ATTEMPTS;
    loop {
        // SAFETY: flock on a file descriptor we own; no memory is passed.
        let rc = unsafe { libc::flock(file.as_raw_fd(), lock | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(DeviceError::Open {
                device: name.to_string(),
                source: err,
            });
        }
        if attempts_left == 0 {
            return Err(DeviceError::Busy {
                device: name.to_string(),
            });
        }
        attempts_left -= 1;
        std::thread::sleep(std::time::Duration::from_millis(LOCK_RETRY_INTERVAL_MS));
    }
}

/// What a cache records of this file or device: its canonical path, and a
/// file's inode or a block device's lasting id.
fn identity_of(path: &Path, meta: &std::fs::Metadata, is_block_device: bool) -> String {
    use std::os::unix::fs::MetadataExt;
    let canonical: PathBuf = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let inode = (!is_block_device).then(|| meta.ino());
    let device_id = is_block_device
        .then(|| crate::block_id::block_device_id(meta.rdev()))
        .flatten();
    crate::identity::local_identity(&canonical, inode, device_id.as_deref())
}

/// Discard `len` bytes at `offset`: BLKDISCARD on a block device, a punched
/// hole in a regular file. Discard is a hint, so failure is only logged.
pub(crate) fn discard_range(file: &File, is_block_device: bool, name: &str, offset: u64, len: u64) {
    let rc = if is_block_device {
        let range: [u64; 2] = [offset, len];
        // SAFETY: BLKDISCARD reads two u64s from the pointer, which points
        // at a live array of two u64s.
        unsafe { libc::ioctl(file.as_raw_fd(), BLKDISCARD, range.as_ptr()) }
    } else {
        // SAFETY: fallocate on a descriptor we own; no memory is passed.
        unsafe {
            libc::fallocate(
                file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        }
    };
    if rc != 0 {
        // Discard is a hint: a filesystem without hole punching is fine.
        tracing::debug!(device = %name, "discard not supported: {}", std::io::Error::last_os_error());
    }
}

/// Try to zero a range without sending zero-filled buffers: FALLOC_FL_ZERO_RANGE
/// on a regular file, BLKZEROOUT on a block device (which may offload to the
/// drive's WRITE ZEROES). Returns false when the caller must write zeroes.
pub(crate) fn zero_range_in_kernel(
    file: &File,
    is_block_device: bool,
    offset: u64,
    len: u64,
) -> bool {
    let rc = if is_block_device {
        let range: [u64; 2] = [offset, len];
        // SAFETY: BLKZEROOUT reads two u64s from the pointer, which points at
        // a live array of two u64s.
        unsafe { libc::ioctl(file.as_raw_fd(), BLKZEROOUT, range.as_ptr()) }
    } else {
        // SAFETY: fallocate on a descriptor we own; no memory is passed.
        unsafe {
            libc::fallocate(
                file.as_raw_fd(),
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        }
    };
    rc == 0
}

impl FileDevice {
    pub fn open(path: &Path, mode: OpenMode) -> DeviceResult<FileDevice> {
        Ok(Self::from_opened(open_locked(path, mode, 0)?))
    }

    pub(crate) fn from_opened(opened: OpenedFile) -> FileDevice {
        FileDevice {
            file: opened.file,
            name: opened.name,
            identity: opened.identity,
            size_bytes: opened.size_bytes,
            is_block_device: opened.is_block_device,
        }
    }

    fn io_error(&self, offset: u64, len: u64, source: std::io::Error) -> DeviceError {
        DeviceError::Io {
            device: self.name.clone(),
            offset,
            len,
            source,
        }
    }
}

impl Device for FileDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn backend(&self) -> &'static str {
        "pread"
    }

    fn identity(&self) -> String {
        self.identity.clone()
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> DeviceResult<()> {
        check_range(
            &self.name,
            "read",
            offset,
            buf.len() as u64,
            self.size_bytes,
        )?;
        self.file
            .read_exact_at(buf, offset)
            .map_err(|e| self.io_error(offset, buf.len() as u64, e))
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> DeviceResult<()> {
        check_range(
            &self.name,
            "write",
            offset,
            buf.len() as u64,
            self.size_bytes,
        )?;
        self.file
            .write_all_at(buf, offset)
            .map_err(|e| self.io_error(offset, buf.len() as u64, e))
    }

    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        check_range(&self.name, "write", offset, total, self.size_bytes)?;
        // pwritev for the common case; fall back to per-buffer writes after a
        // short write so the caller never sees a partial success.
        if bufs.len() <= libc::UIO_MAXIOV as usize {
            match pwritev_at(&self.file, offset, bufs) {
                Ok(written) if written as u64 == total => return Ok(()),
                // Short, or signals kept interrupting it: the per-buffer
                // writes below finish the job.
                Ok(_) => {}
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(self.io_error(offset, total, err)),
            }
        }
        let mut at = offset;
        for buf in bufs {
            self.write_at(at, buf)?;
            at += buf.len() as u64;
        }
        Ok(())
    }

    fn flush(&self) -> DeviceResult<()> {
        self.file.sync_data().map_err(|e| self.io_error(0, 0, e))
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
        if len == 0 {
            return Ok(());
        }
        discard_range(&self.file, self.is_block_device, &self.name, offset, len);
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> DeviceResult<()> {
        check_range(&self.name, "write_zeroes", offset, len, self.size_bytes)?;
        if len == 0 {
            return Ok(());
        }
        if zero_range_in_kernel(&self.file, self.is_block_device, offset, len) {
            return Ok(());
        }
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

/// One pwritev(2) of `bufs` (at most UIO_MAXIOV of them) at `offset`:
/// how many bytes it wrote, which may be fewer than asked. An interrupted
/// call is retried, a bounded number of times.
pub(crate) fn pwritev_at(file: &File, offset: u64, bufs: &[&[u8]]) -> io::Result<usize> {
    let iovecs: Vec<libc::iovec> = bufs
        .iter()
        .map(|b| libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        })
        .collect();
    let mut interrupted = 0;
    loop {
        // SAFETY: every iovec points into a slice borrowed for the duration
        // of the call; pwritev only reads through them.
        let written = unsafe {
            libc::pwritev(
                file.as_raw_fd(),
                iovecs.as_ptr(),
                iovecs.len() as libc::c_int,
                offset as libc::off_t,
            )
        };
        if written >= 0 {
            return Ok(written as usize);
        }
        let err = io::Error::last_os_error();
        // Bounded: a signal storm must not spin here for ever.
        if err.kind() != io::ErrorKind::Interrupted || interrupted == 16 {
            return Err(err);
        }
        interrupted += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_lock() {
        let dir = std::env::temp_dir().join(format!("cairn-filedev-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("dev.img");
        let f = File::create(&path).unwrap();
        f.set_len(1 << 20).unwrap();
        let dev = FileDevice::open(&path, OpenMode::Exclusive).unwrap();
        assert_eq!(dev.size_bytes(), 1 << 20);
        dev.write_vectored_at(4096, &[&[1u8; 4096], &[2u8; 4096]])
            .unwrap();
        let mut buf = vec![0u8; 8192];
        dev.read_at(4096, &mut buf).unwrap();
        assert!(buf[..4096].iter().all(|&b| b == 1));
        assert!(buf[4096..].iter().all(|&b| b == 2));
        dev.write_zeroes(4096, 4096).unwrap();
        dev.read_at(4096, &mut buf).unwrap();
        assert!(buf[..4096].iter().all(|&b| b == 0));
        assert!(dev.read_at((1 << 20) - 10, &mut buf).is_err());
        assert!(matches!(
            FileDevice::open(&path, OpenMode::Exclusive),
            Err(DeviceError::Busy { .. })
        ));
        drop(dev);
        FileDevice::open(&path, OpenMode::Exclusive).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A read-only open reads, cannot write (the kernel refuses it), and
    /// is refused while another process holds the exclusive lock (a
    /// daemon serving the cache).
    #[test]
    fn read_only_reads_never_writes_and_yields_to_the_exclusive_lock() {
        let dir = std::env::temp_dir().join(format!("cairn-filedev-ro-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("dev.img");
        std::fs::write(&path, vec![7u8; 1 << 16]).unwrap();
        let dev = FileDevice::open(&path, OpenMode::ReadOnly).unwrap();
        let mut buf = vec![0u8; 4096];
        dev.read_at(4096, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 7));
        assert!(dev.write_at(0, &[0u8; 4096]).is_err());
        assert_eq!(std::fs::read(&path).unwrap(), vec![7u8; 1 << 16]);
        // Two readers at once; a writer with the exclusive lock waits.
        let other = FileDevice::open(&path, OpenMode::ReadOnly).unwrap();
        assert!(matches!(
            FileDevice::open(&path, OpenMode::Exclusive),
            Err(DeviceError::Busy { .. })
        ));
        drop((dev, other));
        let exclusive = FileDevice::open(&path, OpenMode::Exclusive).unwrap();
        assert!(matches!(
            FileDevice::open(&path, OpenMode::ReadOnly),
            Err(DeviceError::Busy { .. })
        ));
        drop(exclusive);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
