//! [`RbdDevice`]: the [`Device`] impl over librbd's asynchronous calls.

use std::ffi::{c_int, c_void};
use std::io;
use std::sync::Arc;

use cairn_io::Reactor;

use super::completion::{errno_error, AioOp};
use super::handles::Handles;
use super::library::{library, Library};
use super::spec::RbdSpec;
use crate::flush_debt::FlushDebt;
use crate::{
    check_range, AllocationRun, BufSlice, Device, DeviceError, DeviceFuture, DeviceResult, OpenMode,
};

/// Extents one allocation call collects at most; the rest is data.
const MAX_EXTENTS: usize = 4096;

/// An RBD image as a device (see the module documentation).
pub struct RbdDevice {
    name: String,
    identity: String,
    size_bytes: u64,
    lib: &'static Library,
    handles: Handles,
    /// Allocation asks the OSDs, which see only what librbd's cache has
    /// flushed: it flushes first when a write is not yet.
    flush_debt: FlushDebt,
}

impl RbdDevice {
    /// Open `spec` (`rbd:POOL/IMAGE[?conf=..&id=..&keyring=..]`). With
    /// [`OpenMode::Exclusive`] the image's exclusive lock is taken, and
    /// held until the device is dropped; another holder makes this fail
    /// with [`DeviceError::Busy`]-like error naming it.
    pub fn open(spec: &str, mode: OpenMode) -> DeviceResult<RbdDevice> {
        let open_error = |message: String| DeviceError::Open {
            device: spec.to_string(),
            source: io::Error::new(io::ErrorKind::InvalidInput, message),
        };
        let parsed = RbdSpec::parse(spec).map_err(open_error)?;
        let name = parsed.image_name();
        let lib = library().map_err(|message| DeviceError::Unsupported {
            device: name.clone(),
            message,
        })?;
        let handles = Handles::open(lib, &parsed, mode == OpenMode::Exclusive).map_err(|f| {
            if f.locked_by_another {
                DeviceError::Unsupported {
                    device: name.clone(),
                    message: f.error.to_string(),
                }
            } else {
                DeviceError::Open {
                    device: name.clone(),
                    source: f.error,
                }
            }
        })?;
        let describe = |err: io::Error| DeviceError::Open {
            device: name.clone(),
            source: err,
        };
        let size_bytes = handles.size_bytes().map_err(describe)?;
        let id = handles.id().map_err(describe)?;
        tracing::debug!(device = %name, id = %id, size_bytes, "opened RBD image");
        Ok(RbdDevice {
            identity: format!("{name}#{id}"),
            name,
            size_bytes,
            lib,
            handles,
            flush_debt: FlushDebt::default(),
        })
    }

    fn io_error(&self, offset: u64, len: u64, source: io::Error) -> DeviceError {
        DeviceError::Io {
            device: self.name.clone(),
            offset,
            len,
            source,
        }
    }

    /// Wait for `ops`, each of `(offset, len, expected)`: the first error,
    /// after every op is done (their memory is the caller's).
    fn wait_all(&self, ops: Vec<(Arc<AioOp>, u64, u64, Expect)>) -> DeviceResult<()> {
        let mut first_error = None;
        for (op, offset, len, expect) in ops {
            let rc = op.wait();
            if let Err(source) = expect.check(rc, len) {
                first_error.get_or_insert_with(|| self.io_error(offset, len, source));
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Start a read of `buf.len()` bytes at `offset` into `buf`, which must
    /// stay alive and untouched until the op is waited for.
    fn start_read(&self, offset: u64, buf: *mut u8, len: usize) -> Arc<AioOp> {
        let op = AioOp::new(self.lib, 0);
        let image = self.handles.image;
        op.submit(|completion| {
            // SAFETY: open image; `buf` has `len` writable bytes that the
            // caller keeps alive until the op is done.
            unsafe { (self.lib.rbd_aio_read)(image, offset, len, buf as *mut _, completion) }
        });
        op
    }

    /// Start a write of `bufs` back to back from `offset`; the buffers
    /// must stay alive until the op is waited for.
    fn start_write(&self, offset: u64, bufs: &[&[u8]]) -> Arc<AioOp> {
        let iov: Vec<libc::iovec> = bufs
            .iter()
            .filter(|b| !b.is_empty())
            .map(|b| libc::iovec {
                iov_base: b.as_ptr() as *mut c_void,
                iov_len: b.len(),
            })
            .collect();
        let op = AioOp::new(self.lib, 0);
        let image = self.handles.image;
        op.submit(|completion| {
            // SAFETY: open image; the iovec array lives across the call
            // (librbd builds its buffer list from it then) and the data it
            // points to lives until the op is waited for.
            unsafe {
                (self.lib.rbd_aio_writev)(
                    image,
                    iov.as_ptr(),
                    iov.len() as c_int,
                    offset,
                    completion,
                )
            }
        });
        op
    }

    fn write_runs(&self, requests: &[(u64, &[&[u8]])]) -> DeviceResult<()> {
        let mut ops = Vec::with_capacity(requests.len());
        for (offset, bufs) in requests {
            let len: u64 = bufs.iter().map(|b| b.len() as u64).sum();
            check_range(&self.name, "write", *offset, len, self.size_bytes)?;
            if len == 0 {
                continue;
            }
            ops.push((
                self.start_write(*offset, bufs),
                *offset,
                len,
                Expect::Success,
            ));
        }
        let result = self.wait_all(ops);
        if !requests.is_empty() {
            self.flush_debt.write_finished();
        }
        result
    }

    /// One op with no memory of the caller's, waited for.
    fn run(
        &self,
        offset: u64,
        len: u64,
        start: impl FnOnce(&'static Library, *mut c_void, super::library::CompletionT) -> c_int,
    ) -> DeviceResult<()> {
        let op = AioOp::new(self.lib, 0);
        let image = self.handles.image;
        op.submit(|completion| start(self.lib, image, completion));
        self.wait_all(vec![(op, offset, len, Expect::Success)])
    }

    async fn read_async(&self, offset: u64, mut slice: BufSlice) -> (DeviceResult<()>, BufSlice) {
        let len = slice.len();
        if let Err(e) = check_range(&self.name, "read", offset, len as u64, self.size_bytes) {
            return (Err(e), slice);
        }
        // The op reads into its own buffer, so a task dropped mid-read
        // leaves librbd writing only to memory the op still owns.
        let op = AioOp::new(self.lib, len);
        let buf = op.buffer().as_mut_ptr();
        let image = self.handles.image;
        op.submit(|completion| {
            // SAFETY: open image; `buf` is the op's own buffer of `len`
            // bytes, allocated once and alive as long as the op.
            unsafe { (self.lib.rbd_aio_read)(image, offset, len, buf as *mut _, completion) }
        });
        let rc = op.done().await;
        let result = match Expect::Bytes.check(rc, len as u64) {
            Ok(()) => {
                slice.as_mut_slice().copy_from_slice(&op.buffer());
                Ok(())
            }
            Err(source) => Err(self.io_error(offset, len as u64, source)),
        };
        (result, slice)
    }

    fn flush_now(&self) -> DeviceResult<()> {
        let covers = self.flush_debt.flush_starts();
        // SAFETY (in the closure): open image and a fresh completion.
        self.run(0, 0, |lib, image, c| unsafe {
            (lib.rbd_aio_flush)(image, c)
        })?;
        self.flush_debt.flushed(covers);
        Ok(())
    }
}

/// What a successful return value looks like.
#[derive(Clone, Copy)]
enum Expect {
    /// Zero or more (writes, flush, discard, zeroes).
    Success,
    /// Exactly the bytes asked for (reads).
    Bytes,
}

impl Expect {
    fn check(self, rc: isize, len: u64) -> io::Result<()> {
        if rc < 0 {
            return Err(errno_error(rc));
        }
        match self {
            Expect::Success => Ok(()),
            Expect::Bytes if rc as u64 == len => Ok(()),
            Expect::Bytes => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("librbd read {rc} of {len} bytes"),
            )),
        }
    }
}

/// The state `rbd_diff_iterate2`'s callback fills.
struct Extents {
    extents: Vec<(u64, u64)>,
    truncated: bool,
}

extern "C" fn on_extent(offset: u64, length: usize, exists: c_int, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `Extents` that `allocation` lends for the call,
    // which is synchronous; nothing else touches it meanwhile.
    let state = unsafe { &mut *(arg as *mut Extents) };
    if exists == 0 || length == 0 {
        return 0;
    }
    if state.extents.len() >= MAX_EXTENTS {
        state.truncated = true;
        // Stop iterating: the rest is reported as data.
        return -libc::ECANCELED;
    }
    state.extents.push((offset, length as u64));
    0
}

impl Device for RbdDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn backend(&self) -> &'static str {
        "rbd"
    }

    /// `rbd:POOL/IMAGE#ID`: the image id changes when an image is deleted
    /// and made again under its name, and does not depend on how the
    /// cluster is reached (conf, user, keyring).
    fn identity(&self) -> String {
        self.identity.clone()
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> DeviceResult<()> {
        self.read_many(&mut [(offset, buf)])
    }

    /// Inside a reactor task, an asynchronous librbd read that wakes the
    /// task when done; elsewhere, [`Device::read_at`].
    fn read_into<'a>(
        &'a self,
        offset: u64,
        mut slice: BufSlice,
    ) -> DeviceFuture<'a, (DeviceResult<()>, BufSlice)> {
        if Reactor::current().is_none() {
            let result = self.read_at(offset, slice.as_mut_slice());
            return Box::pin(std::future::ready((result, slice)));
        }
        Box::pin(self.read_async(offset, slice))
    }

    /// Every read submitted before the first is waited for.
    fn read_many(&self, requests: &mut [(u64, &mut [u8])]) -> DeviceResult<()> {
        for (offset, buf) in requests.iter() {
            check_range(
                &self.name,
                "read",
                *offset,
                buf.len() as u64,
                self.size_bytes,
            )?;
        }
        let ops = requests
            .iter_mut()
            .filter(|(_, buf)| !buf.is_empty())
            .map(|(offset, buf)| {
                let len = buf.len();
                (
                    self.start_read(*offset, buf.as_mut_ptr(), len),
                    *offset,
                    len as u64,
                    Expect::Bytes,
                )
            })
            .collect();
        self.wait_all(ops)
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> DeviceResult<()> {
        self.write_runs(&[(offset, &[buf])])
    }

    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        self.write_runs(&[(offset, bufs)])
    }

    fn write_many(&self, requests: &[(u64, &[u8])]) -> DeviceResult<()> {
        let runs: Vec<[&[u8]; 1]> = requests.iter().map(|(_, buf)| [*buf]).collect();
        let requests: Vec<(u64, &[&[u8]])> = requests
            .iter()
            .zip(&runs)
            .map(|((offset, _), run)| (*offset, run.as_slice()))
            .collect();
        self.write_runs(&requests)
    }

    /// Every run submitted at once, then waited for.
    fn write_many_vectored(&self, requests: &[(u64, &[&[u8]])]) -> DeviceResult<()> {
        self.write_runs(requests)
    }

    /// `rbd_aio_flush`: with librbd's cache on, this is what makes the
    /// writes durable on the OSDs.
    fn flush(&self) -> DeviceResult<()> {
        self.flush_now()
    }

    fn discard(&self, offset: u64, len: u64) -> DeviceResult<()> {
        check_range(&self.name, "discard", offset, len, self.size_bytes)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY (in the closure): open image and a fresh completion.
        let result = self.run(offset, len, |lib, image, c| unsafe {
            (lib.rbd_aio_discard)(image, offset, len, c)
        });
        self.flush_debt.write_finished();
        result
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> DeviceResult<()> {
        check_range(&self.name, "write_zeroes", offset, len, self.size_bytes)?;
        if len == 0 {
            return Ok(());
        }
        let Ok(len_usize) = usize::try_from(len) else {
            return Err(self.io_error(offset, len, io::Error::from_raw_os_error(libc::EINVAL)));
        };
        // SAFETY (in the closure): open image and a fresh completion; no
        // flags.
        let result = self.run(offset, len, |lib, image, c| unsafe {
            (lib.rbd_aio_write_zeroes)(image, offset, len_usize, c, 0, 0)
        });
        self.flush_debt.write_finished();
        result
    }

    /// The image's allocated objects (`rbd_diff_iterate2` from its creation,
    /// whole objects, parent included): an object that exists is data,
    /// anything else reads as zeroes. Asked of the OSDs, after a flush when
    /// a write is still in librbd's cache.
    fn allocation(&self, offset: u64, len: u64) -> DeviceResult<Vec<AllocationRun>> {
        check_range(&self.name, "allocation", offset, len, self.size_bytes)?;
        let all_data = || {
            vec![AllocationRun {
                length_bytes: len,
                allocated: true,
            }]
        };
        if len == 0 {
            return Ok(all_data());
        }
        if self.flush_debt.owed() {
            self.flush_now()?;
        }
        let mut state = Extents {
            extents: Vec::new(),
            truncated: false,
        };
        // SAFETY: open image; NULL: from the image's creation; `state`
        // lives across this synchronous call and only the callback uses it.
        let rc = unsafe {
            (self.lib.rbd_diff_iterate2)(
                self.handles.image,
                std::ptr::null(),
                offset,
                len,
                1,
                1,
                on_extent,
                &mut state as *mut Extents as *mut c_void,
            )
        };
        if rc < 0 && !state.truncated {
            tracing::debug!(device = %self.name, "allocation of {offset}+{len} unknown: {}", errno_error(rc as isize));
            return Ok(all_data());
        }
        let end = offset + len;
        let mut runs: Vec<AllocationRun> = Vec::new();
        let mut push = |length_bytes: u64, allocated: bool| {
            if length_bytes == 0 {
                return;
            }
            match runs.last_mut() {
                Some(last) if last.allocated == allocated => last.length_bytes += length_bytes,
                _ => runs.push(AllocationRun {
                    length_bytes,
                    allocated,
                }),
            }
        };
        let mut at = offset;
        for (start, length) in state.extents {
            // Whole objects may reach outside the range; extents come in
            // order, but clamp anyway.
            let start = start.clamp(at, end);
            let stop = start.saturating_add(length).min(end);
            push(start - at, false);
            push(stop - start, true);
            at = at.max(stop);
        }
        // After a truncated walk the rest is unknown: data.
        push(end - at, state.truncated);
        debug_assert_eq!(runs.iter().map(|r| r.length_bytes).sum::<u64>(), len);
        Ok(runs)
    }
}
