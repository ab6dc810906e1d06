//! Cache modes and read-caching policies: sequential cutoff and n-hit
//! promotion. Small, fixed-size structures; their memory does not grow with
//! the cache.

use std::sync::Mutex;

/// How writes and reads use the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMode {
    /// Writes are acknowledged once on the cache and written back later.
    WriteBack,
    /// Writes are acknowledged once the origin has them; the cache keeps a
    /// clean copy.
    WriteThrough,
    /// Writes go to the origin and drop cached copies; reads are cached.
    WriteAround,
    /// The cache is not used for new data; cached (and dirty, until drained)
    /// blocks are still served.
    PassThrough,
}

impl CacheMode {
    pub const ALL: [CacheMode; 4] = [
        CacheMode::WriteBack,
        CacheMode::WriteThrough,
        CacheMode::WriteAround,
        CacheMode::PassThrough,
    ];

    pub fn code(self) -> u8 {
        match self {
            CacheMode::WriteBack => 0,
            CacheMode::WriteThrough => 1,
            CacheMode::WriteAround => 2,
            CacheMode::PassThrough => 3,
        }
    }

    pub fn from_code(code: u8) -> Option<CacheMode> {
        Self::ALL.into_iter().find(|m| m.code() == code)
    }

    pub fn name(self) -> &'static str {
        match self {
            CacheMode::WriteBack => "writeback",
            CacheMode::WriteThrough => "writethrough",
            CacheMode::WriteAround => "writearound",
            CacheMode::PassThrough => "passthrough",
        }
    }

    pub fn parse(name: &str) -> Option<CacheMode> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Do read misses get inserted into the cache in this mode?
    pub fn caches_reads(self) -> bool {
        self != CacheMode::PassThrough
    }

    /// Do writes keep a copy in the cache once written through?
    pub fn keeps_written_copy(self) -> bool {
        matches!(self, CacheMode::WriteBack | CacheMode::WriteThrough)
    }
}

const STREAMS: usize = 8;

#[derive(Clone, Copy, Default)]
struct Stream {
    next_offset: u64,
    run_bytes: u64,
    last_used: u64,
}

/// Detects sequential streams (several at once, like bcache) so that long
/// sequential reads do not flush the cache's working set.
#[derive(Default)]
pub struct SequentialDetector {
    inner: Mutex<([Stream; STREAMS], u64)>,
}

impl SequentialDetector {
    /// Record a request; true if it belongs to a stream longer than
    /// `cutoff_bytes` (0 disables the cutoff).
    pub fn observe(&self, offset: u64, length: u64, cutoff_bytes: u64) -> bool {
        if cutoff_bytes == 0 {
            return false;
        }
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let (streams, clock) = &mut *g;
        *clock += 1;
        let now = *clock;
        if let Some(s) = streams
            .iter_mut()
            .find(|s| s.next_offset == offset && s.last_used != 0)
        {
            s.run_bytes += length;
            s.next_offset = offset + length;
            s.last_used = now;
            return s.run_bytes > cutoff_bytes;
        }
        let lru = streams
            .iter_mut()
            .min_by_key(|s| s.last_used)
            .expect("fixed-size stream table");
        *lru = Stream {
            next_offset: offset + length,
            run_bytes: length,
            last_used: now,
        };
        false
    }
}

const HIT_TABLE_ENTRIES: usize = 8192;

/// Open CAS's "nhit" promotion: a block is promoted on its Nth miss within
/// a window. A fixed table of (address tag, count); collisions simply
/// restart the count, which errs towards not promoting.
pub struct HitFilter {
    table: Mutex<Vec<u64>>,
}

impl Default for HitFilter {
    fn default() -> Self {
        HitFilter {
            table: Mutex::new(vec![u64::MAX; HIT_TABLE_ENTRIES]),
        }
    }
}

impl HitFilter {
    /// Count a miss of `lba`; true once it has missed `threshold` times.
    pub fn miss(&self, lba: u64, threshold: u32) -> bool {
        if threshold <= 1 {
            return true;
        }
        let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let i = (lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 51) as usize % HIT_TABLE_ENTRIES;
        let tag = lba & ((1 << 48) - 1);
        let entry = t[i];
        let count = if entry != u64::MAX && entry & ((1 << 48) - 1) == tag {
            (entry >> 48) + 1
        } else {
            1
        };
        if count >= threshold as u64 {
            t[i] = u64::MAX;
            true
        } else {
            t[i] = tag | (count.min(0xffff) << 48);
            false
        }
    }

    pub fn memory_bytes(&self) -> usize {
        HIT_TABLE_ENTRIES * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_detected_and_interleave() {
        let d = SequentialDetector::default();
        let mb = 1 << 20;
        let mut bypassed = 0;
        for i in 0..16u64 {
            // Two interleaved streams and random noise.
            if d.observe(i * mb, mb, 4 * mb) {
                bypassed += 1;
            }
            if d.observe((1 << 40) + i * mb, mb, 4 * mb) {
                bypassed += 1;
            }
            assert!(!d.observe(i * 7919 * 4096 + (1 << 35), 4096, 4 * mb));
        }
        assert_eq!(bypassed, 2 * 12);
        assert!(!d.observe(0, mb, 0), "cutoff 0 disables");
    }

    #[test]
    fn nhit_promotes_on_nth_miss() {
        let f = HitFilter::default();
        assert!(!f.miss(5, 3));
        assert!(!f.miss(5, 3));
        assert!(f.miss(5, 3));
        assert!(f.miss(9, 1));
    }
}
