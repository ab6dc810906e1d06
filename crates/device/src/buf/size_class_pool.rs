//! [`SizeClassPool`]: reusable buffers of many sizes, one [`BufPool`] per
//! power-of-two size class.

use std::sync::Arc;

use super::{Backing, BufPool, PooledBuf};

pub struct SizeClassPool {
    classes: Vec<Arc<BufPool>>,
    min_bytes: usize,
}

impl SizeClassPool {
    /// Classes `min_bytes`, 2x, ... up to `max_bytes` (powers of two), each
    /// keeping at most `class_budget_bytes` of idle buffers (at least
    /// `idle_min` buffers, at most 64).
    pub fn new(
        backing: Backing,
        min_bytes: usize,
        max_bytes: usize,
        class_budget_bytes: usize,
        idle_min: usize,
    ) -> SizeClassPool {
        assert!(min_bytes.is_power_of_two() && max_bytes.is_power_of_two());
        assert!(min_bytes <= max_bytes);
        let count = (max_bytes.trailing_zeros() - min_bytes.trailing_zeros() + 1) as usize;
        let classes = (0..count)
            .map(|class| {
                let bytes = min_bytes << class;
                let idle_max = (class_budget_bytes / bytes).clamp(idle_min, 64);
                Arc::new(BufPool::with_backing(backing, bytes, idle_max))
            })
            .collect();
        SizeClassPool { classes, min_bytes }
    }

    /// The largest class: bigger buffers are allocated and freed as needed.
    pub fn max_class_bytes(&self) -> usize {
        self.min_bytes << (self.classes.len() - 1)
    }

    fn class_of(&self, len: usize) -> Option<usize> {
        let rounded = len.max(self.min_bytes).checked_next_power_of_two()?;
        let class = (rounded.trailing_zeros() - self.min_bytes.trailing_zeros()) as usize;
        (class < self.classes.len()).then_some(class)
    }

    /// An empty buffer of at least `len` bytes that goes back to its class
    /// when dropped (one larger than the largest class is not kept).
    pub fn lend(&self, len: usize) -> PooledBuf {
        match self.class_of(len) {
            Some(class) => self.classes[class].lend_full(),
            None => self.classes[self.classes.len() - 1].lend(len),
        }
    }

    /// Idle buffers kept, over every class.
    pub fn idle_count(&self) -> usize {
        self.classes.iter().map(|class| class.idle_count()).sum()
    }

    /// The most idle buffers class `len` keeps.
    pub fn idle_max_for(&self, len: usize) -> usize {
        self.class_of(len)
            .map_or(0, |class| self.classes[class].idle_max())
    }
}
