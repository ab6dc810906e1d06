//! Describing a batch: one [`Op`] per I/O, queued on a ring by the
//! `push_*` methods (splitting, bouncing and grouping iovecs), built into
//! SQEs by [`build_entry`].

use io_uring::{opcode, squeue, types};

use super::bounce::BOUNCE_CHUNK_BYTES;
use super::ring_pool::Ring;
use super::UringDevice;
use crate::{DeviceResult, PooledBuf};

/// Largest single read or write op: the SQE length field is 32 bits and
/// Linux caps one transfer just under 2 GiB.
const MAX_OP_BYTES: usize = 1 << 30;
/// Most iovecs in one writev (UIO_MAXIOV).
pub(super) const MAX_IOVECS: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OpKind {
    Read,
    Write,
    Writev,
    Fsync,
}

/// One I/O of a batch, kept in the ring's scratch list until it completes.
pub(super) struct Op {
    pub(super) kind: OpKind,
    pub(super) offset: u64,
    /// Read/Write: the memory the kernel fills or reads (the caller's buffer,
    /// a bounce buffer, or the shared zero buffer). Unused for Writev/Fsync.
    pub(super) ptr: *mut u8,
    /// Read/Write/Writev: bytes to transfer.
    pub(super) len: usize,
    /// Writev: the iovecs are `iovecs[iov_start..iov_start + iov_count]`.
    pub(super) iov_start: usize,
    pub(super) iov_count: usize,
    /// The bounce buffer `ptr` points into, back to its pool when the op is
    /// dropped (the batch is done).
    bounce: Option<PooledBuf>,
    /// Read through a bounce buffer: the caller's memory to fill once the
    /// read completes (null otherwise).
    pub(super) copy_back: *mut u8,
    /// Start only after every earlier I/O of the batch completed.
    drain: bool,
    /// Run on the buffered descriptor (through the page cache) instead of
    /// the direct one: reads from [`crate::Device::read_many_cacheable`].
    pub(super) buffered: bool,
}

impl Op {
    pub(super) fn rw(kind: OpKind, offset: u64, ptr: *mut u8, len: usize) -> Op {
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

    /// A write of `bounce`, which holds the data, at `offset`.
    fn bounced_write(offset: u64, mut bounce: PooledBuf) -> Op {
        let mut op = Op::rw(OpKind::Write, offset, bounce.as_mut_ptr(), bounce.len());
        op.bounce = Some(bounce);
        op
    }

    /// A read of `len` bytes at `offset` into a bounce buffer, copied to
    /// `copy_back` once it completes.
    fn bounced_read(offset: u64, mut bounce: PooledBuf, len: usize, copy_back: *mut u8) -> Op {
        bounce.set_len(len);
        let mut op = Op::rw(OpKind::Read, offset, bounce.as_mut_ptr(), len);
        op.bounce = Some(bounce);
        op.copy_back = copy_back;
        op
    }

    fn writev(offset: u64, iov_start: usize, iov_count: usize, len: usize) -> Op {
        let mut op = Op::rw(OpKind::Writev, offset, std::ptr::null_mut(), len);
        op.iov_start = iov_start;
        op.iov_count = iov_count;
        op
    }
}

impl UringDevice {
    /// Queue a read of an aligned range.
    pub(super) fn push_read(&self, ring: &mut Ring, offset: u64, buf: &mut [u8]) {
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
                let bounce = self.bounce.lend(chunk.len());
                ring.ops.push(Op::bounced_read(
                    offset + at as u64,
                    bounce,
                    chunk.len(),
                    chunk.as_mut_ptr(),
                ));
                at += chunk.len();
            }
        }
    }

    /// Queue a read of any range through the buffered descriptor, straight
    /// into the caller's memory (the page cache has no alignment rules).
    pub(super) fn push_buffered_read(ring: &mut Ring, offset: u64, buf: &mut [u8]) {
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
    pub(super) fn push_write(&self, ring: &mut Ring, offset: u64, buf: &[u8]) {
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
        let mut current: Option<(PooledBuf, usize)> = None; // (buffer, chunk size)
        for buf in bufs {
            let mut src: &[u8] = buf;
            while !src.is_empty() {
                let (bounce, size) = current.get_or_insert_with(|| {
                    let size = BOUNCE_CHUNK_BYTES.min(total - chunk_at);
                    (self.bounce.lend(size), size)
                });
                let n = (*size - bounce.len()).min(src.len());
                bounce.extend_from_slice(&src[..n]);
                src = &src[n..];
                if bounce.len() == *size {
                    if let Some((bounce, size)) = current.take() {
                        ring.ops
                            .push(Op::bounced_write(offset + chunk_at as u64, bounce));
                        chunk_at += size;
                    }
                }
            }
        }
        debug_assert!(current.is_none());
    }

    /// Queue a vectored write of an aligned range.
    pub(super) fn push_writev(&self, ring: &mut Ring, offset: u64, bufs: &[&[u8]]) {
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
                    .push(Op::writev(at, group_start, MAX_IOVECS, group_bytes));
                at += group_bytes as u64;
                group_start = ring.iovecs.len();
                group_bytes = 0;
            }
        }
        let count = ring.iovecs.len() - group_start;
        if count > 0 {
            ring.ops
                .push(Op::writev(at, group_start, count, group_bytes));
        }
    }

    pub(super) fn push_fsync(ring: &mut Ring) {
        let mut op = Op::rw(OpKind::Fsync, 0, std::ptr::null_mut(), 0);
        // Drain: start only after every write queued before it completed,
        // which is what makes "writes + flush" one submission.
        op.drain = !ring.ops.is_empty();
        ring.ops.push(op);
    }
}

/// Call `write(at, piece)` for the bytes of `bufs`, laid back to back from
/// `offset`, that come after the first `skip` (the rest of a short
/// vectored write); stops at the first error.
pub(super) fn for_each_piece_after<'a>(
    offset: u64,
    bufs: impl IntoIterator<Item = &'a [u8]>,
    skip: usize,
    mut write: impl FnMut(u64, &'a [u8]) -> DeviceResult<()>,
) -> DeviceResult<()> {
    let mut skip = skip;
    let mut at = offset;
    for buf in bufs {
        if skip >= buf.len() {
            skip -= buf.len();
            at += buf.len() as u64;
            continue;
        }
        write(at + skip as u64, &buf[skip..])?;
        at += buf.len() as u64;
        skip = 0;
    }
    Ok(())
}

pub(super) fn build_entry(op: &Op, fd: types::Fd, iovecs: &[libc::iovec]) -> squeue::Entry {
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
