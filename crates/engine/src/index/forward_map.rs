//! Origin block address → slot: open addressing with linear probing and
//! backward-shift deletion (no tombstones, so probe lengths stay bounded by
//! the load factor). The map stores only slot numbers; the address it is
//! keyed by is read back from the slot table, so keys are never stored
//! twice: 4 bytes per cell at load factor <= 0.8, 5 bytes per slot.

use super::slot_table::SlotTable;

const EMPTY: u32 = u32::MAX;

pub(crate) struct ForwardMap {
    cells: Vec<u32>,
    len: usize,
    capacity: usize,
}

impl ForwardMap {
    /// A map able to hold `capacity` entries at load factor <= 0.8.
    pub(crate) fn new(capacity: usize) -> ForwardMap {
        let cells = (capacity * 5 / 4 + 8).max(16);
        ForwardMap {
            cells: vec![EMPTY; cells],
            len: 0,
            capacity,
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn memory_bytes(&self) -> usize {
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

    pub(crate) fn get(&self, lba: u64, slots: &SlotTable) -> Option<u32> {
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
    pub(crate) fn insert(&mut self, lba: u64, slot: u32, slots: &SlotTable) -> Option<u32> {
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

    /// Remove the mapping `lba → slot`. Needs the slot table to recompute
    /// the home positions of the entries it shifts back.
    pub(crate) fn remove(&mut self, slots: &SlotTable, lba: u64, slot: u32) -> bool {
        let n = self.cells.len();
        let mut i = self.home(lba);
        let mut found = None;
        for _ in 0..n {
            let cell = self.cells[i];
            if cell == EMPTY {
                break;
            }
            if cell == slot {
                found = Some(i);
                break;
            }
            i = self.next(i);
        }
        let Some(mut hole) = found else {
            return false;
        };
        self.cells[hole] = EMPTY;
        self.len -= 1;
        // Backward-shift: move later entries of the cluster into the hole
        // when their home position allows it.
        let mut j = self.next(hole);
        for _ in 0..n {
            let cell = self.cells[j];
            if cell == EMPTY {
                break;
            }
            let home = self.home(slots.lba(cell));
            // Is `home` cyclically outside (hole, j]? Then the entry may move.
            let movable = if hole <= j {
                home <= hole || home > j
            } else {
                home <= hole && home > j
            };
            if movable {
                self.cells[hole] = cell;
                self.cells[j] = EMPTY;
                hole = j;
            }
            j = self.next(j);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::slot_table::state;
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
                assert!(map.remove(&slots, lba, slot));
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
        // 11 bytes of slot table (a 45-bit key: volume and address, a
        // state byte, a crc) and 5 of forward map, plus the map's rounding.
        assert!(per_slot <= 16.1, "{per_slot} bytes per slot");
    }
}
