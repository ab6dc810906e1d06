//! Per log slot: which block it holds (its key: volume and address), its
//! checksum and its state.
//!
//! 48 bits of key (a `u32` and a `u16` array, so both stay naturally
//! aligned; keys take 45, see `cairn_format::KEY_MAX`), 8 bits of state and
//! the block's crc32c (4 bytes): 11 bytes per slot.

use cairn_format::KEY_MAX;
use cairn_io::HugeTable;

/// Slot state bits.
pub(crate) mod state {
    /// The forward map points at this slot: it holds the newest copy.
    pub const LIVE: u8 = 1;
    /// Inserted clean (read fill or repair): the origin already has it.
    pub const CLEAN_INSERT: u8 = 2;
    /// Failed its checksum while dirty: reads return EIO.
    pub const CORRUPT: u8 = 4;
    /// Hit since it was inserted (second-chance eviction).
    pub const REFERENCED: u8 = 8;
    /// Newer than the origin: written by a client and not yet written
    /// back. Not persisted: recovery derives it from the slot's place
    /// relative to the write-back position.
    pub const DIRTY: u8 = 16;
    /// Bits that are persisted in checkpoints.
    pub const PERSISTED: u8 = LIVE | CLEAN_INSERT | CORRUPT;
}

pub(crate) struct SlotTable {
    key_low: HugeTable<u32>,
    key_high: HugeTable<u16>,
    state: HugeTable<u8>,
    crc: HugeTable<u32>,
}

impl SlotTable {
    pub(crate) fn new(slot_count: usize) -> SlotTable {
        // Zeroed tables cost memory only as slots are used; read at random
        // places for every lookup, they live on huge pages (see
        // `cairn_io::HugeTable`).
        SlotTable {
            key_low: HugeTable::zeroed(slot_count),
            key_high: HugeTable::zeroed(slot_count),
            state: HugeTable::zeroed(slot_count),
            crc: HugeTable::zeroed(slot_count),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.crc.len()
    }

    /// The key of the block in `slot` (for volume 0, its address).
    pub(crate) fn lba(&self, slot: u32) -> u64 {
        let s = slot as usize;
        self.key_low[s] as u64 | (self.key_high[s] as u64) << 32
    }

    pub(crate) fn state(&self, slot: u32) -> u8 {
        self.state[slot as usize]
    }

    pub(crate) fn crc(&self, slot: u32) -> u32 {
        self.crc[slot as usize]
    }

    pub(crate) fn is_live(&self, slot: u32) -> bool {
        self.state(slot) & state::LIVE != 0
    }

    pub(crate) fn set(&mut self, slot: u32, key: u64, crc: u32, st: u8) {
        assert!(key <= KEY_MAX);
        let s = slot as usize;
        self.key_low[s] = key as u32;
        self.key_high[s] = (key >> 32) as u16;
        self.state[s] = st;
        self.crc[s] = crc;
    }

    pub(crate) fn set_state(&mut self, slot: u32, st: u8) {
        self.state[slot as usize] = st;
    }

    pub(crate) fn clear(&mut self, slot: u32) {
        self.set(slot, 0, 0, 0);
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.len() * (4 + 2 + 1 + 4)
    }
}
