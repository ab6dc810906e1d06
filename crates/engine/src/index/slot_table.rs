//! Per log slot: which origin block it holds, its checksum and its state.
//!
//! 40 bits of origin address and 8 bits of state (6 bytes, split into a
//! `u32` and a `u16` array so both stay naturally aligned) and the block's
//! crc32c (4 bytes): 10 bytes per slot.

use cairn_format::ORIGIN_BLOCKS_MAX;

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
    lba_low: Vec<u32>,
    lba_high_state: Vec<u16>,
    crc: Vec<u32>,
}

impl SlotTable {
    pub(crate) fn new(slot_count: usize) -> SlotTable {
        SlotTable {
            lba_low: vec![0; slot_count],
            lba_high_state: vec![0; slot_count],
            crc: vec![0; slot_count],
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.crc.len()
    }

    pub(crate) fn lba(&self, slot: u32) -> u64 {
        let s = slot as usize;
        self.lba_low[s] as u64 | ((self.lba_high_state[s] & 0xff) as u64) << 32
    }

    pub(crate) fn state(&self, slot: u32) -> u8 {
        (self.lba_high_state[slot as usize] >> 8) as u8
    }

    pub(crate) fn crc(&self, slot: u32) -> u32 {
        self.crc[slot as usize]
    }

    pub(crate) fn is_live(&self, slot: u32) -> bool {
        self.state(slot) & state::LIVE != 0
    }

    pub(crate) fn set(&mut self, slot: u32, lba: u64, crc: u32, st: u8) {
        assert!(lba <= ORIGIN_BLOCKS_MAX);
        let s = slot as usize;
        self.lba_low[s] = lba as u32;
        self.lba_high_state[s] = ((lba >> 32) as u16 & 0xff) | (st as u16) << 8;
        self.crc[s] = crc;
    }

    pub(crate) fn set_state(&mut self, slot: u32, st: u8) {
        let s = slot as usize;
        self.lba_high_state[s] = (self.lba_high_state[s] & 0xff) | (st as u16) << 8;
    }

    pub(crate) fn clear(&mut self, slot: u32) {
        self.set(slot, 0, 0, 0);
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.len() * (4 + 2 + 4)
    }
}
