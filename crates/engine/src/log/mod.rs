//! The log: a circular sequence of records on the cache device.
//!
//! Logical offsets grow forever; the physical slot of an offset is
//! `offset % slot_count`. In order:
//! `tail <= writeback_persisted <= writeback_position <= writeback_limit <= head`:
//! - the tail is the oldest slot still in use (eviction moves it);
//! - each volume's write-back has copied its blocks before its own cursor
//!   to its origin (`WritebackCursors`); `writeback_position` is the least
//!   cursor, before which everything is on the origins, and the superblock
//!   says so up to `writeback_persisted` (the tail never passes that, so
//!   dirty data is never overwritten);
//! - `writeback_limit` is the end of the last durable epoch-end record:
//!   write-back may go this far;
//! - the next record starts at `head`.
//!
//! Writes go into the *open record* in memory; a flush or a FUA write
//! seals it with a barrier, a full record is sealed without one and
//! written outside the engine lock (see `crate::sealed`).

mod barrier_plan;
mod open_record;
mod record_reader;
mod rescue_pick;
mod unsynced;
mod writeback_cursors;

pub(crate) use barrier_plan::BarrierPlan;
pub(crate) use open_record::OpenRecord;
pub(crate) use record_reader::{check_shape, read_record_header};
pub(crate) use writeback_cursors::WritebackCursors;

use std::sync::Arc;

use cairn_format::{block_checksum, key_volume, RangeKind, RecordHeader, RECORD_FLAG_EPOCH_END};

use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::index::Index;
use crate::retry::retrying_cache_write;
use crate::sealed::{SealedQueue, SealedRecord};
use crate::stats::Counters;
use crate::volume_set::VolumeSet;
use rescue_pick::RescuePick;
use unsynced::Unsynced;

/// At most this many recently hit clean blocks move forward per eviction
/// round (each costs a cache read and a write).
pub(crate) const SECOND_CHANCE_MAX_BLOCKS: usize = 64;

/// At most this many clean blocks of protected volumes (under their share
/// of the cache while another volume is over its own: see `space.rs`) move
/// forward per eviction round, on top of the recently hit ones.
pub(crate) const SHARE_RESCUE_MAX_BLOCKS: usize = 1024;

/// Blocks always kept free for an empty epoch-end record (plus a lap skip).
pub(crate) const EPOCH_END_RESERVE_BLOCKS: u64 = 3;

/// Where a record that should start at `position` actually starts: records
/// never wrap, and one needs its header and at least one more slot before
/// the end of the lap, else it starts the next lap.
pub(crate) fn record_start(position: u64, slot_count: u64) -> u64 {
    if position % slot_count + 2 > slot_count {
        position.div_ceil(slot_count) * slot_count
    } else {
        position
    }
}

/// Where the log stands, as recovery found it (or a fresh format).
#[derive(Debug, Clone)]
pub(crate) struct LogPositions {
    pub(crate) tail: u64,
    /// Each volume's write-back position.
    pub(crate) writeback: WritebackCursors,
    pub(crate) writeback_limit: u64,
    pub(crate) head: u64,
    pub(crate) checkpoint_head: u64,
    pub(crate) next_sequence: u64,
    pub(crate) prev_crc: u32,
    pub(crate) durable_sequence: u64,
}

pub(crate) struct Log {
    slot_count: u64,
    /// Stamped on every record: bumped at each open.
    generation: u64,
    tail: u64,
    writeback: WritebackCursors,
    /// The least write-back position the superblock records.
    writeback_persisted: u64,
    writeback_limit: u64,
    head: u64,
    /// Head at the newest checkpoint; replay starts there, so the log must
    /// never lap it.
    checkpoint_head: u64,
    next_sequence: u64,
    prev_crc: u32,
    /// The newest record known durable (covered by a completed barrier).
    durable_sequence: u64,
    /// Records sealed since the last completed barrier.
    unsynced: Unsynced,
    /// Records were sealed since the last epoch end.
    epoch_open: bool,
    open: Option<OpenRecord>,
    sealed: SealedQueue,
}

impl Log {
    pub(crate) fn new(slot_count: u64, generation: u64, at: LogPositions) -> Log {
        let least = at.writeback.least();
        assert!(at.tail <= least);
        assert!(at.writeback.iter().all(|(_, p)| p <= at.writeback_limit));
        assert!(at.writeback_limit <= at.head);
        Log {
            slot_count,
            generation,
            tail: at.tail,
            writeback: at.writeback,
            writeback_persisted: least,
            writeback_limit: at.writeback_limit,
            head: at.head,
            checkpoint_head: at.checkpoint_head,
            next_sequence: at.next_sequence,
            prev_crc: at.prev_crc,
            durable_sequence: at.durable_sequence,
            unsynced: Unsynced::default(),
            epoch_open: at.head > at.writeback_limit,
            open: None,
            sealed: SealedQueue::default(),
        }
    }

    // ------------------------------------------------------------ geometry

    pub(crate) fn slot_count(&self) -> u64 {
        self.slot_count
    }

    pub(crate) fn phys(&self, logical: u64) -> u32 {
        (logical % self.slot_count) as u32
    }

    /// Logical offset of a slot holding data between tail and head.
    pub(crate) fn logical_of(&self, slot: u32) -> u64 {
        let tail_phys = self.tail % self.slot_count;
        self.tail + (slot as u64 + self.slot_count - tail_phys) % self.slot_count
    }

    /// First logical offset that may not be written: the tail one lap on,
    /// or the newest checkpoint's head one lap on, whichever is sooner.
    pub(crate) fn limit(&self) -> u64 {
        self.tail.min(self.checkpoint_head) + self.slot_count
    }

    /// Where the next data block would go.
    pub(crate) fn append_position(&self) -> u64 {
        match &self.open {
            Some(open) => open.next_data_position(),
            None => self.head,
        }
    }

    pub(crate) fn tail(&self) -> u64 {
        self.tail
    }

    pub(crate) fn head(&self) -> u64 {
        self.head
    }

    /// The least volume's write-back position: every block before it is
    /// on its origin.
    pub(crate) fn writeback_position(&self) -> u64 {
        self.writeback.least()
    }

    /// Each volume's write-back position.
    pub(crate) fn writeback_cursors(&self) -> &WritebackCursors {
        &self.writeback
    }

    /// Volume `id`'s write-back position, if it is served.
    pub(crate) fn volume_writeback_position(&self, id: u16) -> Option<u64> {
        self.writeback.get(id)
    }

    pub(crate) fn writeback_persisted(&self) -> u64 {
        self.writeback_persisted
    }

    pub(crate) fn writeback_limit(&self) -> u64 {
        self.writeback_limit
    }

    pub(crate) fn checkpoint_head(&self) -> u64 {
        self.checkpoint_head
    }

    pub(crate) fn next_sequence(&self) -> u64 {
        self.next_sequence
    }

    pub(crate) fn prev_crc(&self) -> u32 {
        self.prev_crc
    }

    pub(crate) fn durable_sequence(&self) -> u64 {
        self.durable_sequence
    }

    /// Blocks sealed since the last completed barrier.
    pub(crate) fn unsynced_blocks(&self) -> u64 {
        self.unsynced.blocks()
    }

    /// The sequence of the newest sealed record.
    pub(crate) fn last_sequence(&self) -> u64 {
        self.next_sequence - 1
    }

    pub(crate) fn open_start(&self) -> Option<u64> {
        self.open.as_ref().map(OpenRecord::start)
    }

    /// Is anything acknowledged not yet covered by a barrier? (An open
    /// record of clean fills may wait: losing it loses nothing.)
    pub(crate) fn has_unflushed(&self) -> bool {
        self.open.as_ref().is_some_and(OpenRecord::has_dirty)
            || self.epoch_open
            || !self.unsynced.is_empty()
    }

    // ---------------------------------------------------------- in memory

    /// Index of `slot`'s block in the open record, if it sits there.
    pub(crate) fn open_slot_index(&self, slot: u32) -> Option<usize> {
        self.open.as_ref()?.data_index(self.logical_of(slot))
    }

    /// A data block still in memory: in the open record, or in a sealed
    /// record whose write may not be complete.
    pub(crate) fn block_in_memory(&self, slot: u32, block_bytes: usize) -> Option<&[u8]> {
        if let Some(open) = &self.open {
            if let Some(k) = open.data_index(self.logical_of(slot)) {
                return Some(open.block(k, block_bytes));
            }
        }
        if self.sealed.is_empty() {
            return None;
        }
        self.sealed.block(self.logical_of(slot), block_bytes)
    }

    // ------------------------------------------------------------ appends

    /// Bring the open record into existence with room for one more data
    /// block (or entry), sealing the current one when it is full.
    fn open_record(&mut self, env: &Env, index: &mut Index, need_data: bool) -> EngineResult<()> {
        if let Some(open) = &self.open {
            if !open.is_full(env.record_entries_max, need_data) {
                return Ok(());
            }
            self.seal(env, index, false, false)?;
        }
        let start = record_start(self.head, self.slot_count);
        assert!(start < self.limit(), "open_record without reserved space");
        let capacity = env
            .record_data_blocks_max
            .min(self.slot_count - self.phys(start) as u64 - 1);
        assert!(capacity >= 1);
        // Skipped slots at the end of a lap and the header slot hold nothing.
        for logical in self.head..=start {
            let slot = self.phys(logical);
            assert!(!index.is_live(slot), "free slot {slot} is live");
        }
        self.head = start;
        let data = env
            .record_bufs
            .lend(capacity as usize * env.block_size_bytes);
        self.open = Some(OpenRecord::new(start, capacity, data));
        Ok(())
    }

    /// Add a full block to the open record (or overwrite it in place if the
    /// open record already holds this address). A clean block is a copy of
    /// what the origin holds (a read fill, a repair, a second chance).
    pub(crate) fn append_data(
        &mut self,
        env: &Env,
        index: &mut Index,
        lba: u64,
        block: &[u8],
        clean: bool,
    ) -> EngineResult<()> {
        assert_eq!(block.len(), env.block_size_bytes);
        // A request that passed the entry points just before its volume
        // began to be removed finds out here, under the engine lock.
        if !env.origins.takes_new_data(lba) {
            return Err(EngineError::NoSuchVolume {
                volume_id: cairn_format::key_volume(lba),
            });
        }
        let crc = block_checksum(lba, block);
        let existing = index.lookup(lba);
        if !clean && existing.is_some() {
            Counters::add(&env.counters.write_hits, 1);
        }
        if let Some(slot) = existing {
            if let Some(k) = self.open_slot_index(slot) {
                assert!(!clean, "clean fills only go to unmapped blocks");
                let open = self.open.as_mut().expect("the slot is in the open record");
                open.overwrite(k, lba, crc, block);
                index.rewrite_in_place(slot, lba, crc);
                return Ok(());
            }
        }
        self.open_record(env, index, true)?;
        let logical = self.append_position();
        assert!(logical < self.limit(), "append without reserved space");
        index.insert(self.phys(logical), lba, crc, clean);
        let open = self.open.as_mut().expect("opened above");
        open.push_data(lba, crc, clean, block);
        Ok(())
    }

    /// Log a zero or discard range of `count` blocks from `lba`, dropping
    /// the cached copies inside it.
    pub(crate) fn append_range(
        &mut self,
        env: &Env,
        index: &mut Index,
        kind: RangeKind,
        lba: u64,
        count: u64,
    ) -> EngineResult<()> {
        assert!(count > 0 && count <= u32::MAX as u64);
        if !env.origins.takes_new_data(lba) {
            return Err(EngineError::NoSuchVolume {
                volume_id: cairn_format::key_volume(lba),
            });
        }
        let end = lba + count;
        // A dropped block in the open record keeps its data entry there:
        // the range entry after it wins at replay and write-back.
        index.forget_range(lba, end);
        self.open_record(env, index, false)?;
        let open = self.open.as_mut().expect("opened above");
        open.push_range(kind, lba, count as u32);
        index.insert_range(lba, end, open.start(), kind);
        Ok(())
    }

    // ------------------------------------------------------------- sealing

    /// Seal the open record into the log. With `epoch_end`, also seals an
    /// empty record if nothing is open. With `barrier`, every record sealed
    /// before it is written and complete first, and this one goes down with
    /// the barrier (`pwritev` + `fdatasync`); without, it is queued and
    /// written outside the lock (see `crate::sealed`).
    pub(crate) fn seal(
        &mut self,
        env: &Env,
        index: &mut Index,
        epoch_end: bool,
        barrier: bool,
    ) -> EngineResult<()> {
        assert!(
            !env.health.is_degraded(),
            "no log record is sealed in degraded mode"
        );
        if barrier {
            self.sealed.complete_all(env)?;
        }
        let open = match self.open.take() {
            Some(open) => open,
            None if !epoch_end => return Ok(()),
            None => self.empty_record(env, index),
        };
        let header = RecordHeader {
            sequence: self.next_sequence,
            log_offset: open.start(),
            generation: self.generation,
            durable_sequence: self.durable_sequence,
            prev_crc: self.prev_crc,
            format_tag: env.format_tag,
            flags: if epoch_end { RECORD_FLAG_EPOCH_END } else { 0 },
            entries: open.entries().to_vec(),
        };
        let (encoded, header_crc) = header.encode(env.block_size_bytes as u32);
        // Aligned like the data, so the record goes down without a copy.
        let mut header_buf = env.header_bufs.lend(encoded.len());
        header_buf.extend_from_slice(&encoded);
        let at = env.slot_offset_bytes(self.phys(open.start()));
        let length = header.length_blocks();
        assert!(
            self.phys(open.start()) as u64 + length <= self.slot_count,
            "record wraps"
        );
        open.debug_check(env.block_size_bytes);
        if barrier {
            // The open record holds acknowledged writes and nothing else
            // does: a barrier that fails, or unwinds from a panic (the NBD
            // server answers EIO and goes on), leaves it open, so reads
            // and degraded mode's drain still find its blocks.
            let written = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.write_with_barrier(env, at, &header_buf, open.data())
            }));
            match written {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    self.open = Some(open);
                    return Err(env.health.cache_write_failed("sealing a log record", e));
                }
                Err(panic) => {
                    self.open = Some(open);
                    std::panic::resume_unwind(panic);
                }
            }
        }
        Counters::add(&env.counters.records_sealed, 1);
        if epoch_end {
            Counters::add(&env.counters.epochs_sealed, 1);
        }
        Counters::add(
            &env.counters.cache_bytes_written,
            length * env.block_size_bytes as u64,
        );
        let start = open.start();
        let sequence = self.next_sequence;
        self.prev_crc = header_crc;
        self.next_sequence += 1;
        env.record_io.note_sealed(sequence);
        self.head = start + length;
        self.unsynced.push(sequence, self.head, length, epoch_end);
        self.epoch_open = !epoch_end;
        if barrier {
            Counters::add(&env.counters.cache_barriers, 1);
            self.barrier_done(sequence);
            return Ok(());
        }
        let (_, data) = open.into_parts();
        let record = SealedRecord::new(env, start, at, header, header_buf, data);
        self.sealed.push(env, record)
    }

    /// An empty record at the head, to end an epoch with nothing open.
    fn empty_record(&mut self, env: &Env, index: &mut Index) -> OpenRecord {
        let start = record_start(self.head, self.slot_count);
        if start + 1 > self.limit() {
            // Only right after recovery: the tail restarts at the
            // checkpoint's, behind clean data it may now evict.
            let target = start + 1 - self.slot_count;
            let _ = self.evict_until(env, index, target, VolumeSet::EMPTY);
        }
        assert!(start < self.limit(), "no room for an epoch-end record");
        self.head = start;
        OpenRecord::new(start, 0, env.record_bufs.lend(0))
    }

    /// The record and its barrier, in the calling thread. A barrier that
    /// fails may also have lost the records sealed since the last one (a
    /// failed fsync drops dirty pages); retrying this write cannot bring
    /// them back, so that case is not retried.
    fn write_with_barrier(
        &self,
        env: &Env,
        at: u64,
        header: &[u8],
        data: &[u8],
    ) -> Result<(), cairn_device::DeviceError> {
        let bufs: &[&[u8]] = if data.is_empty() {
            &[header]
        } else {
            &[header, data]
        };
        let retry_safe = self.unsynced.is_empty();
        // Watched like a lane barrier's sync (see `crate::sync_watch`).
        env.syncs.vouching(env.cache.name(), || {
            retrying_cache_write(env, "sealing a log record", retry_safe, || {
                env.cache.write_vectored_and_flush(at, bufs)
            })
        })
    }

    /// Seal and make durable everything acknowledged so far; ends an epoch.
    /// Costs nothing when there is nothing new.
    pub(crate) fn flush(&mut self, env: &Env, index: &mut Index) -> EngineResult<()> {
        if !self.has_unflushed() {
            return Ok(());
        }
        self.seal(env, index, true, true)?;
        self.writeback_limit = self.head;
        Ok(())
    }

    /// Seal whatever is open (clean fills included) with a barrier, so the
    /// log holds everything the index maps: before a checkpoint.
    pub(crate) fn seal_everything(&mut self, env: &Env, index: &mut Index) -> EngineResult<()> {
        self.flush(env, index)?;
        if self.open.is_some() {
            self.seal(env, index, true, true)?;
            self.writeback_limit = self.head;
        }
        assert!(self.open.is_none());
        assert!(self.unsynced.is_empty(), "a checkpoint follows a barrier");
        Ok(())
    }

    /// A client flush or FUA write, with group commit: seal what is open as
    /// an epoch end, without a barrier, and return the sequence a barrier
    /// must make durable before the flush may be answered (`None`: every
    /// sealed record is durable already and nothing new is open). The
    /// barrier is made outside the engine lock ([`Log::barrier_plan`]).
    pub(crate) fn seal_for_flush(
        &mut self,
        env: &Env,
        index: &mut Index,
    ) -> EngineResult<Option<u64>> {
        let open_dirty = self.open.as_ref().is_some_and(OpenRecord::has_dirty);
        if open_dirty || self.epoch_open {
            self.seal(env, index, true, false)?;
        }
        if self.unsynced.is_empty() {
            return Ok(None);
        }
        Ok(Some(self.last_sequence()))
    }

    /// Start a barrier over everything sealed so far: the records nobody
    /// is writing yet (the caller writes them) and those another call is
    /// writing (the caller waits for them), then one fdatasync.
    pub(crate) fn barrier_plan(&mut self) -> BarrierPlan {
        // Those claimed by others first: the caller's own are not waited for.
        let in_flight = self.sealed.in_flight();
        BarrierPlan {
            target: self.last_sequence(),
            to_write: self.sealed.claim(),
            in_flight,
            unsynced_blocks: self.unsynced.blocks(),
        }
    }

    /// A barrier made every record up to `sequence` durable (barriers may
    /// complete out of order: the newest wins).
    pub(crate) fn barrier_done(&mut self, sequence: u64) {
        if sequence <= self.durable_sequence {
            return;
        }
        self.durable_sequence = sequence;
        if let Some(end) = self.unsynced.durable_through(sequence) {
            self.writeback_limit = self.writeback_limit.max(end);
        }
    }

    /// Drop the records written since from the queue of records in flight
    /// (their blocks are read from the device from now on).
    pub(crate) fn prune_sealed(&mut self, env: &Env) -> EngineResult<()> {
        self.sealed.prune(env)
    }

    /// Take on the records sealed because they were full (not the epoch
    /// ends a flush sealed for its barrier), to be written by the caller
    /// outside the lock.
    pub(crate) fn claim_filled(&mut self) -> Vec<Arc<SealedRecord>> {
        self.sealed.claim_filled()
    }

    // ------------------------------------------------------------ eviction

    /// Move the tail towards `target` (never past the persisted write-back
    /// position), retiring the clean blocks it passes. Clean blocks hit
    /// since they were inserted (second chance), and those of the
    /// `protected` volumes, are read and returned (with `true` for the
    /// latter) so the caller can move them to the head; the tail goes
    /// further for each protected block, so they have room there.
    /// Hit blocks beyond `SECOND_CHANCE_MAX_BLOCKS` are evicted; at the
    /// `SHARE_RESCUE_MAX_BLOCKS`th protected one the tail stops in front
    /// of the next, short of `target`, and says so (`true`).
    pub(crate) fn evict_until(
        &mut self,
        env: &Env,
        index: &mut Index,
        target: u64,
        protected: VolumeSet,
    ) -> (Vec<(u64, Vec<u8>, bool)>, bool) {
        let mut picks = Vec::new();
        let mut stopped_at_cap = false;
        let (mut hit_rescues, mut share_rescues) = (0usize, 0usize);
        // Room at the head for the protected blocks: theirs, their record
        // headers and a lap skip (second-chance blocks use the caller's
        // margin).
        let share_room = |n: usize| match n as u64 {
            0 => 0,
            n => n + n.div_ceil(env.record_data_blocks_max) + 3,
        };
        while self.tail < target + share_room(share_rescues) && self.tail < self.writeback_persisted
        {
            let slot = self.phys(self.tail);
            if index.is_live(slot) {
                assert!(!index.is_dirty(slot), "tail passed dirty data");
                let lba = index.lba(slot);
                let movable = !index.is_corrupt(slot) && env.origins.takes_new_data(lba);
                let hit =
                    movable && index.is_referenced(slot) && hit_rescues < SECOND_CHANCE_MAX_BLOCKS;
                let shared = !hit && movable && protected.contains(key_volume(lba));
                if shared && share_rescues == SHARE_RESCUE_MAX_BLOCKS {
                    // Stop in front of it rather than evict it: the caller
                    // moves this batch to the head and comes back.
                    stopped_at_cap = true;
                    break;
                }
                if hit || shared {
                    picks.push(RescuePick {
                        slot,
                        lba,
                        crc: index.crc(slot),
                        for_share: !hit,
                    });
                    if hit {
                        hit_rescues += 1;
                    } else {
                        share_rescues += 1;
                    }
                }
                if index.is_corrupt(slot) {
                    // Dirty data that failed its checksum is leaving the
                    // log: remember it reads as EIO, never as stale data.
                    index.mark_lost(lba);
                }
                index.retire(slot);
                Counters::add(&env.counters.evictions, 1);
            }
            index.clear(slot);
            self.tail += 1;
        }
        assert!(picks.len() <= SECOND_CHANCE_MAX_BLOCKS + SHARE_RESCUE_MAX_BLOCKS);
        (RescuePick::read_all(env, &picks), stopped_at_cap)
    }

    // ----------------------------------------------------------- progress

    /// Write-back copied the group ending at `position` to the origins
    /// of `volumes`.
    pub(crate) fn written_back_to(&mut self, volumes: VolumeSet, position: u64) {
        // Past the limit only when degrading: the unflushed records go to
        // the origin too, from memory.
        assert!(position <= self.head, "write-back past the head");
        for id in volumes.iter() {
            self.writeback.advance(id, position);
        }
    }

    /// A volume was added: nothing of it is in the log before the last
    /// durable epoch end, where its write-back starts (a record boundary,
    /// and past every record of a removed volume that had its id).
    pub(crate) fn add_volume(&mut self, id: u16) -> u64 {
        let at = self.writeback_limit;
        self.writeback.insert(id, at);
        at
    }

    /// A volume was removed (or its addition failed).
    pub(crate) fn remove_volume(&mut self, id: u16) {
        self.writeback.remove(id);
    }

    /// The superblock now records every volume's write-back position.
    pub(crate) fn writeback_position_persisted(&mut self) {
        self.writeback_persisted = self.writeback.least();
    }

    /// A checkpoint of the index as of the head is durable.
    pub(crate) fn checkpointed(&mut self) {
        self.checkpoint_head = self.head;
    }

    /// Open bumped the generation and made everything replayed durable.
    pub(crate) fn recovered(&mut self, generation: u64) {
        self.generation = generation;
        self.durable_sequence = self.next_sequence - 1;
    }

    // ----------------------------------------------------------- degraded

    /// For degraded mode: wait for the record writes in flight; then where
    /// the records kept in memory start (the log before it is on the
    /// device), if any. Changes nothing.
    pub(crate) fn settle_unflushed(&self, env: &Env) -> Option<u64> {
        self.sealed.settle(env)
    }

    /// For degraded mode, after [`Log::settle_unflushed`]: the records kept
    /// in memory (written or not) and the open record.
    pub(crate) fn take_unflushed(&mut self) -> (Vec<Arc<SealedRecord>>, Option<OpenRecord>) {
        (self.sealed.take_all(), self.open.take())
    }

    /// Degraded mode wrote everything back: nothing is dirty any more, and
    /// the log never moves again.
    pub(crate) fn drained(&mut self) {
        self.writeback.raise_all(self.head);
        self.writeback_limit = self.head;
        self.writeback_persisted = self.head;
        self.epoch_open = false;
        self.unsynced.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::record_start;

    /// The on-disk rule that writing and replay share: a record starts
    /// where the previous one ended, unless its header and one more slot
    /// do not fit before the end of the lap; then it starts the next lap.
    /// A log written by one rule and replayed by another loses the record
    /// two slots before a lap end and all after it (a cargo-mutants
    /// survivor: `>` to `>=`, which both sides shared, so no engine test
    /// saw it).
    #[test]
    fn a_record_starts_the_next_lap_only_when_two_slots_do_not_fit() {
        let n = 100;
        assert_eq!(record_start(0, n), 0);
        assert_eq!(record_start(97, n), 97);
        assert_eq!(
            record_start(98, n),
            98,
            "a header and one data slot fit before the lap end"
        );
        assert_eq!(record_start(99, n), 100, "one slot left: the next lap");
        assert_eq!(record_start(100, n), 100);
        assert_eq!(record_start(298, n), 298);
        assert_eq!(record_start(299, n), 300);
    }
}
