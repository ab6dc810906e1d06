//! n-hit promotion: a fixed table of address tags and miss counts.

use std::sync::Mutex;

const HIT_TABLE_ENTRIES: usize = 8192;

/// Open CAS's "nhit" promotion: a block is promoted on its Nth miss within
/// a window. A fixed table of (address tag, count); collisions simply
/// restart the count, which errs towards not promoting.
pub(crate) struct HitFilter {
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
    pub(crate) fn miss(&self, lba: u64, threshold: u32) -> bool {
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

    pub(crate) fn memory_bytes(&self) -> usize {
        HIT_TABLE_ENTRIES * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nhit_promotes_on_nth_miss() {
        let f = HitFilter::default();
        assert!(!f.miss(5, 3));
        assert!(!f.miss(5, 3));
        assert!(f.miss(5, 3));
        assert!(f.miss(9, 1));
    }
}
