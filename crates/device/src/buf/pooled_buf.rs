//! [`PooledBuf`]: a [`BlockBuf`] that goes back to its [`BufPool`] when
//! dropped.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use super::{BlockBuf, BufPool};

/// A [`BlockBuf`] lent by a [`BufPool`], given back when dropped: record
/// data and headers, whether the record goes down with a barrier, waits in
/// flight or is read back by write-back, and the io_uring bounce buffers.
pub struct PooledBuf {
    buf: BlockBuf,
    pool: Arc<BufPool>,
}

impl PooledBuf {
    pub(super) fn new(buf: BlockBuf, pool: Arc<BufPool>) -> PooledBuf {
        PooledBuf { buf, pool }
    }
}

impl Deref for PooledBuf {
    type Target = BlockBuf;

    #[inline]
    fn deref(&self) -> &BlockBuf {
        &self.buf
    }
}

impl DerefMut for PooledBuf {
    #[inline]
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
