//! Large tables the kernel may back with transparent huge pages.
//!
//! The engine's index (the forward map, the slot table) is read at a
//! random place for every block of every request: a 4 GiB cache has a
//! 5 MiB forward map, a 1 TiB one a 1.3 GiB map, and each lookup of
//! another address touches another 4 KiB page. On a VM a TLB miss is a
//! two-level page walk. In a profile of 64 KiB sequential writes (W3,
//! 2026-12-06), the one forward-map read per block was 12-15% of the
//! daemon's CPU on 4 KiB pages and 6.5% on 2 MiB pages.
//!
//! Linux backs anonymous memory with huge pages only where asked
//! (`transparent_hugepage/enabled = madvise`, Debian's default), and only
//! for 2 MiB-aligned extents that lie wholly in the advised mapping. A
//! heap allocation is aligned to 16 bytes, so a [`HugeTable`] maps its
//! own memory, aligned to 2 MiB.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// The size and alignment of a transparent huge page on x86-64 and
/// arm64 (4 KiB base pages).
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Types whose all-zero bytes are a valid value, so a table of them can
/// start as the kernel's zero pages (mapped only when first written).
///
/// # Safety
/// Every bit pattern of zeroes must be a valid `Self`.
pub unsafe trait ZeroIsValid: Copy {}
// SAFETY: zero is a valid value of every integer type.
unsafe impl ZeroIsValid for u8 {}
// SAFETY: as above.
unsafe impl ZeroIsValid for u16 {}
// SAFETY: as above.
unsafe impl ZeroIsValid for u32 {}
// SAFETY: as above.
unsafe impl ZeroIsValid for u64 {}

/// A fixed-length table of `T` in its own mapping, advised for huge
/// pages. Below 2 MiB, or where the mapping fails, it is an ordinary
/// vector (the same behaviour, small pages).
pub struct HugeTable<T: Copy> {
    storage: Storage<T>,
}

enum Storage<T> {
    Heap(Vec<T>),
    Mapped {
        /// The first element, 2 MiB-aligned, inside the mapping.
        first: NonNull<T>,
        len: usize,
        /// The whole mapping, as `munmap` needs it.
        map_start: NonNull<libc::c_void>,
        map_bytes: usize,
    },
}

// SAFETY: the table owns its mapping exclusively, like a Vec owns its
// buffer; access goes through &self / &mut self.
unsafe impl<T: Copy + Send> Send for HugeTable<T> {}
// SAFETY: shared access only reads (Deref to &[T]).
unsafe impl<T: Copy + Sync> Sync for HugeTable<T> {}

impl<T: Copy> HugeTable<T> {
    /// `len` copies of `value`.
    pub fn filled(len: usize, value: T) -> HugeTable<T> {
        match Self::map(len) {
            Some(mut table) => {
                table.fill(value);
                table
            }
            None => HugeTable {
                storage: Storage::Heap(vec![value; len]),
            },
        }
    }

    /// `len` zeroes. The pages cost memory only once written.
    pub fn zeroed(len: usize) -> HugeTable<T>
    where
        T: ZeroIsValid,
    {
        match Self::map(len) {
            // An anonymous mapping reads as zeroes until written.
            Some(table) => table,
            None => HugeTable {
                storage: Storage::Heap(Self::zeroed_vec(len)),
            },
        }
    }

    /// Zeroes from the allocator's zeroed allocation (calloc), which for
    /// a large table is fresh mapped memory left untouched: its pages cost
    /// memory only once written. Zeroing the bytes here made every page of
    /// the small index tables resident at start (3 MiB for a 4 GiB cache).
    fn zeroed_vec(len: usize) -> Vec<T>
    where
        T: ZeroIsValid,
    {
        if len == 0 || std::mem::size_of::<T>() == 0 {
            return Vec::new();
        }
        let layout =
            std::alloc::Layout::array::<T>(len).expect("an index table larger than memory");
        // SAFETY: the layout has a non-zero size (checked above).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        // SAFETY: `ptr` comes from the global allocator with the layout of
        // `len` T (what a Vec of capacity `len` frees with), and all its
        // bytes are zero, a valid T (ZeroIsValid).
        unsafe { Vec::from_raw_parts(ptr, len, len) }
    }

    /// A zero-filled mapping for `len` elements with its first element
    /// on a 2 MiB boundary, advised for huge pages; `None` for a small
    /// table or when the mapping fails.
    fn map(len: usize) -> Option<HugeTable<T>> {
        let bytes = len.checked_mul(std::mem::size_of::<T>())?;
        if bytes < HUGE_PAGE_BYTES || std::mem::align_of::<T>() > HUGE_PAGE_BYTES {
            return None;
        }
        // Room to move the start to the next 2 MiB boundary. Only whole
        // huge pages of the table are advised: a last one advised past the
        // table's end was made resident whole (1 MiB more for the forward
        // map of a 4 GiB cache); the tail stays on small pages.
        let advised_bytes = bytes / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
        let map_bytes = bytes
            .checked_next_multiple_of(HUGE_PAGE_BYTES)?
            .checked_add(HUGE_PAGE_BYTES)?;
        // SAFETY: a new private anonymous mapping; no existing memory is
        // touched. The result is checked before use.
        let map_start = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map_start == libc::MAP_FAILED {
            tracing::debug!(
                bytes,
                error = %std::io::Error::last_os_error(),
                "no mapping for an index table; it uses the heap"
            );
            return None;
        }
        let map_start = NonNull::new(map_start)?;
        let offset = (map_start.as_ptr() as usize).next_multiple_of(HUGE_PAGE_BYTES)
            - map_start.as_ptr() as usize;
        debug_assert!(offset < HUGE_PAGE_BYTES);
        debug_assert!(advised_bytes >= HUGE_PAGE_BYTES && advised_bytes <= bytes);
        // SAFETY: offset + advised_bytes <= map_bytes, so the range is
        // inside the mapping just made. MADV_HUGEPAGE only says how to
        // back it.
        let advised = unsafe {
            let first = map_start.as_ptr().cast::<u8>().add(offset);
            libc::madvise(first.cast(), advised_bytes, libc::MADV_HUGEPAGE)
        };
        if advised != 0 {
            // EINVAL where the kernel has no transparent huge pages: the
            // table works the same on small pages.
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "huge pages not available for an index table"
            );
        }
        // SAFETY: as above, inside the mapping; 2 MiB-aligned, so aligned
        // for T (checked above).
        let first = unsafe { map_start.as_ptr().cast::<u8>().add(offset).cast::<T>() };
        Some(HugeTable {
            storage: Storage::Mapped {
                first: NonNull::new(first)?,
                len,
                map_start,
                map_bytes,
            },
        })
    }

    fn fill(&mut self, value: T) {
        for cell in self.iter_mut() {
            *cell = value;
        }
    }
}

impl<T: Copy> Deref for HugeTable<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.storage {
            Storage::Heap(v) => v,
            // SAFETY: `len` elements from `first` lie inside the mapping,
            // which lives as long as self; they were initialised when the
            // table was made (filled, or zeroes valid for T).
            Storage::Mapped { first, len, .. } => unsafe {
                std::slice::from_raw_parts(first.as_ptr(), *len)
            },
        }
    }
}

impl<T: Copy> DerefMut for HugeTable<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.storage {
            Storage::Heap(v) => v,
            // SAFETY: as in `deref`; &mut self makes the access exclusive.
            Storage::Mapped { first, len, .. } => unsafe {
                std::slice::from_raw_parts_mut(first.as_ptr(), *len)
            },
        }
    }
}

impl<T: Copy> Drop for HugeTable<T> {
    fn drop(&mut self) {
        if let Storage::Mapped {
            map_start,
            map_bytes,
            ..
        } = &self.storage
        {
            // SAFETY: the mapping was made by `map` with this start and
            // length and is unmapped once, here; no slice of it outlives
            // self. T is Copy, so there is nothing to drop in it.
            unsafe {
                libc::munmap(map_start.as_ptr(), *map_bytes);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{HugeTable, HUGE_PAGE_BYTES};

    #[test]
    fn a_table_holds_what_was_asked_whatever_its_size() {
        for len in [0usize, 1, 1000, 3 << 20] {
            let t = HugeTable::filled(len, 0xA5u8);
            assert_eq!(t.len(), len);
            assert!(t.iter().all(|&b| b == 0xA5));
        }
        let t = HugeTable::filled(1 << 20, u32::MAX);
        assert_eq!(t.len(), 1 << 20);
        assert!(t.iter().all(|&c| c == u32::MAX));
    }

    #[test]
    fn a_large_table_starts_on_a_huge_page_boundary() {
        let t: HugeTable<u32> = HugeTable::zeroed(HUGE_PAGE_BYTES);
        assert_eq!(t.as_ptr() as usize % HUGE_PAGE_BYTES, 0);
        let small: HugeTable<u32> = HugeTable::zeroed(16);
        assert_eq!(small.len(), 16);
    }

    #[test]
    fn a_zeroed_table_reads_zero_and_keeps_what_is_written() {
        let mut t: HugeTable<u16> = HugeTable::zeroed(3 << 20);
        assert!(t.iter().all(|&c| c == 0));
        t[12345] = 7;
        let last = t.len() - 1;
        t[last] = 9;
        assert_eq!(t.iter().filter(|&&c| c != 0).count(), 2);
        assert_eq!((t[12345], t[last]), (7, 9));
        // On the heap (under 2 MiB) and past the last whole huge page.
        for len in [(1 << 20) + 3, (3 << 20) + 5] {
            let mut t: HugeTable<u8> = HugeTable::zeroed(len);
            assert!(t.iter().all(|&c| c == 0), "{len}");
            t[len - 1] = 1;
            assert_eq!(t.iter().map(|&c| c as usize).sum::<usize>(), 1);
        }
    }
}
