//! [`BufPool`]: idle [`BlockBuf`]s of one size, kept for reuse.

use std::sync::{Arc, Mutex, PoisonError};

use super::{Backing, BlockBuf, PooledBuf};

/// Most idle buffers a pool keeps by default, sized for the engine's
/// record buffers: as many as records may be in flight
/// (`SEALED_RECORDS_MAX`), 4 MiB of 256 KiB records. With 4, a stream of
/// 64 KiB writes at queue depth 8 mapped and unmapped buffers all the time
/// (page faults, TLB shootdowns): 0.75-0.93 GB/s against 0.95-1.3 with
/// malloc; with 16, 0.88-1.74 against 0.95-1.72.
const POOL_IDLE_MAX: usize = 16;

/// Buffers of one size, reused: allocating a fresh page-aligned 256 KiB
/// buffer per record fragmented the allocator (the W5 fill's RSS went from
/// 11.9 to 32.4 MiB for a 1 GiB cache). Buffers of another size (the last
/// record of a lap) are allocated and freed as needed.
pub struct BufPool {
    capacity_bytes: usize,
    idle_max: usize,
    backing: Backing,
    idle: Mutex<Vec<BlockBuf>>,
}

impl BufPool {
    /// A pool of mapped `capacity_bytes` buffers keeping up to 16 idle ones.
    pub fn new(capacity_bytes: usize) -> BufPool {
        BufPool::with_backing(Backing::Mapped, capacity_bytes, POOL_IDLE_MAX)
    }

    /// A pool of `capacity_bytes` buffers from `backing`, keeping up to
    /// `idle_max` idle ones, which bounds its memory at
    /// `capacity_bytes * idle_max`.
    pub fn with_backing(backing: Backing, capacity_bytes: usize, idle_max: usize) -> BufPool {
        BufPool {
            capacity_bytes,
            idle_max,
            backing,
            idle: Mutex::new(Vec::with_capacity(idle_max)),
        }
    }

    /// The size of the buffers this pool keeps.
    pub fn capacity_bytes(&self) -> usize {
        self.capacity_bytes
    }

    /// An empty buffer of `capacity` bytes, reused when it is full size.
    pub fn take(&self, capacity: usize) -> BlockBuf {
        if capacity == self.capacity_bytes {
            let reused = self
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop();
            if let Some(mut buf) = reused {
                buf.set_len(0);
                return buf;
            }
        }
        BlockBuf::with_capacity_in(capacity, self.backing)
    }

    /// An empty buffer of `capacity` bytes that goes back to this pool
    /// when dropped (if it is full size and the pool has room).
    pub fn lend(self: &Arc<Self>, capacity: usize) -> PooledBuf {
        PooledBuf::new(self.take(capacity), Arc::clone(self))
    }

    /// [`BufPool::lend`] of the pool's full size.
    pub fn lend_full(self: &Arc<Self>) -> PooledBuf {
        self.lend(self.capacity_bytes)
    }

    /// Give a buffer back; kept if full size and the pool has room.
    pub fn give(&self, buf: BlockBuf) {
        if buf.capacity() != self.capacity_bytes {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() < self.idle_max {
            idle.push(buf);
        }
    }

    /// The most idle buffers kept.
    pub fn idle_max(&self) -> usize {
        self.idle_max
    }

    /// Idle buffers kept now.
    pub fn idle_count(&self) -> usize {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn lent_buffers_come_back_on_drop() {
        let pool = Arc::new(BufPool::with_backing(Backing::Heap, 4096, 1));
        let mut a = pool.lend_full();
        a.extend_from_slice(&[5u8; 100]);
        let a_ptr = a.as_ptr();
        let b = pool.lend_full();
        drop(a);
        drop(b);
        assert_eq!(pool.idle_count(), 1, "bounded by idle_max");
        let c = pool.lend(4096);
        assert_eq!(c.as_ptr(), a_ptr, "reused");
        assert!(c.is_empty());
        drop(pool.lend(100));
        drop(c);
        assert_eq!(pool.idle_count(), 1, "odd sizes are not kept");
    }
}
