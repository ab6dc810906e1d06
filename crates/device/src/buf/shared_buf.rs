//! [`SharedBuf`] and [`BufSlice`]: one buffer filled by several reads in
//! flight at once, each into its own range (the blocks of one client read
//! come from different cache slots and from the origin).

use std::cell::{RefCell, UnsafeCell};
use std::ops::Range;
use std::rc::Rc;

use smallvec::SmallVec;

use super::PooledBuf;

struct Shared {
    /// Owned here, never touched while shared: every access goes through
    /// `base`, taken once when the buffer came in.
    buf: UnsafeCell<PooledBuf>,
    base: *mut u8,
    len: usize,
    /// Ranges lent out as slices right now: they never overlap.
    /// Kept inline for the few reads of one request.
    lent: RefCell<SmallVec<[Range<usize>; 4]>>,
}

/// A buffer whose disjoint ranges are lent out as [`BufSlice`]s (to reads
/// in flight); once every slice is back, [`SharedBuf::into_inner`] returns
/// the buffer. Single-threaded (the reads run on one reactor).
pub struct SharedBuf {
    shared: Rc<Shared>,
}

/// A range of a [`SharedBuf`], owned: a read writes into it while the
/// other ranges are written by other reads.
pub struct BufSlice {
    shared: Rc<Shared>,
    range: Range<usize>,
}

impl SharedBuf {
    pub fn new(mut buf: PooledBuf) -> SharedBuf {
        let base = buf.as_mut_ptr();
        let len = buf.len();
        SharedBuf {
            shared: Rc::new(Shared {
                buf: UnsafeCell::new(buf),
                base,
                len,
                lent: RefCell::new(SmallVec::new()),
            }),
        }
    }

    pub fn len(&self) -> usize {
        self.shared.len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Lend `range` out. Panics if it is outside the buffer or overlaps a
    /// range lent out now: two writers of one byte would be a data race.
    pub fn slice(&self, range: Range<usize>) -> BufSlice {
        assert!(range.start <= range.end && range.end <= self.len());
        let mut lent = self.shared.lent.borrow_mut();
        assert!(
            lent.iter()
                .all(|r| r.end <= range.start || range.end <= r.start),
            "overlapping slices of one buffer"
        );
        lent.push(range.clone());
        BufSlice {
            shared: self.shared.clone(),
            range,
        }
    }

    /// The buffer back, once no slice of it is alive.
    pub fn into_inner(self) -> Result<PooledBuf, SharedBuf> {
        match Rc::try_unwrap(self.shared) {
            Ok(shared) => Ok(shared.buf.into_inner()),
            Err(shared) => Err(SharedBuf { shared }),
        }
    }
}

impl BufSlice {
    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `base` points into the pooled buffer's allocation, which
        // stays alive and unmoved while the Rc does; the range is inside it
        // and no other slice overlaps it (checked when it was lent); the
        // owner cannot reach the buffer until every slice is gone.
        unsafe { std::slice::from_raw_parts(self.shared.base.add(self.range.start), self.len()) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes the access unique.
        unsafe {
            std::slice::from_raw_parts_mut(self.shared.base.add(self.range.start), self.len())
        }
    }
}

impl Drop for BufSlice {
    fn drop(&mut self) {
        let mut lent = self.shared.lent.borrow_mut();
        if let Some(i) = lent.iter().position(|r| *r == self.range) {
            lent.swap_remove(i);
        }
    }
}

// SAFETY: the bytes live in the pooled buffer's own allocation, which does
// not move when the slice (an Rc and a range) moves, and stays allocated
// while the slice holds its Rc.
unsafe impl cairn_io::StableBuf for BufSlice {
    fn stable_ptr(&self) -> *const u8 {
        self.as_slice().as_ptr()
    }
    fn stable_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: as above; no other slice overlaps this range.
unsafe impl cairn_io::StableBufMut for BufSlice {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_slice().as_mut_ptr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BufPool;
    use std::sync::Arc;

    fn buf(len: usize) -> PooledBuf {
        let pool = Arc::new(BufPool::new(len));
        let mut b = pool.lend_full();
        b.set_len(len);
        b
    }

    #[test]
    fn slices_fill_their_ranges_and_the_buffer_comes_back() {
        let shared = SharedBuf::new(buf(8192));
        let mut a = shared.slice(0..4096);
        let mut b = shared.slice(4096..8192);
        a.as_mut_slice().fill(1);
        b.as_mut_slice().fill(2);
        let shared = shared.into_inner().err().expect("slices are alive");
        drop((a, b));
        let back = shared.into_inner().ok().expect("every slice is back");
        assert!(back[..4096].iter().all(|&x| x == 1));
        assert!(back[4096..].iter().all(|&x| x == 2));
    }

    #[test]
    #[should_panic(expected = "overlapping")]
    fn overlapping_slices_are_refused() {
        let shared = SharedBuf::new(buf(8192));
        let _a = shared.slice(0..4096);
        let _b = shared.slice(4095..5000);
    }

    #[test]
    fn a_returned_range_may_be_lent_again() {
        let shared = SharedBuf::new(buf(4096));
        drop(shared.slice(0..4096));
        let _again = shared.slice(0..4096);
    }
}
