//! [`BlockBuf`]: a fixed-capacity, page-aligned byte buffer, and
//! [`Backing`], where its memory comes from (see the [module
//! documentation](super) for why).

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment of every buffer: a page satisfies every O_DIRECT memory rule.
pub(crate) const BLOCK_BUF_ALIGN_BYTES: usize = 4096;

/// Where a [`BlockBuf`]'s memory comes from. Either way every byte of it
/// is initialised (zero-filled) when the buffer is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    /// An anonymous mapping of its own: for buffers that are large and
    /// live across threads (log records), which from malloc fragmented its
    /// heap; unmapped, freed memory goes back at once.
    Mapped,
    /// The global allocator, zeroed: for buffers that live for one call on
    /// one thread (io_uring bounce buffers), where malloc hands freed
    /// memory straight back out. Mapped instead, every bounce buffer a full
    /// pool cannot keep (a 32 MiB unaligned read is 32 chunks of 1 MiB)
    /// was faulted in and unmapped again: 16 unaligned 1 MiB writes in one
    /// batch took 430-510 CPU us per write, against 120-185 from the heap
    /// (as with the malloc pool this replaced).
    Heap,
}

/// A byte buffer of fixed capacity, page aligned, filled from the front.
/// Always backed by zero-filled memory of its own (or empty), so every
/// byte of its capacity is initialised: `set_len` relies on it.
pub struct BlockBuf {
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
    backing: Backing,
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

    /// An empty, mapped buffer that can hold `capacity` bytes. Allocates
    /// nothing for a zero capacity. Out of memory aborts, as for any
    /// allocation.
    pub fn with_capacity(capacity: usize) -> BlockBuf {
        BlockBuf::with_capacity_in(capacity, Backing::Mapped)
    }

    /// [`BlockBuf::with_capacity`] with memory from `backing`.
    pub fn with_capacity_in(capacity: usize, backing: Backing) -> BlockBuf {
        let ptr = if capacity == 0 {
            NonNull::dangling()
        } else {
            match backing {
                Backing::Mapped => Self::map(capacity),
                Backing::Heap => Self::alloc(capacity),
            }
        };
        assert!(
            capacity == 0 || (ptr.as_ptr() as usize).is_multiple_of(BLOCK_BUF_ALIGN_BYTES),
            "block buffers are page aligned"
        );
        BlockBuf {
            ptr,
            len: 0,
            capacity,
            backing,
        }
    }

    fn map(capacity: usize) -> NonNull<u8> {
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
        ptr
    }

    fn alloc(capacity: usize) -> NonNull<u8> {
        let layout = Self::layout(capacity);
        // SAFETY: the layout has a non-zero size (`capacity > 0`).
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            handle_alloc_error(layout)
        };
        ptr
    }

    /// A mapped buffer of `len` zero bytes: a fresh mapping reads as zeroes.
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

    /// A fixed-capacity buffer never grows: more bytes than fit is a bug in
    /// the caller's sizing.
    fn assert_room_for(&self, len: usize) {
        assert!(
            len <= self.capacity - self.len,
            "record buffer overflow: {} + {len} > {}",
            self.len,
            self.capacity
        );
    }

    /// Append `bytes`; the capacity is fixed and must not be exceeded.
    #[inline]
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.assert_room_for(bytes.len());
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

    /// [`BlockBuf::extend_from_slice`] with stores that bypass the CPU
    /// cache, for data written to a device and not read again by this
    /// thread (a log record's blocks): the copy then neither reads the
    /// destination's lines first nor evicts the lines the caller works on.
    /// Falls back to the plain copy where the destination is not 16-byte
    /// aligned or the length not a multiple of 16.
    pub fn extend_streaming(&mut self, bytes: &[u8]) {
        self.assert_room_for(bytes.len());
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: as in `extend_from_slice`, the destination lies inside
            // our allocation; `dst` is 16-byte aligned (checked), which
            // `_mm_stream_si128` needs, and every load is unaligned-safe.
            // The `sfence` orders the streamed stores before any later store
            // (the release of a lock that hands the buffer to a writer
            // thread), which x86's ordering alone does not do for them.
            unsafe {
                use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
                let dst = self.ptr.as_ptr().add(self.len);
                if (dst as usize).is_multiple_of(16) && bytes.len().is_multiple_of(16) {
                    let src = bytes.as_ptr();
                    for k in (0..bytes.len()).step_by(16) {
                        let v = _mm_loadu_si128(src.add(k).cast::<__m128i>());
                        _mm_stream_si128(dst.add(k).cast::<__m128i>(), v);
                    }
                    _mm_sfence();
                    self.len += bytes.len();
                    return;
                }
            }
        }
        self.extend_from_slice(bytes);
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
        if self.capacity == 0 {
            return;
        }
        match self.backing {
            Backing::Mapped => {
                // SAFETY: mapped in `map` with this same length; no
                // reference into it outlives `self`.
                let rc =
                    unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.capacity) };
                debug_assert_eq!(rc, 0, "munmap of a buffer we mapped");
            }
            // SAFETY: allocated in `alloc` with this same layout; no
            // reference into it outlives `self`.
            Backing::Heap => unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.capacity)) },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streamed copies land byte for byte, from sources at every alignment,
    /// after plain ones, and fall back to a plain copy where the destination
    /// or the length is not a multiple of 16.
    #[test]
    fn streamed_copies_equal_plain_ones() {
        let source: Vec<u8> = (0..3 * 4096 + 64).map(|i| (i * 31 % 251) as u8).collect();
        for misalign in [0usize, 1, 7, 16, 33, 63] {
            let block = &source[misalign..misalign + 4096];
            let mut streamed = BlockBuf::with_capacity(4 * 4096);
            let mut plain = BlockBuf::with_capacity(4 * 4096);
            // 4096 (streamed), 5 and 16 (plain: length, then destination),
            // 11 (plain, realigns), 4096 (streamed again).
            let pieces = [block, &block[..5], &block[5..21], &block[21..32], block];
            for (k, piece) in pieces.into_iter().enumerate() {
                streamed.extend_streaming(piece);
                plain.extend_from_slice(piece);
                assert_eq!(&streamed[..], &plain[..], "misalign {misalign}, piece {k}");
            }
            assert_eq!(streamed.len(), 2 * 4096 + 32);
        }
        let mut full = BlockBuf::with_capacity(4096);
        full.extend_streaming(&source[..4096]);
        assert_eq!(&full[..], &source[..4096]);
    }

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
    fn heap_backed_buffer_is_aligned_and_zeroed() {
        let mut h = BlockBuf::with_capacity_in(2 * 4096, Backing::Heap);
        assert_eq!(h.as_ptr() as usize % BLOCK_BUF_ALIGN_BYTES, 0);
        h.set_len(h.capacity());
        assert!(h.iter().all(|&x| x == 0));
        h.set_len(0);
        h.extend_from_slice(&[3u8; 4096]);
        assert!(h.iter().all(|&x| x == 3));
        assert!(BlockBuf::with_capacity_in(0, Backing::Heap).is_empty());
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
