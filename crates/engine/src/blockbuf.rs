//! Record buffers aligned for direct I/O.
//!
//! A log record is written with O_DIRECT. The io_uring backend writes
//! memory that is aligned in place, and copies anything else into a bounce
//! buffer first: with `Vec<u8>` record buffers every 256 KiB record was
//! copied once more (6.3% of the daemon's CPU in the W3 profile), and with
//! several records in flight the backend's pool kept several idle 512 KiB
//! bounce buffers (+6.6 MiB RSS in the W5 fill). `BlockBuf` is a fixed
//! capacity byte buffer on a page boundary, so records go down as they are.
//!
//! The memory is mapped directly (anonymous mmap), not taken from malloc:
//! these buffers are large and live across threads, and from malloc they
//! fragmented its heap, which kept the freed memory (W5: +7.5 MiB RSS after
//! the fill on a 4 GiB cache). Unmapped, freed memory goes back at once;
//! the pool below keeps a few for reuse so mapping stays rare.

use std::alloc::{handle_alloc_error, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

/// Alignment of every buffer: a page satisfies every O_DIRECT memory rule.
const BLOCK_BUF_ALIGN_BYTES: usize = 4096;

/// A byte buffer of fixed capacity, page aligned, filled from the front.
/// Always backed by an anonymous mapping (or empty), so every byte of its
/// capacity is initialised: `set_len` relies on it.
pub(crate) struct BlockBuf {
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
}

// SAFETY: the buffer owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for BlockBuf {}
// SAFETY: shared references only read the initialised prefix.
unsafe impl Sync for BlockBuf {}

impl BlockBuf {
    fn layout(capacity: usize) -> Layout {
        Layout::from_size_align(capacity, BLOCK_BUF_ALIGN_BYTES)
            .expect("record buffers are at most a few MiB, far below isize::MAX")
    }

    /// An empty buffer that can hold `capacity` bytes. Allocates nothing
    /// for a zero capacity. Out of memory aborts, as for any allocation.
    pub(crate) fn with_capacity(capacity: usize) -> BlockBuf {
        if capacity == 0 {
            return BlockBuf {
                ptr: NonNull::dangling(),
                len: 0,
                capacity: 0,
            };
        }
        // SAFETY: an anonymous private mapping with no address hint touches
        // no existing memory; the result is checked against MAP_FAILED.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                capacity,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            handle_alloc_error(Self::layout(capacity))
        }
        let Some(ptr) = NonNull::new(raw as *mut u8) else {
            handle_alloc_error(Self::layout(capacity))
        };
        assert!(
            (ptr.as_ptr() as usize).is_multiple_of(BLOCK_BUF_ALIGN_BYTES),
            "mappings are page aligned"
        );
        BlockBuf {
            ptr,
            len: 0,
            capacity,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Make the first `len` bytes the content, whatever they hold, to be
    /// overwritten in place (a device read into the buffer). Sound without
    /// `unsafe`: every byte of the mapping is initialised, zero-filled by
    /// mmap or left from an earlier use of a pooled buffer.
    pub(crate) fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.capacity,
            "record buffer overflow: {len} > {}",
            self.capacity
        );
        self.len = len;
    }

    /// Append `bytes`; the capacity is fixed and must not be exceeded.
    pub(crate) fn extend_from_slice(&mut self, bytes: &[u8]) {
        assert!(
            bytes.len() <= self.capacity - self.len,
            "record buffer overflow: {} + {} > {}",
            self.len,
            bytes.len(),
            self.capacity
        );
        // SAFETY: the destination `len..len + bytes.len()` lies inside our
        // allocation of `capacity` bytes (checked above), and `bytes` is a
        // different allocation (we never hand out a reference past `len`).
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.ptr.as_ptr().add(self.len),
                bytes.len(),
            )
        };
        self.len += bytes.len();
    }
}

/// Most idle record buffers kept for reuse: as many as records may be in
/// flight (`SEALED_RECORDS_MAX`), 4 MiB of 256 KiB records. With 4, a
/// stream of 64 KiB writes at queue depth 8 mapped and unmapped buffers
/// all the time (page faults, TLB shootdowns): 0.75-0.93 GB/s against
/// 0.95-1.3 with malloc; with 16, 0.88-1.74 against 0.95-1.72.
const POOL_IDLE_MAX: usize = 16;

/// Full-size record buffers, reused: allocating a fresh page-aligned
/// 256 KiB buffer per record fragmented the allocator (the W5 fill's RSS
/// went from 11.9 to 32.4 MiB for a 1 GiB cache). Buffers of another size
/// (the last record of a lap) are allocated and freed as needed.
pub(crate) struct BufPool {
    capacity_bytes: usize,
    idle: Mutex<Vec<BlockBuf>>,
}

impl BufPool {
    pub(crate) fn new(capacity_bytes: usize) -> BufPool {
        BufPool {
            capacity_bytes,
            idle: Mutex::new(Vec::with_capacity(POOL_IDLE_MAX)),
        }
    }

    /// An empty buffer of `capacity` bytes, reused when it is full size.
    pub(crate) fn take(&self, capacity: usize) -> BlockBuf {
        if capacity == self.capacity_bytes {
            let reused = self
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop();
            if let Some(mut buf) = reused {
                buf.len = 0;
                return buf;
            }
        }
        BlockBuf::with_capacity(capacity)
    }

    /// An empty buffer of `capacity` bytes that goes back to this pool
    /// when dropped (if it is full size and the pool has room).
    pub(crate) fn lend(self: &Arc<Self>, capacity: usize) -> PooledBuf {
        PooledBuf {
            buf: self.take(capacity),
            pool: Arc::clone(self),
        }
    }

    /// [`BufPool::lend`] of the pool's full size.
    pub(crate) fn lend_full(self: &Arc<Self>) -> PooledBuf {
        self.lend(self.capacity_bytes)
    }

    /// Give a buffer back; kept if full size and the pool has room.
    pub(crate) fn give(&self, buf: BlockBuf) {
        if buf.capacity() != self.capacity_bytes {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() < POOL_IDLE_MAX {
            idle.push(buf);
        }
    }
}

/// A [`BlockBuf`] lent by a [`BufPool`], given back when dropped: record
/// data and headers, whether the record goes down with a barrier, waits in
/// flight or is read back by write-back.
pub(crate) struct PooledBuf {
    buf: BlockBuf,
    pool: Arc<BufPool>,
}

impl Deref for PooledBuf {
    type Target = BlockBuf;

    fn deref(&self) -> &BlockBuf {
        &self.buf
    }
}

impl DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut BlockBuf {
        &mut self.buf
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        let buf = std::mem::replace(&mut self.buf, BlockBuf::with_capacity(0));
        self.pool.give(buf);
    }
}

impl Deref for BlockBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: the first `len` bytes are initialised (written by
        // `extend_from_slice`); for a zero capacity `len` is 0 and a
        // dangling pointer is valid for an empty slice.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for BlockBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for BlockBuf {
    fn drop(&mut self) {
        if self.capacity > 0 {
            // SAFETY: mapped in `with_capacity` with this same length; no
            // reference into it outlives `self`.
            let rc = unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.capacity) };
            debug_assert_eq!(rc, 0, "munmap of a buffer we mapped");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_fixed_capacity_buffer() {
        let mut b = BlockBuf::with_capacity(3 * 4096);
        assert_eq!(b.as_ptr() as usize % BLOCK_BUF_ALIGN_BYTES, 0);
        assert!(b.is_empty());
        b.extend_from_slice(&[7u8; 4096]);
        b.extend_from_slice(&[9u8; 4096]);
        assert_eq!(b.len(), 8192);
        assert!(b[..4096].iter().all(|&x| x == 7));
        b[4096..].fill(1);
        assert!(b[4096..].iter().all(|&x| x == 1));
        let mut c = BlockBuf::with_capacity(100);
        c.extend_from_slice(&b[..100]);
        assert_eq!(&c[..], &b[..100]);
        let empty = BlockBuf::with_capacity(0);
        assert!(empty.is_empty());
    }

    #[test]
    fn pool_reuses_full_size_buffers_only() {
        let pool = BufPool::new(8192);
        let mut a = pool.take(8192);
        a.extend_from_slice(&[1u8; 10]);
        let a_ptr = a.as_ptr();
        pool.give(a);
        let b = pool.take(8192);
        assert_eq!(b.as_ptr(), a_ptr, "reused");
        assert!(b.is_empty(), "a reused buffer starts empty");
        let odd = pool.take(4096);
        assert_eq!(odd.capacity(), 4096);
        pool.give(odd);
        assert!(
            pool.idle.lock().unwrap().is_empty(),
            "odd sizes are not kept"
        );
        for _ in 0..POOL_IDLE_MAX + 5 {
            pool.give(BlockBuf::with_capacity(8192));
        }
        assert_eq!(pool.idle.lock().unwrap().len(), POOL_IDLE_MAX);
        drop(b);
    }

    #[test]
    #[should_panic(expected = "record buffer overflow")]
    fn capacity_is_enforced() {
        let mut b = BlockBuf::with_capacity(4096);
        b.extend_from_slice(&[0u8; 4097]);
    }
}
