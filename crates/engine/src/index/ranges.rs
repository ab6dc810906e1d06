//! Zero/discard ranges that are logged but not yet written back. Reads of
//! an unmapped block inside one return zeroes. Kept disjoint; each part
//! remembers the newest record that set it, so write-back of an older record
//! never clears a range a newer record set again.

use std::collections::BTreeMap;

use cairn_format::{PendingRange, RangeKind};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Part {
    end: u64,
    record_offset: u64,
    kind: RangeKind,
}

#[derive(Default)]
pub struct RangeMap {
    parts: BTreeMap<u64, Part>,
}

impl RangeMap {
    pub fn len(&self) -> usize {
        self.parts.len()
    }

    /// The kind of range covering `lba`, if any.
    pub fn covering(&self, lba: u64) -> Option<RangeKind> {
        let (_, part) = self.parts.range(..=lba).next_back()?;
        (lba < part.end).then_some(part.kind)
    }

    #[cfg(test)]
    /// Length of the run starting at `lba` that is (true) or is not (false)
    /// covered, capped at `max_blocks`.
    pub fn run_from(&self, lba: u64, max_blocks: u64) -> (bool, u64) {
        if let Some((_, part)) = self.parts.range(..=lba).next_back() {
            if lba < part.end {
                return (true, (part.end - lba).min(max_blocks));
            }
        }
        match self.parts.range(lba..).next() {
            Some((&start, _)) => (false, (start - lba).min(max_blocks)),
            None => (false, max_blocks),
        }
    }

    /// Set [start, end) to `kind` from `record_offset`, replacing overlaps.
    pub fn insert(&mut self, start: u64, end: u64, record_offset: u64, kind: RangeKind) {
        assert!(start < end);
        self.cut(start, end);
        self.parts.insert(
            start,
            Part {
                end,
                record_offset,
                kind,
            },
        );
    }

    /// Remove coverage of [start, end), splitting parts at the edges.
    pub fn cut(&mut self, start: u64, end: u64) {
        if let Some((&s, &p)) = self.parts.range(..start).next_back() {
            if p.end > start {
                self.parts.insert(s, Part { end: start, ..p });
                if p.end > end {
                    self.parts.insert(end, Part { end: p.end, ..p });
                }
            }
        }
        let inside: Vec<u64> = self.parts.range(start..end).map(|(&s, _)| s).collect();
        for s in inside {
            let Some(p) = self.parts.remove(&s) else {
                continue;
            };
            if p.end > end {
                self.parts.insert(end, Part { end: p.end, ..p });
            }
        }
    }

    /// Forget every part of a key `chosen` accepts set by a record in
    /// [from, to): written back.
    pub fn retire_records(&mut self, chosen: impl Fn(u64) -> bool, from: u64, to: u64) {
        self.parts.retain(|&start, p| {
            !(p.record_offset >= from && p.record_offset < to && chosen(start))
        });
    }

    /// Forget every part for which `written_back(first key, record
    /// offset)` holds.
    pub fn retire_written_back(&mut self, written_back: impl Fn(u64, u64) -> bool) {
        self.parts
            .retain(|&start, p| !written_back(start, p.record_offset));
    }

    pub fn to_pending(&self) -> Vec<PendingRange> {
        self.parts
            .iter()
            .map(|(&s, p)| PendingRange {
                start_lba: s,
                block_count: p.end - s,
                record_offset: p.record_offset,
                kind: p.kind,
            })
            .collect()
    }

    pub fn insert_pending(&mut self, r: &PendingRange) {
        self.insert(
            r.start_lba,
            r.start_lba + r.block_count,
            r.record_offset,
            r.kind,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_and_retire() {
        let mut m = RangeMap::default();
        m.insert(0, 100, 10, RangeKind::Zero);
        m.insert(40, 60, 20, RangeKind::Discard);
        assert_eq!(m.covering(39), Some(RangeKind::Zero));
        assert_eq!(m.covering(40), Some(RangeKind::Discard));
        assert_eq!(m.covering(60), Some(RangeKind::Zero));
        assert_eq!(m.covering(100), None);
        assert_eq!(m.len(), 3);
        m.retire_records(|_| true, 0, 15);
        assert_eq!(m.covering(10), None);
        assert_eq!(m.covering(50), Some(RangeKind::Discard));
        m.cut(45, 50);
        assert_eq!(m.covering(47), None);
        assert_eq!(m.run_from(40, 1000), (true, 5));
        assert_eq!(m.run_from(45, 1000), (false, 5));
    }
}
