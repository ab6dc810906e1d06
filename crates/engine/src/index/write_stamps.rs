//! Which blocks were written since a read planned its misses: a read fill
//! (a block read from the origin, inserted as a clean copy) must never
//! replace data written after the read was planned. The classic cache race:
//! a miss reads the origin's old block, a write to that block is
//! acknowledged meanwhile (and maybe written back and evicted), and then
//! the fill would install the old block over it.
//!
//! Each block hashes to one of a fixed number of counters, bumped by every
//! write, zero, discard or drop of a block in it; a miss remembers the
//! counter of its block (its *stamp*) and the fill goes in only if the
//! counter has not moved. Two blocks sharing a counter only cost a fill
//! that is skipped; ranges too large to bump block by block bump one
//! counter every stamp includes. Fixed memory, no registration, nothing to
//! release when a read fails.

/// Counters: 64 Ki of 8 bytes, 512 KiB.
const BUCKETS: usize = 1 << 16;
/// Ranges longer than this bump the shared counter instead of each block.
const RANGE_BUMP_BLOCKS_MAX: u64 = 1024;

/// A block's counters when a read planned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WriteStamp {
    shared: u64,
    bucket: u64,
}

pub(crate) struct WriteStamps {
    buckets: Box<[u64]>,
    shared: u64,
}

impl Default for WriteStamps {
    fn default() -> Self {
        WriteStamps {
            buckets: vec![0u64; BUCKETS].into_boxed_slice(),
            shared: 0,
        }
    }
}

fn bucket(lba: u64) -> usize {
    (lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 48) as usize % BUCKETS
}

impl WriteStamps {
    /// Start loading `lba`'s counter.
    pub(crate) fn prefetch(&self, lba: u64) {
        cairn_io::prefetch(&self.buckets[bucket(lba)]);
    }

    /// `lba` changed (or may have).
    pub(crate) fn bump(&mut self, lba: u64) {
        let b = &mut self.buckets[bucket(lba)];
        *b = b.wrapping_add(1);
    }

    /// Blocks `[first, end)` changed.
    pub(crate) fn bump_range(&mut self, first: u64, end: u64) {
        if end.saturating_sub(first) > RANGE_BUMP_BLOCKS_MAX {
            self.shared = self.shared.wrapping_add(1);
        } else {
            for lba in first..end {
                self.bump(lba);
            }
        }
    }

    pub(crate) fn stamp(&self, lba: u64) -> WriteStamp {
        WriteStamp {
            shared: self.shared,
            bucket: self.buckets[bucket(lba)],
        }
    }

    /// Nothing that could have changed `lba` happened since `stamp`.
    pub(crate) fn unchanged(&self, lba: u64, stamp: WriteStamp) -> bool {
        self.stamp(lba) == stamp
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.buckets.len() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_after_the_stamp_is_seen_and_others_mostly_are_not() {
        let mut w = WriteStamps::default();
        let stamp = w.stamp(42);
        assert!(w.unchanged(42, stamp));
        w.bump(43);
        // Another block almost never shares the counter.
        let moved = (0..10_000u64).filter(|&l| l != 42).filter(|&l| {
            let mut w = WriteStamps::default();
            let s = w.stamp(42);
            w.bump(l);
            !w.unchanged(42, s)
        });
        assert!(moved.count() < 10, "too many shared counters");
        w.bump(42);
        assert!(!w.unchanged(42, stamp));
        let stamp = w.stamp(7);
        w.bump_range(0, 1 << 20);
        assert!(!w.unchanged(7, stamp), "a huge range moves every stamp");
        let stamp = w.stamp(7);
        w.bump_range(5, 10);
        assert!(!w.unchanged(7, stamp));
    }
}
