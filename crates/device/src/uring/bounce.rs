//! [`BouncePool`]: bounce buffers for memory O_DIRECT cannot take as it is,
//! one shared [`BufPool`] per size class.

use std::sync::Arc;

use crate::{Backing, BufPool, PooledBuf};

/// Bounce buffers are at most this large; a larger unaligned I/O is split
/// into several I/Os of this size (still one submission).
pub(super) const BOUNCE_CHUNK_BYTES: usize = 1 << 20;
/// Size classes of the pool: 4 KiB, 8 KiB, ... 1 MiB.
const POOL_CLASS_MIN_BYTES: usize = 4096;
const POOL_CLASS_COUNT: usize = 9;
/// Each size class keeps at most this many bytes of idle buffers (and at
/// least a few buffers), which bounds the pool at about 28 MiB.
const POOL_CLASS_BUDGET_BYTES: usize = 4 << 20;

/// Reusable aligned bounce buffers, by power-of-two size class: a bounce
/// buffer is taken per chunk of an I/O and goes back to its class when the
/// batch is done, so a warm pool allocates nothing. From the heap: see
/// [`Backing::Heap`].
pub(super) struct BouncePool {
    classes: [Arc<BufPool>; POOL_CLASS_COUNT],
}

impl BouncePool {
    pub(super) fn new() -> BouncePool {
        BouncePool {
            classes: std::array::from_fn(|class| {
                Arc::new(BufPool::with_backing(
                    Backing::Heap,
                    Self::class_bytes(class),
                    Self::class_cap(class),
                ))
            }),
        }
    }

    fn class_of(len: usize) -> usize {
        let rounded = len.max(POOL_CLASS_MIN_BYTES).next_power_of_two();
        (rounded.trailing_zeros() - POOL_CLASS_MIN_BYTES.trailing_zeros()) as usize
    }

    fn class_bytes(class: usize) -> usize {
        POOL_CLASS_MIN_BYTES << class
    }

    fn class_cap(class: usize) -> usize {
        (POOL_CLASS_BUDGET_BYTES / Self::class_bytes(class)).clamp(4, 64)
    }

    /// An empty buffer of at least `len` bytes (`len <= BOUNCE_CHUNK_BYTES`)
    /// that goes back to the pool when dropped.
    pub(super) fn lend(&self, len: usize) -> PooledBuf {
        debug_assert!(len <= BOUNCE_CHUNK_BYTES);
        self.classes[Self::class_of(len)].lend_full()
    }

    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.classes.iter().map(|class| class.idle_count()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buf::BLOCK_BUF_ALIGN_BYTES;

    #[test]
    fn pool_reuses_buffers_by_class() {
        let pool = BouncePool::new();
        let a = pool.lend(5000);
        assert_eq!(a.capacity(), 8192);
        assert_eq!(a.as_ptr() as usize % BLOCK_BUF_ALIGN_BYTES, 0);
        let a_ptr = a.as_ptr();
        drop(a);
        assert_eq!(pool.idle_count(), 1);
        let b = pool.lend(8192);
        assert_eq!(b.as_ptr(), a_ptr, "the idle 8 KiB buffer is reused");
        let c = pool.lend(1);
        assert_eq!(c.capacity(), POOL_CLASS_MIN_BYTES);
        let d = pool.lend(BOUNCE_CHUNK_BYTES);
        assert_eq!(d.capacity(), BOUNCE_CHUNK_BYTES);
        drop(b);
        drop(c);
        drop(d);
        assert_eq!(pool.idle_count(), 3);
    }

    #[test]
    fn pool_is_bounded() {
        let pool = BouncePool::new();
        let class = BouncePool::class_of(BOUNCE_CHUNK_BYTES);
        let bufs: Vec<PooledBuf> = (0..20).map(|_| pool.lend(BOUNCE_CHUNK_BYTES)).collect();
        drop(bufs);
        assert_eq!(pool.idle_count(), BouncePool::class_cap(class));
    }
}
