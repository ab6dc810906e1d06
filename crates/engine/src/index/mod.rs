//! The index: which cache slot holds the newest copy of which origin
//! block, the zero/discard ranges not yet written back, the blocks whose
//! dirty data was lost to corruption, and the block gauges.
//!
//! Memory is the budget that matters here (dm-writecache spends ~20 MiB of
//! RAM per GiB of cache): 11 bytes per slot in the slot table, 5 in the
//! forward map, 16 bytes per cached block in all. Blocks are named by
//! keys (volume and address, `cairn_format::block_key`).

mod block_counts;
mod forward_map;
mod plan;
mod ranges;
mod slot_table;
mod write_stamps;

use std::collections::BTreeSet;

use cairn_format::{block_checksum, key_volume, CheckpointEntry, PendingRange, RangeKind};

use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::read_kind::ReadKind;
use crate::stats::Counters;
use crate::tags::TagTable;
use crate::volume_set::VolumeSet;

use block_counts::BlockCounts;
pub use block_counts::VolumeBlocks;
use forward_map::ForwardMap;
pub(crate) use plan::Plan;
use ranges::RangeMap;
pub(crate) use slot_table::state;
use slot_table::SlotTable;
pub(crate) use write_stamps::WriteStamp;
use write_stamps::WriteStamps;

/// Ranges up to this many blocks are dropped block by block through the
/// forward map; larger ones by one pass over the slot table.
const RANGE_LOOKUP_BLOCKS_MAX: u64 = 65536;

pub(crate) struct Index {
    slots: SlotTable,
    map: ForwardMap,
    ranges: RangeMap,
    /// Blocks whose dirty data failed its checksum and left the log: they
    /// read as EIO until rewritten (never as stale origin data).
    lost: BTreeSet<u64>,
    /// A lost mark not yet in a durable checkpoint.
    lost_unpersisted: bool,
    counts: BlockCounts,
    corrupt_blocks: u64,
    /// Which blocks changed since a read planned its misses.
    stamps: WriteStamps,
}

impl Index {
    pub(crate) fn new(slot_count: u64) -> Index {
        Index {
            slots: SlotTable::new(slot_count as usize),
            map: ForwardMap::new(slot_count as usize),
            ranges: RangeMap::default(),
            lost: BTreeSet::new(),
            lost_unpersisted: false,
            counts: BlockCounts::default(),
            corrupt_blocks: 0,
            stamps: WriteStamps::default(),
        }
    }

    pub(crate) fn slot_count(&self) -> u64 {
        self.slots.len() as u64
    }

    // ------------------------------------------------------------ lookups

    /// Start loading what a lookup and a dirty insert of `lba` read first
    /// (its forward-map cell and its write counter), so that a caller about
    /// to handle many blocks has their cache misses overlap: each is at a
    /// place set by a hash, a miss to memory when the table is large.
    pub(crate) fn prefetch(&self, lba: u64) {
        self.map.prefetch(lba);
        self.stamps.prefetch(lba);
    }

    /// The slot holding the newest copy of `lba`.
    pub(crate) fn lookup(&self, lba: u64) -> Option<u32> {
        self.map.get(lba, &self.slots)
    }

    pub(crate) fn is_cached(&self, lba: u64) -> bool {
        self.lookup(lba).is_some()
    }

    pub(crate) fn lba(&self, slot: u32) -> u64 {
        self.slots.lba(slot)
    }

    pub(crate) fn crc(&self, slot: u32) -> u32 {
        self.slots.crc(slot)
    }

    pub(crate) fn is_live(&self, slot: u32) -> bool {
        self.slots.is_live(slot)
    }

    fn has(&self, slot: u32, bit: u8) -> bool {
        self.slots.state(slot) & bit != 0
    }

    pub(crate) fn is_dirty(&self, slot: u32) -> bool {
        self.is_live(slot) && self.has(slot, state::DIRTY)
    }

    pub(crate) fn is_corrupt(&self, slot: u32) -> bool {
        self.has(slot, state::CORRUPT)
    }

    pub(crate) fn is_referenced(&self, slot: u32) -> bool {
        self.has(slot, state::REFERENCED)
    }

    pub(crate) fn is_clean_insert(&self, slot: u32) -> bool {
        self.has(slot, state::CLEAN_INSERT)
    }

    /// Does `slot` still hold `lba` with checksum `crc` (the mapping did
    /// not move since it was looked up)?
    pub(crate) fn still_maps(&self, slot: u32, lba: u64, crc: u32) -> bool {
        self.is_live(slot) && self.lba(slot) == lba && self.crc(slot) == crc
    }

    pub(crate) fn dirty_blocks(&self) -> u64 {
        self.counts.dirty()
    }

    /// Dirty and clean blocks of one volume.
    pub(crate) fn volume_blocks(&self, volume: u16) -> VolumeBlocks {
        self.counts.of_volume(volume)
    }

    pub(crate) fn clean_blocks(&self) -> u64 {
        self.counts.clean()
    }

    pub(crate) fn corrupt_blocks(&self) -> u64 {
        self.corrupt_blocks
    }

    pub(crate) fn live_blocks(&self) -> u64 {
        self.counts.dirty() + self.counts.clean()
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.slots.memory_bytes() + self.map.memory_bytes() + self.stamps.memory_bytes()
    }

    /// How to serve a read of `lba` (see [`Plan`]), filling `block` when
    /// the answer is already known (in memory, zeroed). `in_memory` gives
    /// a slot's data when it is not on the device yet (the log's open or
    /// sealed records). A planned hit marks the slot referenced
    /// (second-chance eviction); a block answered here is counted as
    /// `kind`'s.
    pub(crate) fn plan<'m>(
        &mut self,
        env: &Env,
        in_memory: impl Fn(u32) -> Option<&'m [u8]>,
        tags: Option<&TagTable>,
        lba: u64,
        kind: ReadKind,
        block: &mut [u8],
    ) -> EngineResult<Plan> {
        if let Some(slot) = self.lookup(lba) {
            self.mark_referenced(slot);
            if let Some(data) = in_memory(slot) {
                block.copy_from_slice(data);
                // Check data after copying it, as after every read.
                assert_eq!(
                    block_checksum(lba, block),
                    self.crc(slot),
                    "in-memory record data"
                );
                Counters::add(kind.hits(&env.counters), 1);
                return Ok(Plan::Done);
            }
            if self.is_corrupt(slot) {
                return Err(EngineError::DirtyBlockCorrupt { lba });
            }
            return Ok(Plan::Cache {
                slot,
                crc: self.crc(slot),
            });
        }
        if self.is_lost(lba) {
            return Err(EngineError::DirtyBlockCorrupt { lba });
        }
        if self.range_covering(lba).is_some() {
            block.fill(0);
            Counters::add(kind.zero_hits(&env.counters), 1);
            return Ok(Plan::Done);
        }
        let tag = tags.and_then(|t| t.tag_of(lba));
        if tag == Some(cairn_format::TAG_DISCARDED) {
            // Discarded with integrity on: zeroes, whatever the origin holds.
            block.fill(0);
            Counters::add(kind.zero_hits(&env.counters), 1);
            return Ok(Plan::Done);
        }
        Ok(Plan::Miss {
            tag,
            stamp: self.stamps.stamp(lba),
        })
    }

    /// If a read of `lba` would go to the origin (not cached, not in a
    /// pending zero or discard range), its write stamp now; no side
    /// effects (unlike [`Index::plan`]).
    pub(crate) fn origin_stamp(&self, lba: u64) -> Option<WriteStamp> {
        (!self.is_cached(lba) && self.range_covering(lba).is_none()).then(|| self.stamps.stamp(lba))
    }

    /// May a block read from the origin for a miss planned with `stamp` be
    /// inserted as a clean copy? Only if `lba` is still not cached and
    /// nothing wrote it since.
    pub(crate) fn fill_allowed(&self, lba: u64, stamp: WriteStamp) -> bool {
        !self.is_cached(lba) && self.stamps.unchanged(lba, stamp)
    }

    // ------------------------------------------------------------ changes

    /// Map `lba` to the free `slot`, replacing (retiring) any older copy.
    /// A clean insert is a copy of what the origin holds (a read fill or a
    /// repair); anything else is dirty. Rewriting a lost block makes it
    /// readable again.
    pub(crate) fn insert(&mut self, slot: u32, lba: u64, crc: u32, clean: bool) {
        assert!(!self.is_live(slot), "insert into live slot {slot}");
        // A clean copy changes nothing a fill could miss: another fill of
        // the same block then finds it cached.
        if !clean {
            self.stamps.bump(lba);
        }
        self.lost.remove(&lba);
        if let Some(old) = self.lookup(lba) {
            assert!(!clean, "clean copies only go to unmapped blocks");
            self.retire(old);
        }
        let st = if clean {
            state::LIVE | state::CLEAN_INSERT
        } else {
            state::LIVE | state::DIRTY
        };
        self.slots.set(slot, lba, crc, st);
        let replaced = self.map.insert(lba, slot, &self.slots);
        assert!(replaced.is_none(), "old mapping was retired first");
        self.counts.add(lba, !clean);
    }

    /// The block in `slot` was overwritten in place (it sits in the open
    /// record, not yet on the device): new checksum, dirty.
    pub(crate) fn rewrite_in_place(&mut self, slot: u32, lba: u64, crc: u32) {
        assert!(self.is_live(slot) && self.lba(slot) == lba);
        self.stamps.bump(lba);
        self.lost.remove(&lba);
        let was_clean = !self.is_dirty(slot);
        assert!(
            !self.is_corrupt(slot),
            "a block in memory cannot be corrupt"
        );
        self.slots.set(slot, lba, crc, state::LIVE | state::DIRTY);
        if was_clean {
            self.counts.set_dirty(lba, true);
        }
    }

    /// Drop a slot from the index (superseded, evicted or repaired).
    pub(crate) fn retire(&mut self, slot: u32) {
        if !self.is_live(slot) {
            return;
        }
        if self.is_corrupt(slot) {
            self.corrupt_blocks -= 1;
        }
        let lba = self.slots.lba(slot);
        self.counts.remove(lba, self.is_dirty(slot));
        let removed = self.map.remove(&self.slots, lba, slot);
        assert!(removed, "a live slot is mapped");
        self.slots.set_state(slot, 0);
    }

    /// The tail passed `slot`: forget what it held.
    pub(crate) fn clear(&mut self, slot: u32) {
        assert!(!self.is_live(slot), "clear a retired slot only");
        self.slots.clear(slot);
    }

    pub(crate) fn mark_corrupt(&mut self, slot: u32) {
        if !self.is_corrupt(slot) {
            let st = self.slots.state(slot);
            self.slots.set_state(slot, st | state::CORRUPT);
            self.corrupt_blocks += 1;
        }
    }

    pub(crate) fn mark_referenced(&mut self, slot: u32) {
        let st = self.slots.state(slot);
        self.slots.set_state(slot, st | state::REFERENCED);
    }

    /// Write-back copied the block in `slot` to the origin (or skipped it
    /// because it failed its checksum): it is no longer newer than the
    /// origin's copy.
    pub(crate) fn mark_written_back(&mut self, slot: u32) {
        if self.is_dirty(slot) {
            let st = self.slots.state(slot);
            self.slots.set_state(slot, st & !state::DIRTY);
            self.counts.set_dirty(self.slots.lba(slot), false);
        }
    }

    /// Degraded mode wrote every dirty block back at once.
    pub(crate) fn mark_all_written_back(&mut self) {
        for slot in 0..self.slots.len() as u32 {
            self.mark_written_back(slot);
        }
        assert_eq!(self.counts.dirty(), 0);
    }

    /// Drop every cached copy and lost mark of blocks `[first, end)`: the
    /// range is being zeroed, discarded or written around the cache.
    pub(crate) fn forget_range(&mut self, first: u64, end: u64) {
        assert!(first < end);
        self.stamps.bump_range(first, end);
        if end - first <= RANGE_LOOKUP_BLOCKS_MAX {
            for lba in first..end {
                if let Some(slot) = self.lookup(lba) {
                    self.retire(slot);
                }
            }
        } else {
            for slot in 0..self.slots.len() as u32 {
                let lba = self.slots.lba(slot);
                if self.is_live(slot) && lba >= first && lba < end {
                    self.retire(slot);
                }
            }
        }
        let gone: Vec<u64> = self.lost.range(first..end).copied().collect();
        for lba in gone {
            self.lost.remove(&lba);
        }
    }

    /// Blocks whose dirty data failed its checksum and is leaving the log
    /// read as EIO from now on, never as the origin's stale copy.
    pub(crate) fn mark_lost(&mut self, lba: u64) {
        self.lost.insert(lba);
        // Must reach a checkpoint before the slot that held the block is
        // written again (see `space::ensure_space`).
        self.lost_unpersisted = true;
    }

    /// Blocks lost to corruption, for a checkpoint.
    pub(crate) fn lost_list(&self) -> Vec<u64> {
        self.lost.iter().copied().collect()
    }

    /// A lost mark was added since the last checkpoint.
    pub(crate) fn lost_unpersisted(&self) -> bool {
        self.lost_unpersisted
    }

    /// A checkpoint holding every lost mark is durable.
    pub(crate) fn lost_persisted(&mut self) {
        self.lost_unpersisted = false;
    }

    /// Load a lost mark from a checkpoint (recovery).
    pub(crate) fn load_lost(&mut self, lba: u64) {
        self.lost.insert(lba);
    }

    pub(crate) fn is_lost(&self, lba: u64) -> bool {
        self.lost.contains(&lba)
    }

    pub(crate) fn lost_blocks(&self) -> u64 {
        self.lost.len() as u64
    }

    /// Blocks of keys `[first, end)` that read as EIO: cached copies that
    /// failed their checksum while dirty, and lost marks.
    pub(crate) fn unreadable_in(&self, first: u64, end: u64) -> u64 {
        let corrupt = (0..self.slots.len() as u32)
            .filter(|&slot| {
                self.is_live(slot) && self.is_corrupt(slot) && {
                    let key = self.slots.lba(slot);
                    key >= first && key < end
                }
            })
            .count() as u64;
        corrupt + self.lost.range(first..end).count() as u64
    }

    // ------------------------------------------------------------- ranges

    /// A zero or discard range logged by the record at `record_offset`.
    pub(crate) fn insert_range(
        &mut self,
        first: u64,
        end: u64,
        record_offset: u64,
        kind: RangeKind,
    ) {
        self.ranges.insert(first, end, record_offset, kind);
    }

    pub(crate) fn range_covering(&self, lba: u64) -> Option<RangeKind> {
        self.ranges.covering(lba)
    }

    /// The records in `[from, to)` were written back: forget their ranges.
    /// Forget the ranges of `volumes` set by records in `[from, to)`:
    /// written back.
    pub(crate) fn retire_ranges(&mut self, volumes: VolumeSet, from: u64, to: u64) {
        self.ranges
            .retire_records(|key| volumes.contains(key_volume(key)), from, to);
    }

    /// Recovery: forget each volume's ranges set by records before its
    /// write-back position (`None`: a volume not served, all of them).
    pub(crate) fn retire_ranges_before(&mut self, position_of: impl Fn(u16) -> Option<u64>) {
        self.ranges.retire_written_back(|key, record_offset| {
            position_of(key_volume(key)).is_none_or(|at| record_offset < at)
        });
    }

    pub(crate) fn range_count(&self) -> usize {
        self.ranges.len()
    }

    pub(crate) fn pending_ranges(&self) -> Vec<PendingRange> {
        self.ranges.to_pending()
    }

    // --------------------------------------------------- checkpoint, replay

    /// Every live slot as a checkpoint entry, in slot order.
    pub(crate) fn checkpoint_entries(&self) -> impl Iterator<Item = CheckpointEntry> + '_ {
        (0..self.slots.len() as u32)
            .filter(|&slot| self.is_live(slot))
            .map(|slot| CheckpointEntry {
                slot,
                lba: self.slots.lba(slot),
                crc: self.slots.crc(slot),
                state: self.slots.state(slot) & state::PERSISTED,
            })
    }

    /// Clean copies (read fills and repairs) that are not corrupt, as
    /// (lba, crc): recovery brings integrity tags up to date from them.
    pub(crate) fn clean_copies(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        (0..self.slots.len() as u32)
            .filter(|&slot| {
                self.is_live(slot) && self.is_clean_insert(slot) && !self.is_corrupt(slot)
            })
            .map(|slot| (self.slots.lba(slot), self.slots.crc(slot)))
    }

    /// Load one checkpoint entry (recovery). Errors describe a damaged
    /// checkpoint.
    pub(crate) fn load_entry(
        &mut self,
        e: &CheckpointEntry,
        key_valid: impl Fn(u64) -> bool,
    ) -> Result<(), String> {
        if e.slot as u64 >= self.slot_count() || !key_valid(e.lba) || self.is_live(e.slot) {
            return Err(format!("bad entry {e:?}"));
        }
        let st = (e.state & state::PERSISTED) | state::LIVE;
        self.slots.set(e.slot, e.lba, e.crc, st);
        if self.map.insert(e.lba, e.slot, &self.slots).is_some() {
            return Err(format!("block {} mapped twice", e.lba));
        }
        Ok(())
    }

    pub(crate) fn load_range(&mut self, range: &PendingRange) {
        self.ranges.insert_pending(range);
    }

    /// Replay reuses `slot`: whatever it held is older.
    pub(crate) fn replay_forget_slot(&mut self, slot: u32) {
        if self.is_live(slot) {
            let lba = self.slots.lba(slot);
            self.map.remove(&self.slots, lba, slot);
        }
        self.slots.clear(slot);
    }

    /// Replay maps `lba` to `slot` (gauges are counted once replay ends).
    pub(crate) fn replay_map(&mut self, slot: u32, lba: u64, crc: u32, clean: bool, corrupt: bool) {
        if let Some(old) = self.lookup(lba) {
            self.replay_forget_slot(old);
        }
        self.lost.remove(&lba);
        let mut st = state::LIVE;
        if clean {
            st |= state::CLEAN_INSERT;
        }
        if corrupt {
            st |= state::CORRUPT;
        }
        self.slots.set(slot, lba, crc, st);
        self.map.insert(lba, slot, &self.slots);
    }

    /// Replay found an acknowledged clean copy of `lba` damaged: drop the
    /// mapping (the origin has the data).
    pub(crate) fn replay_unmap(&mut self, lba: u64) {
        if let Some(old) = self.lookup(lba) {
            self.replay_forget_slot(old);
        }
    }

    /// Replay of a zero or discard range from the record at `record_offset`.
    pub(crate) fn replay_range(
        &mut self,
        kind: RangeKind,
        first: u64,
        end: u64,
        record_offset: u64,
    ) {
        if end - first <= RANGE_LOOKUP_BLOCKS_MAX {
            for lba in first..end {
                self.replay_unmap(lba);
            }
        } else {
            for slot in 0..self.slots.len() as u32 {
                let lba = self.slots.lba(slot);
                if self.is_live(slot) && lba >= first && lba < end {
                    self.replay_forget_slot(slot);
                }
            }
        }
        let gone: Vec<u64> = self.lost.range(first..end).copied().collect();
        for lba in gone {
            self.lost.remove(&lba);
        }
        self.ranges.insert(first, end, record_offset, kind);
    }

    /// After replay: mark dirty every live block that `is_dirty` says is
    /// newer than the origin and count the gauges. Every live slot must lie
    /// in the log (`in_log`), else the log is damaged.
    pub(crate) fn finish_replay(
        &mut self,
        in_log: impl Fn(u32) -> bool,
        is_dirty: impl Fn(u32, u64) -> bool,
    ) -> Result<(), String> {
        let (mut counts, mut corrupt) = (BlockCounts::default(), 0);
        for slot in 0..self.slots.len() as u32 {
            if !self.is_live(slot) {
                continue;
            }
            if !in_log(slot) {
                return Err(format!("live slot {slot} lies outside the log"));
            }
            let mut st = self.slots.state(slot) & !state::DIRTY;
            if st & state::CORRUPT != 0 {
                corrupt += 1;
            }
            let dirty = st & state::CLEAN_INSERT == 0 && is_dirty(slot, self.slots.lba(slot));
            if dirty {
                st |= state::DIRTY;
            }
            counts.add(self.slots.lba(slot), dirty);
            self.slots.set_state(slot, st);
        }
        self.counts = counts;
        self.corrupt_blocks = corrupt;
        Ok(())
    }
}
