//! Origin block address → slot: open addressing with linear probing and
//! backward-shift deletion (no tombstones, so probe lengths stay bounded by
//! the load factor). The map stores only slot numbers; the address it is
//! keyed by is read back from the slot table, so keys are never stored
//! twice: 4 bytes per cell at load factor <= 0.8, 5 bytes per slot.
//!
//! The bits of a cell that its slot number does not need hold a tag: a few
//! bits of the address's hash. A probe reads the slot table (another cache
//! line, far away) only for a cell whose tag matches. Without tags a
//! lookup of an address that is not cached, as for every block of a
//! stream of new writes, read the slot table once per occupied cell it
//! passed. On 1 Mi slots three quarters full (this VM, 3 runs each): an
//! absent address 23-30 ns a lookup before, 6 ns after; a present one
//! 17-32 ns before, 8-11 ns after. `get` had shown as 5-12% of a
//! connection's CPU in profiles of 64 KiB sequential writes (W3).

use cairn_io::HugeTable;

use super::slot_table::SlotTable;

const EMPTY: u32 = u32::MAX;

pub(crate) struct ForwardMap {
    cells: HugeTable<u32>,
    len: usize,
    capacity: usize,
    /// The low bits of a cell that hold its slot; the rest hold the tag
    /// (none when slots need all 32 bits).
    slot_mask: u32,
}

impl ForwardMap {
    /// A map able to hold `capacity` entries at load factor <= 0.8.
    pub(crate) fn new(capacity: usize) -> ForwardMap {
        let cells = (capacity * 5 / 4 + 8).max(16);
        // Slots are below `capacity`, which itself is representable in the
        // slot bits: a slot's bits are never all ones, so no tagged cell is
        // ever EMPTY.
        assert!(
            (capacity as u64) < u32::MAX as u64,
            "slot numbers fit a cell"
        );
        let slot_bits = u64::BITS - (capacity as u64).leading_zeros();
        let slot_mask = if slot_bits >= 32 {
            u32::MAX
        } else {
            (1u32 << slot_bits.max(1)) - 1
        };
        ForwardMap {
            cells: HugeTable::filled(cells, EMPTY),
            len: 0,
            capacity,
            slot_mask,
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

    /// The tag of `lba`, in a cell's high bits (0 when slots need all 32).
    fn tag(&self, lba: u64) -> u32 {
        // Another multiplier than `home`'s, so the tag does not repeat the
        // bits that chose the position.
        let h = (lba.wrapping_mul(0xC2B2_AE3D_27D4_EB4F) >> 32) as u32;
        h & !self.slot_mask
    }

    fn cell(&self, lba: u64, slot: u32) -> u32 {
        debug_assert_eq!(slot & !self.slot_mask, 0, "slot {slot} fits the slot bits");
        let cell = self.tag(lba) | slot;
        debug_assert_ne!(cell, EMPTY);
        cell
    }

    fn slot_of(&self, cell: u32) -> u32 {
        cell & self.slot_mask
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 == self.cells.len() {
            0
        } else {
            i + 1
        }
    }

    /// Start loading the cell where a probe for `lba` begins.
    pub(crate) fn prefetch(&self, lba: u64) {
        cairn_io::prefetch(&self.cells[self.home(lba)]);
    }

    pub(crate) fn get(&self, lba: u64, slots: &SlotTable) -> Option<u32> {
        let tag = self.tag(lba);
        let mut i = self.home(lba);
        // Bounded: the table always has empty cells (load <= 0.8).
        for _ in 0..self.cells.len() {
            let cell = self.cells[i];
            if cell == EMPTY {
                return None;
            }
            if cell & !self.slot_mask == tag {
                let slot = self.slot_of(cell);
                if slots.lba(slot) == lba {
                    return Some(slot);
                }
            }
            i = self.next(i);
        }
        unreachable!("forward map has no empty cell");
    }

    /// Map `lba` to `slot`, returning the slot it replaced.
    pub(crate) fn insert(&mut self, lba: u64, slot: u32, slots: &SlotTable) -> Option<u32> {
        debug_assert_eq!(slots.lba(slot), lba, "slot must already carry the address");
        let new_cell = self.cell(lba, slot);
        let tag = self.tag(lba);
        let mut i = self.home(lba);
        for _ in 0..self.cells.len() {
            let cell = self.cells[i];
            if cell == EMPTY {
                assert!(self.len < self.capacity, "forward map over capacity");
                self.cells[i] = new_cell;
                self.len += 1;
                return None;
            }
            if cell == new_cell {
                return None;
            }
            if cell & !self.slot_mask == tag {
                let old = self.slot_of(cell);
                if slots.lba(old) == lba {
                    self.cells[i] = new_cell;
                    return Some(old);
                }
            }
            i = self.next(i);
        }
        unreachable!("forward map has no empty cell");
    }

    /// Remove the mapping `lba → slot`. Needs the slot table to recompute
    /// the home positions of the entries it shifts back.
    pub(crate) fn remove(&mut self, slots: &SlotTable, lba: u64, slot: u32) -> bool {
        let n = self.cells.len();
        let wanted = self.cell(lba, slot);
        let mut i = self.home(lba);
        let mut found = None;
        for _ in 0..n {
            let cell = self.cells[i];
            if cell == EMPTY {
                break;
            }
            if cell == wanted {
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
            let home = self.home(slots.lba(self.slot_of(cell)));
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
        // Several sizes: a cell's tag takes 21 to 29 bits.
        for slots_n in [7usize, 1000, 40_000] {
            churn(slots_n, slots_n as u64 * 3);
        }
    }

    #[test]
    fn tags_leave_every_slot_bit_and_never_make_a_cell_empty() {
        for capacity in [1usize, 2, 3, 255, 256, 257, 1 << 20, (1 << 20) - 1] {
            let map = ForwardMap::new(capacity);
            let top = (capacity - 1) as u32;
            for lba in [0u64, 1, 12345, u64::MAX >> 19] {
                for slot in [0, top] {
                    let cell = map.cell(lba, slot);
                    assert_ne!(cell, EMPTY, "capacity {capacity}");
                    assert_eq!(map.slot_of(cell), slot, "capacity {capacity}");
                }
            }
        }
    }

    fn churn(slots_n: usize, lbas: u64) {
        use rand::{Rng, SeedableRng};
        let mut slots = SlotTable::new(slots_n);
        let mut map = ForwardMap::new(slots_n);
        let mut model: HashMap<u64, u32> = HashMap::new();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let mut free: Vec<u32> = (0..slots_n as u32).collect();
        for _ in 0..200_000 {
            let lba = rng.gen_range(0..lbas);
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
        for lba in 0..lbas {
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
