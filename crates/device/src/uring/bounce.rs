//! [`BouncePool`]: bounce buffers for memory O_DIRECT cannot take as it is,
//! one shared [`crate::BufPool`] per size class.

use crate::{Backing, PooledBuf, SizeClassPool};

/// Bounce buffers are at most this large; a larger unaligned I/O is split
/// into several I/Os of this size (still one submission).
pub(super) const BOUNCE_CHUNK_BYTES: usize = 1 << 20;
/// Size classes of the pool: 4 KiB, 8 KiB, ... 1 MiB.
const POOL_CLASS_MIN_BYTES: usize = 4096;
/// Each size class keeps at most this many bytes of idle buffers (and at
/// least a few buffers), which bounds the pool at about 28 MiB.
const POOL_CLASS_BUDGET_BYTES: usize = 4 << 20;
/// Buffers each class keeps at least.
const POOL_CLASS_IDLE_MIN: usize = 4;

/// Reusable aligned bounce buffers, by power-of-two size class: a bounce
/// buffer is taken per chunk of an I/O and goes back to its class when the
/// batch is done, so a warm pool allocates nothing. From the heap: see
/// [`Backing::Heap`].
pub(super) struct BouncePool {
    classes: SizeClassPool,
}

impl BouncePool {
    pub(super) fn new() -> BouncePool {
        BouncePool {
            classes: SizeClassPool::new(
                Backing::Heap,
                POOL_CLASS_MIN_BYTES,
                BOUNCE_CHUNK_BYTES,
                POOL_CLASS_BUDGET_BYTES,
                POOL_CLASS_IDLE_MIN,
            ),
        }
    }

    /// An empty buffer of at least `len` bytes (`len <= BOUNCE_CHUNK_BYTES`)
    /// that goes back to the pool when dropped.
    pub(super) fn lend(&self, len: usize) -> PooledBuf {
        debug_assert!(len <= BOUNCE_CHUNK_BYTES);
        self.classes.lend(len)
    }

    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.classes.idle_count()
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
        let bufs: Vec<PooledBuf> = (0..20).map(|_| pool.lend(BOUNCE_CHUNK_BYTES)).collect();
        drop(bufs);
        assert_eq!(
            pool.idle_count(),
            pool.classes.idle_max_for(BOUNCE_CHUNK_BYTES)
        );
        assert_eq!(pool.idle_count(), 4, "the 1 MiB class keeps 4");
    }
}
