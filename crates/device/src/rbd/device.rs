//! [`RbdDevice`]: the [`Device`] impl over librbd's asynchronous calls.

use std::ffi::{c_int, c_void};
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_io::{first_of, Either, Reactor};

use super::blocklisted::Blocklisted;
use super::completion::{errno_error, AioOp, Stuck};
use super::handles::Handles;
use super::library::{library, CompletionT, ImageT, Library};
use super::size_check::{Access, Caller, SizeCheck};
use super::spec::RbdSpec;
use crate::allocation::push_run;
use crate::flush_debt::FlushDebt;
use crate::{
    check_range, AllocationRun, BufSlice, Device, DeviceError, DeviceFuture, DeviceResult,
    OpenMode, OriginClaim,
};

/// Extents one allocation call collects at most; the rest is data.
const MAX_EXTENTS: usize = 4096;

/// Bytes of abandoned ops (deadline passed, librbd still working on them)
/// beyond which new requests fail at once: a dead OSD must not make cairn
/// pile up copies of every retried write-back.
const MAX_STUCK_BYTES: u64 = 256 << 20;
/// Abandoned ops beyond which new requests fail at once.
const MAX_STUCK_OPS: u64 = 4096;

/// An RBD image as a device (see the module documentation).
pub struct RbdDevice {
    name: String,
    /// `POOL/[NAMESPACE/]IMAGE`, as the `rbd` command names it in advice.
    image_path: String,
    identity: String,
    size_bytes: u64,
    lib: &'static Library,
    /// Shared with a thread that reads the image's size (see
    /// [`SizeCheck`]).
    handles: Arc<Handles>,
    /// Refuses writes while another client has shrunk the image.
    size_check: Arc<SizeCheck>,
    /// A request not finished after this long fails with `TimedOut`.
    timeout: Duration,
    stuck: Arc<Stuck>,
    /// Allocation asks the OSDs, which see only what librbd's cache has
    /// flushed: it flushes first when a write is not yet.
    flush_debt: FlushDebt,
    /// The cluster blocklisted this client (see [`Device::fenced`]).
    blocklisted: AtomicBool,
}

/// One op of a batch, with what its caller needs to judge and use it.
struct Pending {
    op: Arc<AioOp>,
    offset: u64,
    len: u64,
    expect: Expect,
}

impl RbdDevice {
    /// Open `spec` (`rbd:POOL/[NAMESPACE/]IMAGE[?conf=..&id=..&keyring=..&timeout=..]`).
    /// With [`OpenMode::Exclusive`] the image's exclusive lock is taken and
    /// held until the device is dropped; another holder makes this fail
    /// with an error naming it.
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
        let image_path = parsed.image_path();
        Ok(RbdDevice {
            identity: format!("{parsed}#{id}"),
            size_check: Arc::new(SizeCheck::new(image_path.clone(), size_bytes)),
            image_path,
            name,
            size_bytes,
            lib,
            handles: Arc::new(handles),
            timeout: parsed.timeout(),
            stuck: Arc::new(Stuck::default()),
            flush_debt: FlushDebt::default(),
            blocklisted: AtomicBool::new(false),
        })
    }

    fn io_error(&self, offset: u64, len: u64, source: io::Error) -> DeviceError {
        if Blocklisted::is(&source) {
            self.blocklisted.store(true, Ordering::Release);
        }
        DeviceError::Io {
            device: self.name.clone(),
            offset,
            len,
            source,
        }
    }

    /// Refuse a request the image's present size cannot take (see
    /// [`SizeCheck`]).
    fn check_image_size(
        &self,
        caller: Caller,
        access: Access,
        offset: u64,
        len: u64,
    ) -> DeviceResult<()> {
        self.size_check
            .check(&self.handles, caller, access, offset, len)
            .map_err(|source| self.io_error(offset, len, source))
    }

    /// Refuse new work while too much is stuck behind a silent cluster.
    fn check_not_stuck(&self, offset: u64, len: u64) -> DeviceResult<()> {
        let ops = self.stuck.ops.load(Ordering::Acquire);
        let bytes = self.stuck.bytes.load(Ordering::Acquire);
        if ops < MAX_STUCK_OPS && bytes < MAX_STUCK_BYTES {
            return Ok(());
        }
        Err(self.io_error(
            offset,
            len,
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{ops} earlier requests ({bytes} bytes) to the image have not finished; refusing more until they do"),
            ),
        ))
    }

    fn timed_out(&self, offset: u64, len: u64) -> DeviceError {
        tracing::warn!(device = %self.name, offset, len, timeout_secs = self.timeout.as_secs(), "an RBD request did not finish in time");
        self.io_error(
            offset,
            len,
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "no answer from the Ceph cluster in {} s",
                    self.timeout.as_secs()
                ),
            ),
        )
    }

    /// Start an op over `buffer` (its own memory); `call` makes the librbd
    /// call from the image, the completion and the buffer's address and
    /// length.
    fn start(
        &self,
        offset: u64,
        len: u64,
        expect: Expect,
        buffer: Vec<u8>,
        call: impl FnOnce(&'static Library, ImageT, CompletionT, *mut u8, usize) -> c_int,
    ) -> Pending {
        let op = AioOp::new(self.lib, buffer, &self.stuck);
        let image = self.handles.image;
        let lib = self.lib;
        op.submit(|completion, address, buffer_len| {
            call(lib, image, completion, address, buffer_len)
        });
        Pending {
            op,
            offset,
            len,
            expect,
        }
    }

    /// Wait for every op (one deadline for the batch): the first error.
    /// Each successful read's data goes to `sink` with its index.
    fn wait_all(&self, ops: &[Pending], mut sink: impl FnMut(usize, &[u8])) -> DeviceResult<()> {
        let deadline = Instant::now() + self.timeout;
        let mut first_error = None;
        for (index, p) in ops.iter().enumerate() {
            let outcome = match p.op.wait_until(deadline) {
                Some(rc) => p
                    .expect
                    .check(rc, p.len)
                    .map_err(|source| self.io_error(p.offset, p.len, source)),
                None => Err(self.timed_out(p.offset, p.len)),
            };
            match outcome {
                Ok(()) if p.expect == Expect::Bytes => sink(index, &p.op.buffer()),
                Ok(()) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn start_read(&self, offset: u64, len: usize) -> Pending {
        let op = AioOp::new_read(self.lib, len, &self.stuck);
        let image = self.handles.image;
        let lib = self.lib;
        // SAFETY: open image; the op's own buffer, with room for `n` (its
        // `len`) bytes, alive as long as the op.
        op.submit(|completion, address, n| unsafe {
            (lib.rbd_aio_read)(image, offset, n, address as *mut _, completion)
        });
        Pending {
            op,
            offset,
            len: len as u64,
            expect: Expect::Bytes,
        }
    }

    fn write_runs(&self, requests: &[(u64, &[&[u8]])]) -> DeviceResult<()> {
        let mut ops = Vec::with_capacity(requests.len());
        for (offset, bufs) in requests {
            let len: u64 = bufs.iter().map(|b| b.len() as u64).sum();
            check_range(&self.name, "write", *offset, len, self.size_bytes)?;
            self.check_image_size(Caller::MayBlock, Access::Write, *offset, len)?;
            self.check_not_stuck(*offset, len)?;
        }
        for (offset, bufs) in requests {
            // One copy into the op's own memory, so a write given up on
            // never reads the caller's buffers after we return.
            let data = bufs.concat();
            if data.is_empty() {
                continue;
            }
            let offset = *offset;
            // SAFETY (in the closure): open image; the op's own buffer.
            ops.push(self.start(
                offset,
                data.len() as u64,
                Expect::Success,
                data,
                |lib, image, c, buf, n| unsafe {
                    (lib.rbd_aio_write)(image, offset, n, buf as *const _, c)
                },
            ));
        }
        let result = self.wait_all(&ops, |_, _| {});
        if !ops.is_empty() {
            self.flush_debt.write_finished();
        }
        result?;
        if ops.is_empty() {
            return Ok(());
        }
        let (first, end) = requests
            .iter()
            .fold((u64::MAX, 0), |(first, end), (offset, bufs)| {
                let len: u64 = bufs.iter().map(|b| b.len() as u64).sum();
                (first.min(*offset), end.max(offset + len))
            });
        self.confirm_written(first.min(end), end.saturating_sub(first))
    }

    /// After writes completed: the image still holds the whole volume (see
    /// [`SizeCheck::confirm_written`]).
    fn confirm_written(&self, offset: u64, len: u64) -> DeviceResult<()> {
        self.size_check
            .confirm_written(&self.handles)
            .map_err(|source| self.io_error(offset, len, source))
    }

    /// One op without data, waited for.
    fn run(
        &self,
        offset: u64,
        len: u64,
        call: impl FnOnce(&'static Library, ImageT, CompletionT) -> c_int,
    ) -> DeviceResult<()> {
        self.check_not_stuck(offset, len)?;
        let op = self.start(
            offset,
            len,
            Expect::Success,
            Vec::new(),
            |lib, image, c, _, _| call(lib, image, c),
        );
        self.wait_all(&[op], |_, _| {})
    }

    async fn read_async(
        &self,
        reactor: Reactor,
        offset: u64,
        mut slice: BufSlice,
    ) -> (DeviceResult<()>, BufSlice) {
        let len = slice.len();
        if let Err(e) = check_range(&self.name, "read", offset, len as u64, self.size_bytes)
            .and_then(|()| self.check_image_size(Caller::Reactor, Access::Read, offset, len as u64))
            .and_then(|()| self.check_not_stuck(offset, len as u64))
        {
            return (Err(e), slice);
        }
        let pending = self.start_read(offset, len);
        let rc = match first_of(pending.op.done(), reactor.sleep(self.timeout)).await {
            Either::Left(rc) => Some(rc),
            Either::Right(()) => pending.op.abandon(),
        };
        let result = match rc {
            Some(rc) => match pending.expect.check(rc, len as u64) {
                Ok(()) => {
                    slice.as_mut_slice().copy_from_slice(&pending.op.buffer());
                    Ok(())
                }
                Err(source) => Err(self.io_error(offset, len as u64, source)),
            },
            None => Err(self.timed_out(offset, len as u64)),
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
#[derive(Clone, Copy, PartialEq, Eq)]
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

    /// The spec as parsed (pool, image and how the cluster is reached, as
    /// an NBD origin's identity holds its socket), then `#ID`: the image id
    /// changes when an image is deleted and made again under its name.
    /// Without the `#ID` it is the spec that opens the image again.
    fn identity(&self) -> String {
        self.identity.clone()
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn serve_at_recorded_size(&self, volume_bytes: u64) {
        self.size_check.set_volume_bytes(volume_bytes);
    }

    /// Recorded in the image's metadata (see [`super::claim`]).
    fn claim(&self, claim: &OriginClaim) -> DeviceResult<()> {
        super::claim::claim_image(&self.handles, &self.image_path, claim).map_err(|message| {
            DeviceError::Claimed {
                device: self.name.clone(),
                message,
            }
        })
    }

    fn release_claim(&self, cache_uuid: &str) -> DeviceResult<()> {
        super::claim::release_image(&self.handles, cache_uuid).map_err(|message| {
            DeviceError::Claimed {
                device: self.name.clone(),
                message,
            }
        })
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
        let Some(reactor) = Reactor::current() else {
            let result = self.read_at(offset, slice.as_mut_slice());
            return Box::pin(std::future::ready((result, slice)));
        };
        Box::pin(self.read_async(reactor, offset, slice))
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
            self.check_image_size(Caller::MayBlock, Access::Read, *offset, buf.len() as u64)?;
            self.check_not_stuck(*offset, buf.len() as u64)?;
        }
        let ops: Vec<Pending> = requests
            .iter()
            .map(|(offset, buf)| self.start_read(*offset, buf.len()))
            .collect();
        self.wait_all(&ops, |index, data| requests[index].1.copy_from_slice(data))
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> DeviceResult<()> {
        self.write_runs(&[(offset, &[buf])])
    }

    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        self.write_runs(&[(offset, bufs)])
    }

    fn write_many(&self, requests: &[(u64, &[u8])]) -> DeviceResult<()> {
        crate::as_single_buffer_runs(requests, |runs| self.write_runs(runs))
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
        self.check_image_size(Caller::MayBlock, Access::Write, offset, len)?;
        // SAFETY (in the closure): open image and a fresh completion.
        let result = self.run(offset, len, |lib, image, c| unsafe {
            (lib.rbd_aio_discard)(image, offset, len, c)
        });
        self.flush_debt.write_finished();
        result?;
        self.confirm_written(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> DeviceResult<()> {
        check_range(&self.name, "write_zeroes", offset, len, self.size_bytes)?;
        if len == 0 {
            return Ok(());
        }
        self.check_image_size(Caller::MayBlock, Access::Write, offset, len)?;
        let Ok(len_usize) = usize::try_from(len) else {
            return Err(self.io_error(offset, len, io::Error::from_raw_os_error(libc::EINVAL)));
        };
        // SAFETY (in the closure): open image and a fresh completion; no
        // flags.
        let result = self.run(offset, len, |lib, image, c| unsafe {
            (lib.rbd_aio_write_zeroes)(image, offset, len_usize, c, 0, 0)
        });
        self.flush_debt.write_finished();
        result?;
        self.confirm_written(offset, len)
    }

    fn known_problem(&self) -> Option<String> {
        self.size_check.known_problem(&self.handles)
    }

    /// Set once librbd answered EBLOCKLISTED: the cluster fenced this
    /// client for good.
    fn fenced(&self) -> Option<String> {
        self.blocklisted
            .load(Ordering::Acquire)
            .then(|| Blocklisted.to_string())
    }

    /// The image's allocated objects (`rbd_diff_iterate2` from its creation,
    /// whole objects, parent included): an object that exists is data,
    /// anything else reads as zeroes. Asked of the OSDs, after a flush when
    /// a write is still in librbd's cache.
    /// A question to the server, over the network.
    fn allocation_may_wait(&self) -> bool {
        true
    }

    fn allocation(&self, offset: u64, len: u64) -> DeviceResult<Vec<AllocationRun>> {
        check_range(&self.name, "allocation", offset, len, self.size_bytes)?;
        let all_data = || AllocationRun::all_data(len);
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
        let mut push =
            |length_bytes: u64, allocated: bool| push_run(&mut runs, length_bytes, allocated);
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
