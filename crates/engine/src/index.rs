//! The in-memory index: which cache slot holds which origin block.
//!
//! Memory is the budget that matters here (dm-writecache spends ~20 MiB of
//! RAM per GiB of cache). Per log slot we keep:
//! - 40 bits of origin address and 8 bits of state (6 bytes, split into a
//!   `u32` and a `u16` array so both stay naturally aligned),
//! - the block's crc32c (4 bytes),
//! - one `u32` forward-map cell, with the forward map sized for a load factor
//!   of at most 0.8 (5 bytes per slot).
//!
//! That is 15 bytes per cached block. The forward map stores only slot
//! numbers; the address it is keyed by is read back from the slot table, so
//! keys are never stored twice.

use cairn_format::ORIGIN_BLOCKS_MAX;

/// Slot state bits.
pub mod state {
    /// The forward map points at this slot: it holds the newest copy.
    pub const LIVE: u8 = 1;
    /// Inserted clean (read fill or repair): the origin already has it.
    pub const CLEAN_INSERT: u8 = 2;
    /// Failed its checksum while dirty: reads return EIO.
    pub const CORRUPT: u8 = 4;
    /// Hit since it was inserted (second-chance eviction).
    pub const REFERENCED: u8 = 8;
    /// Bits that are persisted in checkpoints.
    pub const PERSISTED: u8 = LIVE | CLEAN_INSERT | CORRUPT;
}

pub struct SlotTable {
    lba_low: Vec<u32>,
    lba_high_state: Vec<u16>,
    crc: Vec<u32>,
}

impl SlotTable {
    pub fn new(slot_count: usize) -> SlotTable {
        SlotTable {
            lba_low: vec![0; slot_count],
            lba_high_state: vec![0; slot_count],
            crc: vec![0; slot_count],
        }
    }

    pub fn len(&self) -> usize {
        self.crc.len()
    }

    pub fn lba(&self, slot: u32) -> u64 {
        let s = slot as usize;
        self.lba_low[s] as u64 | ((self.lba_high_state[s] & 0xff) as u64) << 32
    }

    pub fn state(&self, slot: u32) -> u8 {
        (self.lba_high_state[slot as usize] >> 8) as u8
    }

    pub fn crc(&self, slot: u32) -> u32 {
        self.crc[slot as usize]
    }

    pub fn is_live(&self, slot: u32) -> bool {
        self.state(slot) & state::LIVE != 0
    }

    pub fn set(&mut self, slot: u32, lba: u64, crc: u32, st: u8) {
        assert!(lba <= ORIGIN_BLOCKS_MAX);
        let s = slot as usize;
        self.lba_low[s] = lba as u32;
        self.lba_high_state[s] = ((lba >> 32) as u16 & 0xff) | (st as u16) << 8;
        self.crc[s] = crc;
    }

    pub fn set_state(&mut self, slot: u32, st: u8) {
        let s = slot as usize;
        self.lba_high_state[s] = (self.lba_high_state[s] & 0xff) | (st as u16) << 8;
    }

    pub fn clear(&mut self, slot: u32) {
        self.set(slot, 0, 0, 0);
    }

    pub fn memory_bytes(&self) -> usize {
        self.len() * (4 + 2 + 4)
    }
}

const EMPTY: u32 = u32::MAX;

/// Open-addressing hash map from origin block address to slot, with linear
/// probing and backward-shift deletion (no tombstones, so probe lengths stay
/// bounded by the load factor).
pub struct ForwardMap {
    cells: Vec<u32>,
    len: usize,
    capacity: usize,
}

impl ForwardMap {
    /// A map able to hold `capacity` entries at load factor <= 0.8.
    pub fn new(capacity: usize) -> ForwardMap {
        let cells = (capacity * 5 / 4 + 8).max(16);
        ForwardMap {
            cells: vec![EMPTY; cells],
            len: 0,
            capacity,
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn memory_bytes(&self) -> usize {
        self.cells.len() * 4
    }

    fn home(&self, lba: u64) -> usize {
        // Fibonacci hashing, then a multiply-shift range reduction so the
        // table need not be a power of two.
        let h = lba.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((h as u128 * self.cells.len() as u128) >> 64) as usize
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 == self.cells.len() {
            0
        } else {
            i + 1
        }
    }

    pub fn get(&self, lba: u64, slots: &SlotTable) -> Option<u32> {
        let mut i = self.home(lba);
        // Bounded: the table always has empty cells (load <= 0.8).
        for _ in 0..self.cells.len() {
            let cell = self.cells[i];
            if cell == EMPTY {
                return None;
            }
            if slots.lba(cell) == lba {
                return Some(cell);
            }
            i = self.next(i);
        }
        unreachable!("forward map has no empty cell");
    }

    /// Map `lba` to `slot`, returning the slot it replaced.
    pub fn insert(&mut self, lba: u64, slot: u32, slots: &SlotTable) -> Option<u32> {
        debug_assert_eq!(slots.lba(slot), lba, "slot must already carry the address");
        let mut i = self.home(lba);
        for _ in 0..self.cells.len() {
            let cell = self.cells[i];
            if cell == EMPTY {
                assert!(self.len < self.capacity, "forward map over capacity");
                self.cells[i] = slot;
                self.len += 1;
                return None;
            }
            if cell != slot && slots.lba(cell) == lba {
                self.cells[i] = slot;
                return Some(cell);
            }
            if cell == slot {
                return None;
            }
            i = self.next(i);
        }
        unreachable!("forward map has no empty cell");
    }
}

/// Deletion needs the slot table to recompute home positions, so it lives
/// on a helper taking both.
pub fn remove_mapping(map: &mut ForwardMap, slots: &SlotTable, lba: u64, slot: u32) -> bool {
    let n = map.cells.len();
    let mut i = map.home(lba);
    let mut found = None;
    for _ in 0..n {
        let cell = map.cells[i];
        if cell == EMPTY {
            break;
        }
        if cell == slot {
            found = Some(i);
            break;
        }
        i = map.next(i);
    }
    let Some(mut hole) = found else {
        return false;
    };
    map.cells[hole] = EMPTY;
    map.len -= 1;
    // Backward-shift: move later entries of the cluster into the hole when
    // their home position allows it.
    let mut j = map.next(hole);
    for _ in 0..n {
        let cell = map.cells[j];
        if cell == EMPTY {
            break;
        }
        let home = map.home(slots.lba(cell));
        // Is `home` cyclically outside (hole, j]? Then the entry may move.
        let movable = if hole <= j {
            home <= hole || home > j
        } else {
            home <= hole && home > j
        };
        if movable {
            map.cells[hole] = cell;
            map.cells[j] = EMPTY;
            hole = j;
        }
        j = map.next(j);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn matches_hashmap_under_churn() {
        use rand::{Rng, SeedableRng};
        let slots_n = 1000usize;
        let mut slots = SlotTable::new(slots_n);
        let mut map = ForwardMap::new(slots_n);
        let mut model: HashMap<u64, u32> = HashMap::new();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let mut free: Vec<u32> = (0..slots_n as u32).collect();
        for _ in 0..200_000 {
            let lba = rng.gen_range(0..3000u64);
            if rng.gen_bool(0.5) && !free.is_empty() {
                let slot = free.pop().unwrap();
                slots.set(slot, lba, 0, state::LIVE);
                if let Some(old) = map.insert(lba, slot, &slots) {
                    slots.clear(old);
                    free.push(old);
                }
                model.insert(lba, slot);
            } else if let Some(slot) = model.remove(&lba) {
                assert!(remove_mapping(&mut map, &slots, lba, slot));
                slots.clear(slot);
                free.push(slot);
            }
            assert_eq!(map.len(), model.len());
        }
        for lba in 0..3000u64 {
            assert_eq!(map.get(lba, &slots), model.get(&lba).copied(), "lba {lba}");
        }
    }

    #[test]
    fn memory_per_slot_is_within_budget() {
        let n = 1 << 20;
        let slots = SlotTable::new(n);
        let map = ForwardMap::new(n);
        let per_slot = (slots.memory_bytes() + map.memory_bytes()) as f64 / n as f64;
        println!("index memory: {per_slot:.2} bytes per cached block");
        assert!(per_slot <= 16.0, "{per_slot} bytes per slot");
    }
}
