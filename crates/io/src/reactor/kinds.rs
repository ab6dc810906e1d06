//! The operations a reactor submits.

use std::io;
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types};

use super::fallback::{poll_now, socket_attempt, syscall, Attempt, Wait};
use super::op::OpKind;
use crate::buf::{StableBuf, StableBufMut, StableBufs};

/// Most bytes one read or write asks for: the kernel caps a single
/// transfer near 2 GiB anyway, and a u32 length must hold it.
const TRANSFER_BYTES_MAX: usize = 1 << 30;

fn result(res: i32) -> io::Result<usize> {
    if res < 0 {
        Err(io::Error::from_raw_os_error(-res))
    } else {
        Ok(res as usize)
    }
}

pub(crate) struct ReadAt<B> {
    pub(crate) fd: i32,
    pub(crate) offset: u64,
    pub(crate) buf: B,
}

impl<B: StableBufMut> OpKind for ReadAt<B> {
    type Output = (io::Result<usize>, B);
    const SUBMIT_PROMPTLY: bool = true;

    fn entry(&mut self) -> squeue::Entry {
        let len = self.buf.stable_len().min(TRANSFER_BYTES_MAX) as u32;
        opcode::Read::new(types::Fd(self.fd), self.buf.stable_mut_ptr(), len)
            .offset(self.offset)
            .build()
    }

    fn attempt(&mut self) -> Attempt {
        let len = self.buf.stable_len().min(TRANSFER_BYTES_MAX);
        let ptr = self.buf.stable_mut_ptr();
        // SAFETY: `ptr` is valid for `len` bytes, owned by this op.
        Attempt::Done(syscall(|| unsafe {
            libc::pread(self.fd, ptr.cast(), len, offset_of(self.offset))
        }))
    }

    fn finish(self: Box<Self>, res: i32) -> Self::Output {
        (result(res), self.buf)
    }
}

pub(crate) struct WriteAt<B> {
    pub(crate) fd: i32,
    pub(crate) offset: u64,
    pub(crate) buf: B,
}

impl<B: StableBuf> OpKind for WriteAt<B> {
    type Output = (io::Result<usize>, B);
    const SUBMIT_PROMPTLY: bool = true;

    fn entry(&mut self) -> squeue::Entry {
        let len = self.buf.stable_len().min(TRANSFER_BYTES_MAX) as u32;
        opcode::Write::new(types::Fd(self.fd), self.buf.stable_ptr(), len)
            .offset(self.offset)
            .build()
    }

    fn attempt(&mut self) -> Attempt {
        let len = self.buf.stable_len().min(TRANSFER_BYTES_MAX);
        let ptr = self.buf.stable_ptr();
        // SAFETY: `ptr` is valid for `len` bytes, owned by this op.
        Attempt::Done(syscall(|| unsafe {
            libc::pwrite(self.fd, ptr.cast(), len, offset_of(self.offset))
        }))
    }

    fn finish(self: Box<Self>, res: i32) -> Self::Output {
        (result(res), self.buf)
    }
}

/// Several buffers written back to back from `offset`.
pub(crate) struct WritevAt<B> {
    pub(crate) fd: i32,
    pub(crate) offset: u64,
    pub(crate) bufs: Vec<B>,
    pub(crate) iovecs: Vec<libc::iovec>,
}

impl<B: StableBuf> OpKind for WritevAt<B> {
    type Output = (io::Result<usize>, Vec<B>);
    const SUBMIT_PROMPTLY: bool = true;

    fn entry(&mut self) -> squeue::Entry {
        self.fill_iovecs();
        opcode::Writev::new(
            types::Fd(self.fd),
            self.iovecs.as_ptr(),
            self.iovecs.len() as u32,
        )
        .offset(self.offset)
        .build()
    }

    fn attempt(&mut self) -> Attempt {
        self.fill_iovecs();
        let count = self.iovecs.len().min(libc::c_int::MAX as usize) as libc::c_int;
        let iovecs = self.iovecs.as_ptr();
        // SAFETY: the iovecs point into buffers this op owns.
        Attempt::Done(syscall(|| unsafe {
            libc::pwritev(self.fd, iovecs, count, offset_of(self.offset))
        }))
    }

    fn finish(self: Box<Self>, res: i32) -> Self::Output {
        (result(res), self.bufs)
    }
}

impl<B: StableBuf> WritevAt<B> {
    fn fill_iovecs(&mut self) {
        self.iovecs = self
            .bufs
            .iter()
            .map(|b| libc::iovec {
                iov_base: b.stable_ptr() as *mut libc::c_void,
                iov_len: b.stable_len(),
            })
            .collect();
    }
}

pub(crate) struct Fsync {
    pub(crate) fd: i32,
    pub(crate) datasync: bool,
}

impl OpKind for Fsync {
    type Output = io::Result<()>;
    const SUBMIT_PROMPTLY: bool = true;

    fn entry(&mut self) -> squeue::Entry {
        let mut op = opcode::Fsync::new(types::Fd(self.fd));
        if self.datasync {
            op = op.flags(types::FsyncFlags::DATASYNC);
        }
        op.build()
    }

    fn attempt(&mut self) -> Attempt {
        let fd = self.fd;
        // SAFETY: plain system calls on a descriptor; no memory passed.
        Attempt::Done(if self.datasync {
            syscall(|| unsafe { libc::fdatasync(fd) } as isize)
        } else {
            syscall(|| unsafe { libc::fsync(fd) } as isize)
        })
    }

    fn finish(self: Box<Self>, res: i32) -> Self::Output {
        result(res).map(|_| ())
    }
}

/// Wait until `fd` is ready for `events` (POLLIN, POLLOUT...).
pub(crate) struct PollFd {
    pub(crate) fd: i32,
    pub(crate) events: u32,
}

impl OpKind for PollFd {
    type Output = io::Result<u32>;

    fn entry(&mut self) -> squeue::Entry {
        opcode::PollAdd::new(types::Fd(self.fd), self.events).build()
    }

    fn attempt(&mut self) -> Attempt {
        poll_now(self.fd, self.events as i16)
    }

    fn finish(self: Box<Self>, res: i32) -> Self::Output {
        result(res).map(|r| r as u32)
    }
}

pub(crate) struct Sleep {
    pub(crate) timespec: types::Timespec,
    pub(crate) duration: Duration,
    /// Without a ring: when it ends, set at the first attempt.
    pub(crate) deadline: Option<Instant>,
}

impl OpKind for Sleep {
    type Output = ();

    fn entry(&mut self) -> squeue::Entry {
        opcode::Timeout::new(&self.timespec).build()
    }

    fn attempt(&mut self) -> Attempt {
        let now = Instant::now();
        let deadline = *self.deadline.get_or_insert(now + self.duration);
        if deadline <= now {
            Attempt::Done(-libc::ETIME)
        } else {
            Attempt::Wait(Wait::Until(deadline))
        }
    }

    fn finish(self: Box<Self>, _res: i32) {
        // -ETIME is the normal end of a timeout.
    }
}

/// Receive into `buf` from a socket.
pub(crate) struct Recv<B> {
    pub(crate) fd: i32,
    pub(crate) buf: B,
}

impl<B: StableBufMut> OpKind for Recv<B> {
    type Output = (io::Result<usize>, B);

    fn entry(&mut self) -> squeue::Entry {
        let len = self.buf.stable_len().min(TRANSFER_BYTES_MAX) as u32;
        opcode::Recv::new(types::Fd(self.fd), self.buf.stable_mut_ptr(), len).build()
    }

    fn attempt(&mut self) -> Attempt {
        let fd = self.fd;
        socket_attempt(fd, libc::POLLIN, || recv_dontwait(fd, &mut self.buf))
    }

    fn finish(self: Box<Self>, res: i32) -> Self::Output {
        (result(res), self.buf)
    }
}

/// One `recv(MSG_DONTWAIT)` into `buf` (at most [`TRANSFER_BYTES_MAX`]):
/// the count, or -1 with `errno` set. The receive without a ring, and
/// `cairn_io::recv_now`.
pub(crate) fn recv_dontwait<B: StableBufMut>(fd: i32, buf: &mut B) -> isize {
    let len = buf.stable_len().min(TRANSFER_BYTES_MAX);
    let ptr = buf.stable_mut_ptr();
    // SAFETY: `ptr` is valid for writes of `len` bytes (the `StableBufMut`
    // contract) for the whole call, and the kernel writes at most `len`.
    unsafe { libc::recv(fd, ptr.cast(), len, libc::MSG_DONTWAIT) }
}

/// Send the buffers `owner` holds on a socket, in order, with
/// `MSG_NOSIGNAL` (a vanished client is an error, not a SIGPIPE).
pub(crate) struct SendOwned<B> {
    pub(crate) fd: i32,
    pub(crate) owner: B,
    pub(crate) iovecs: Vec<libc::iovec>,
    pub(crate) header: Box<libc::msghdr>,
}

impl<B: StableBufs> OpKind for SendOwned<B> {
    type Output = (io::Result<usize>, B);

    fn entry(&mut self) -> squeue::Entry {
        self.fill_header();
        opcode::SendMsg::new(types::Fd(self.fd), &*self.header as *const libc::msghdr)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build()
    }

    fn attempt(&mut self) -> Attempt {
        let (fd, owner) = (self.fd, &self.owner);
        // The same non-blocking sendmsg a reply is first tried with.
        socket_attempt(fd, libc::POLLOUT, || match crate::send_now(fd, owner) {
            Ok(sent) => sent as isize,
            Err(_) => -1,
        })
    }

    fn finish(self: Box<Self>, res: i32) -> Self::Output {
        (result(res), self.owner)
    }
}

impl<B: StableBufs> SendOwned<B> {
    fn fill_header(&mut self) {
        self.iovecs = self.owner.iovecs();
        // SAFETY: an all-zero msghdr is a valid empty header.
        let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
        header.msg_iov = self.iovecs.as_mut_ptr();
        header.msg_iovlen = self.iovecs.len() as _;
        *self.header = header;
    }
}

/// A file offset for pread(2) and friends; one past `off_t`'s range is
/// refused by the kernel with EINVAL, as io_uring refuses it.
fn offset_of(offset: u64) -> libc::off_t {
    libc::off_t::try_from(offset).unwrap_or(-1)
}
