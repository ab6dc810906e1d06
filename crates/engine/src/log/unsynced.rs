//! Records sealed but not yet covered by a completed barrier, in sequence
//! order: what the next barrier must make durable, and where write-back
//! may go once it has.

use std::collections::VecDeque;

#[derive(Debug, Clone, Copy)]
struct Pending {
    sequence: u64,
    /// Logical offset just past the record.
    end: u64,
    blocks: u64,
    epoch_end: bool,
}

#[derive(Default)]
pub(crate) struct Unsynced {
    records: VecDeque<Pending>,
    blocks: u64,
}

impl Unsynced {
    pub(crate) fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Blocks sealed since the last completed barrier.
    pub(crate) fn blocks(&self) -> u64 {
        self.blocks
    }

    /// A record was sealed.
    pub(crate) fn push(&mut self, sequence: u64, end: u64, blocks: u64, epoch_end: bool) {
        if let Some(last) = self.records.back() {
            assert!(last.sequence < sequence, "records are sealed in order");
        }
        self.records.push_back(Pending {
            sequence,
            end,
            blocks,
            epoch_end,
        });
        self.blocks += blocks;
    }

    /// A barrier made every record up to `sequence` durable. Returns the
    /// end of the last epoch-end record it covered, if any: write-back may
    /// go that far now.
    pub(crate) fn durable_through(&mut self, sequence: u64) -> Option<u64> {
        let mut epoch_end = None;
        while self.records.front().is_some_and(|p| p.sequence <= sequence) {
            let p = self.records.pop_front().expect("checked");
            self.blocks -= p.blocks;
            if p.epoch_end {
                epoch_end = Some(p.end);
            }
        }
        epoch_end
    }

    /// Degraded mode wrote everything to the origin.
    pub(crate) fn clear(&mut self) {
        self.records.clear();
        self.blocks = 0;
    }
}
