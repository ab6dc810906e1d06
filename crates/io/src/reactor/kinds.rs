//! The operations a reactor submits.

use std::io;

use io_uring::{opcode, squeue, types};

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

    fn entry(&mut self) -> squeue::Entry {
        let len = self.buf.stable_len().min(TRANSFER_BYTES_MAX) as u32;
        opcode::Read::new(types::Fd(self.fd), self.buf.stable_mut_ptr(), len)
            .offset(self.offset)
            .build()
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

    fn entry(&mut self) -> squeue::Entry {
        let len = self.buf.stable_len().min(TRANSFER_BYTES_MAX) as u32;
        opcode::Write::new(types::Fd(self.fd), self.buf.stable_ptr(), len)
            .offset(self.offset)
            .build()
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

    fn entry(&mut self) -> squeue::Entry {
        self.iovecs = self
            .bufs
            .iter()
            .map(|b| libc::iovec {
                iov_base: b.stable_ptr() as *mut libc::c_void,
                iov_len: b.stable_len(),
            })
            .collect();
        opcode::Writev::new(
            types::Fd(self.fd),
            self.iovecs.as_ptr(),
            self.iovecs.len() as u32,
        )
        .offset(self.offset)
        .build()
    }

    fn finish(self: Box<Self>, res: i32) -> Self::Output {
        (result(res), self.bufs)
    }
}

pub(crate) struct Fsync {
    pub(crate) fd: i32,
    pub(crate) datasync: bool,
}

impl OpKind for Fsync {
    type Output = io::Result<()>;

    fn entry(&mut self) -> squeue::Entry {
        let mut op = opcode::Fsync::new(types::Fd(self.fd));
        if self.datasync {
            op = op.flags(types::FsyncFlags::DATASYNC);
        }
        op.build()
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

    fn finish(self: Box<Self>, res: i32) -> Self::Output {
        result(res).map(|r| r as u32)
    }
}

pub(crate) struct Sleep {
    pub(crate) timespec: types::Timespec,
}

impl OpKind for Sleep {
    type Output = ();

    fn entry(&mut self) -> squeue::Entry {
        opcode::Timeout::new(&self.timespec).build()
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

    fn finish(self: Box<Self>, res: i32) -> Self::Output {
        (result(res), self.buf)
    }
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
        self.iovecs = self.owner.iovecs();
        // SAFETY: an all-zero msghdr is a valid empty header.
        let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
        header.msg_iov = self.iovecs.as_mut_ptr();
        header.msg_iovlen = self.iovecs.len() as _;
        *self.header = header;
        opcode::SendMsg::new(types::Fd(self.fd), &*self.header as *const libc::msghdr)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build()
    }

    fn finish(self: Box<Self>, res: i32) -> Self::Output {
        (result(res), self.owner)
    }
}
