//! [`BlockBuf`]: a fixed-capacity, page-aligned byte buffer (see the
//! [module documentation](super) for why it is mapped, not allocated).

use std::alloc::{handle_alloc_error, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment of every buffer: a page satisfies every O_DIRECT memory rule.
pub(crate) const BLOCK_BUF_ALIGN_BYTES: usize = 4096;

/// A byte buffer of fixed capacity, page aligned, filled from the front.
/// Always backed by an anonymous mapping (or empty), so every byte of its
/// capacity is initialised: `set_len` relies on it.
pub struct BlockBuf {
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
            .expect("block buffers are at most a few MiB, far below isize::MAX")
    }

    /// An empty buffer that can hold `capacity` bytes. Allocates nothing
    /// for a zero capacity. Out of memory aborts, as for any allocation.
    pub fn with_capacity(capacity: usize) -> BlockBuf {
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

    /// A buffer of `len` zero bytes: a fresh mapping reads as zeroes.
    pub fn zeroed(len: usize) -> BlockBuf {
        let mut buf = BlockBuf::with_capacity(len);
        buf.set_len(len);
        buf
    }

    #[inline]
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Make the first `len` bytes the content, whatever they hold, to be
    /// overwritten in place (a device read into the buffer). Sound without
    /// `unsafe`: every byte of the mapping is initialised, zero-filled by
    /// mmap or left from an earlier use of a pooled buffer.
    #[inline]
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.capacity,
            "record buffer overflow: {len} > {}",
            self.capacity
        );
        self.len = len;
    }

    /// Append `bytes`; the capacity is fixed and must not be exceeded.
    #[inline]
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
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

impl Deref for BlockBuf {
    type Target = [u8];

    #[inline]
    fn deref(&self) -> &[u8] {
        // SAFETY: the first `len` bytes are initialised (written by
        // `extend_from_slice`); for a zero capacity `len` is 0 and a
        // dangling pointer is valid for an empty slice.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for BlockBuf {
    #[inline]
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
    fn zeroed_buffer_reads_as_zeroes() {
        let z = BlockBuf::zeroed(2 * 4096 + 512);
        assert_eq!(z.len(), 2 * 4096 + 512);
        assert_eq!(z.as_ptr() as usize % BLOCK_BUF_ALIGN_BYTES, 0);
        assert!(z.iter().all(|&x| x == 0));
        assert!(BlockBuf::zeroed(0).is_empty());
    }

    #[test]
    #[should_panic(expected = "record buffer overflow")]
    fn capacity_is_enforced() {
        let mut b = BlockBuf::with_capacity(4096);
        b.extend_from_slice(&[0u8; 4097]);
    }
}
