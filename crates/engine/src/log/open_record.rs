//! The record being filled in memory. Its header goes at logical offset
//! `start`, its data blocks right after.

use cairn_format::{block_checksum, RangeKind, RecordEntry};

use cairn_device::PooledBuf;

pub(crate) struct OpenRecord {
    start: u64,
    entries: Vec<RecordEntry>,
    /// Entry index of each data block, in data order.
    data_entry: Vec<u16>,
    /// Page aligned, so the record is written without a bounce copy.
    data: PooledBuf,
    capacity_data_blocks: u64,
    /// Holds something the origin does not have (a client write, zero or
    /// discard), not only clean fills.
    has_dirty: bool,
}

impl OpenRecord {
    pub(crate) fn new(start: u64, capacity_data_blocks: u64, data: PooledBuf) -> OpenRecord {
        assert!(data.is_empty());
        OpenRecord {
            start,
            entries: Vec::new(),
            data_entry: Vec::new(),
            data,
            capacity_data_blocks,
            has_dirty: false,
        }
    }

    pub(crate) fn start(&self) -> u64 {
        self.start
    }

    pub(crate) fn data_count(&self) -> u64 {
        self.data_entry.len() as u64
    }

    pub(crate) fn entries(&self) -> &[RecordEntry] {
        &self.entries
    }

    pub(crate) fn data(&self) -> &[u8] {
        &self.data
    }

    pub(crate) fn has_dirty(&self) -> bool {
        self.has_dirty
    }

    /// Is there no room for one more entry (and data block, if needed)?
    pub(crate) fn is_full(&self, entries_max: usize, need_data: bool) -> bool {
        self.entries.len() >= entries_max
            || (need_data && self.data_count() >= self.capacity_data_blocks)
    }

    /// Logical offset of the next data block.
    pub(crate) fn next_data_position(&self) -> u64 {
        self.start + 1 + self.data_count()
    }

    /// Index of the data block at `logical`, if this record holds it.
    pub(crate) fn data_index(&self, logical: u64) -> Option<usize> {
        if logical > self.start && logical <= self.start + self.data_count() {
            Some((logical - self.start - 1) as usize)
        } else {
            None
        }
    }

    pub(crate) fn block(&self, k: usize, block_bytes: usize) -> &[u8] {
        &self.data[k * block_bytes..(k + 1) * block_bytes]
    }

    /// Add a data block.
    pub(crate) fn push_data(&mut self, lba: u64, crc: u32, clean: bool, block: &[u8]) {
        assert!(self.data_count() < self.capacity_data_blocks);
        self.data_entry.push(self.entries.len() as u16);
        self.entries.push(RecordEntry::Data { lba, crc, clean });
        self.data.extend_streaming(block);
        self.has_dirty |= !clean;
    }

    /// Overwrite data block `k` in place with a client write.
    pub(crate) fn overwrite(&mut self, k: usize, lba: u64, crc: u32, block: &[u8]) {
        let block_bytes = block.len();
        self.data[k * block_bytes..(k + 1) * block_bytes].copy_from_slice(block);
        let entry = self.data_entry[k] as usize;
        self.entries[entry] = RecordEntry::Data {
            lba,
            crc,
            clean: false,
        };
        self.has_dirty = true;
    }

    /// Add a zero or discard range.
    pub(crate) fn push_range(&mut self, kind: RangeKind, lba: u64, block_count: u32) {
        self.entries.push(RecordEntry::Range {
            kind,
            lba,
            block_count,
        });
        self.has_dirty = true;
    }

    /// Check data before writing it: every block must match its entry.
    pub(crate) fn debug_check(&self, block_bytes: usize) {
        assert_eq!(self.data.len(), self.data_count() as usize * block_bytes);
        if cfg!(debug_assertions) {
            for (k, &entry) in self.data_entry.iter().enumerate() {
                if let RecordEntry::Data { lba, crc, .. } = self.entries[entry as usize] {
                    assert_eq!(block_checksum(lba, self.block(k, block_bytes)), crc);
                }
            }
        }
    }

    /// The entries and the data, for sealing.
    pub(crate) fn into_parts(self) -> (Vec<RecordEntry>, PooledBuf) {
        (self.entries, self.data)
    }
}
