//! Sequential stream detection (several streams at once, like bcache), so
//! long sequential reads do not flush the cache's working set. A fixed
//! table: its memory does not grow with the cache.

use std::sync::Mutex;

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
pub(crate) struct SequentialDetector {
    inner: Mutex<([Stream; STREAMS], u64)>,
}

impl SequentialDetector {
    /// Record a request; true if it belongs to a stream longer than
    /// `cutoff_bytes` (0 disables the cutoff).
    pub(crate) fn observe(&self, offset: u64, length: u64, cutoff_bytes: u64) -> bool {
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
}
