//! The write path: full blocks go into the open record, partial blocks
//! are read-modify-written, zero/discard become logged ranges; space is
//! reserved first (writers wait for write-back, never fail); modes other
//! than write-back write through before acknowledging.

use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use cairn_format::{block_checksum, RangeKind, RecordEntry, PENDING_RANGES_MAX};

use crate::engine::*;
use crate::error::{EngineError, EngineResult};
use crate::index::state;
use crate::policy::CacheMode;
use crate::stats::Counters;

/// A checkpoint is taken once this fraction of the log (1/N) was written
/// since the last one.
const CHECKPOINT_EVERY_LOG_FRACTION: u64 = 4;

impl Engine {
    // ---------------------------------------------------------------- writes

    /// Write `data` at `offset`. With `fua`, the data is durable on return.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> EngineResult<()> {
        self.check_range(offset, data.len() as u64)?;
        let c = &self.env.counters;
        Counters::add(&c.writes, 1);
        Counters::add(&c.write_bytes, data.len() as u64);
        if fua {
            Counters::add(&c.fua_writes, 1);
        }
        self.with_degrade(|degraded| {
            if degraded {
                self.degraded_write(offset, data)
            } else {
                self.write_cached(offset, data, fua)
            }
        })
    }

    /// The normal write path: into the log (then through to the origin in
    /// the modes other than write-back).
    fn write_cached(&self, offset: u64, data: &[u8], fua: bool) -> EngineResult<()> {
        let c = &self.env.counters;
        let bs = self.env.bs as u64;
        let mut at = offset;
        let end = offset + data.len() as u64;
        let chunk_blocks = (self.env.layout.log_blocks / 8).max(1);
        let mut inner = self.lock()?;
        while at < end {
            let first = at / bs;
            let chunk_end = ((first + chunk_blocks) * bs).min(end);
            let blocks = (chunk_end - first * bs).div_ceil(bs);
            inner = self.reserve(inner, blocks, 0)?;
            inner.mutations += 1;
            while at < chunk_end {
                let lba = at / bs;
                let within = (at % bs) as usize;
                let n = (bs as usize - within).min((chunk_end - at) as usize);
                let src = &data[(at - offset) as usize..(at - offset) as usize + n];
                if within == 0 && n == bs as usize {
                    inner.append_data(&self.env, lba, src, false)?;
                } else {
                    Counters::add(&c.write_rmw, 1);
                    inner.write_partial(&self.env, lba, within, src)?;
                }
                at += n as u64;
            }
        }
        if fua {
            inner.flush(&self.env)?;
        }
        // Records this write filled are written outside the lock, so other
        // writers keep going and several records are in flight at once.
        let sealed = inner.claim_sealed();
        drop(inner);
        self.write_claimed(sealed)?;
        let mode = self.mode();
        if mode != CacheMode::WriteBack {
            let first = offset / bs;
            let end_block = end.div_ceil(bs);
            self.write_through(mode, first, end_block)?;
        }
        Ok(())
    }

    /// The modes other than write-back acknowledge a write only once the
    /// origin has it: the write goes through the log as usual (so ordering
    /// and crash safety are the same), is made durable, and is written back
    /// before the reply. Write-around and pass-through then drop the new
    /// cached copy.
    pub(crate) fn write_through(&self, mode: CacheMode, first: u64, end: u64) -> EngineResult<()> {
        Counters::add(&self.env.counters.writethrough_waits, 1);
        self.flush_internal()?;
        // The write is sealed before the last durable epoch end now.
        let target = self.lock()?.wb_limit;
        for _ in 0..=self.env.layout.log_blocks {
            if self.lock()?.wb >= target {
                break;
            }
            self.writeback_group()?;
        }
        let mut inner = self.lock()?;
        assert!(inner.wb >= target, "write-through did not reach the origin");
        if !mode.keeps_written_copy() && end - first <= 65536 {
            for lba in first..end {
                if let Some(slot) = inner.map.get(lba, &inner.slots) {
                    if !inner.slot_is_dirty(slot) {
                        inner.retire_slot(slot);
                    }
                }
            }
        }
        Ok(())
    }

    /// A flush the engine needs for itself (not counted as a client flush).
    pub(crate) fn flush_internal(&self) -> EngineResult<()> {
        let mut inner = self.lock()?;
        inner.flush(&self.env)
    }

    pub fn mode(&self) -> CacheMode {
        CacheMode::from_code(self.mode.load(Ordering::Relaxed)).unwrap_or(CacheMode::WriteBack)
    }

    /// Switch the cache mode online. New writes follow the new mode at
    /// once; leaving write-back drains the dirty data first (with progress).
    /// The mode is persisted in the superblock.
    pub fn set_mode(
        &self,
        mode: CacheMode,
        mut progress: impl FnMut(&WritebackProgress),
    ) -> EngineResult<WritebackProgress> {
        self.with_degrade(|degraded| {
            if degraded {
                return Err(EngineError::CacheDegraded {
                    device: self.env.cache.name().to_string(),
                    action: format!("switching to mode {}", mode.name()),
                });
            }
            self.set_mode_cached(mode, &mut progress)
        })
    }

    fn set_mode_cached(
        &self,
        mode: CacheMode,
        progress: &mut impl FnMut(&WritebackProgress),
    ) -> EngineResult<WritebackProgress> {
        // A mode change is a management action: everything acknowledged
        // before it is made durable first, whatever the new mode.
        self.flush_internal()?;
        self.mode.store(mode.code(), Ordering::SeqCst);
        {
            let mut inner = self.lock()?;
            inner.sb.mode = mode.code();
            inner.write_superblock(&self.env)?;
        }
        if mode == CacheMode::WriteBack {
            return Ok(WritebackProgress {
                dirty_blocks: self.lock()?.dirty_blocks,
                ..Default::default()
            });
        }
        self.drain_cached(progress)
    }

    /// Make every write acknowledged so far durable. Costs one cache barrier
    /// when there is something to persist, none otherwise.
    pub fn flush(&self) -> EngineResult<()> {
        Counters::add(&self.env.counters.flushes, 1);
        self.with_degrade(|degraded| {
            if degraded {
                self.degraded_flush()
            } else {
                self.flush_internal()
            }
        })
    }

    /// Zero a range. Whole blocks become a logged zero range (no data is
    /// written); partial blocks at the edges are zeroed by read-modify-write.
    pub fn write_zeroes(&self, offset: u64, length_bytes: u64) -> EngineResult<()> {
        Counters::add(&self.env.counters.write_zeroes, 1);
        self.zero_range(offset, length_bytes, RangeKind::Zero)
    }

    /// Discard a range: cached copies are dropped and the origin is sent a
    /// discard, in order. Whole blocks read back as zeroes afterwards;
    /// partial blocks at the edges are left alone (discard is a hint).
    pub fn discard(&self, offset: u64, length_bytes: u64) -> EngineResult<()> {
        Counters::add(&self.env.counters.discards, 1);
        self.zero_range(offset, length_bytes, RangeKind::Discard)
    }

    pub(crate) fn zero_range(
        &self,
        offset: u64,
        length_bytes: u64,
        kind: RangeKind,
    ) -> EngineResult<()> {
        self.check_range(offset, length_bytes)?;
        if length_bytes == 0 {
            return Ok(());
        }
        self.with_degrade(|degraded| {
            if degraded {
                self.degraded_zero_range(offset, length_bytes, kind)
            } else {
                self.zero_range_cached(offset, length_bytes, kind)
            }
        })
    }

    fn zero_range_cached(
        &self,
        offset: u64,
        length_bytes: u64,
        kind: RangeKind,
    ) -> EngineResult<()> {
        let bs = self.env.bs as u64;
        let end = offset + length_bytes;
        let first_full = offset.div_ceil(bs);
        let end_full = end / bs;
        let mut inner = self.lock()?;
        inner.mutations += 1;
        if kind == RangeKind::Zero {
            // Partially covered blocks at either edge are zeroed in place.
            let zeroes = vec![0u8; bs as usize];
            let first = offset / bs;
            let last = (end - 1) / bs;
            let mut edges = Vec::new();
            for lba in [first, last] {
                let block_start = lba * bs;
                let lo = offset.max(block_start);
                let hi = end.min(block_start + bs);
                let partial = hi - lo < bs;
                if partial && !edges.iter().any(|&(l, _, _)| l == lba) {
                    edges.push((lba, (lo - block_start) as usize, (hi - lo) as usize));
                }
            }
            for (lba, within, n) in edges {
                inner = self.reserve(inner, 1, 0)?;
                inner.write_partial(&self.env, lba, within, &zeroes[..n])?;
            }
        }
        if first_full < end_full {
            let mut lba = first_full;
            while lba < end_full {
                let count = (end_full - lba).min(u32::MAX as u64);
                inner = self.reserve(inner, 0, 2)?;
                inner.append_range(&self.env, kind, lba, count)?;
                lba += count;
            }
        }
        drop(inner);
        let mode = self.mode();
        if mode != CacheMode::WriteBack {
            self.write_through(mode, offset / bs, end.div_ceil(bs))?;
        }
        Ok(())
    }

    /// Make room for `blocks` data blocks and `ranges` range entries,
    /// running write-back if the log is full of dirty data. Writers wait;
    /// they never fail for lack of space and nothing is dropped.
    fn reserve<'a>(
        &'a self,
        mut inner: MutexGuard<'a, Inner>,
        blocks: u64,
        ranges: usize,
    ) -> EngineResult<MutexGuard<'a, Inner>> {
        if inner.unsynced_blocks >= self.env.config.unsynced_blocks_max {
            Counters::add(&self.env.counters.internal_flushes, 1);
            inner.flush(&self.env)?;
        }
        // Bound recovery: replay never covers more than a quarter of the log.
        if inner.head - inner.ckpt_head > inner.n / CHECKPOINT_EVERY_LOG_FRACTION {
            inner.checkpoint(&self.env)?;
        }
        for _ in 0..SPACE_RETRIES_MAX {
            let need_ranges = inner.ranges.len() + ranges > PENDING_RANGES_MAX;
            match inner.ensure_space(&self.env, blocks)? {
                Space::Ready if !need_ranges => return Ok(inner),
                _ => {
                    Counters::add(&self.env.counters.writeback_stalls, 1);
                    if inner.wb == inner.wb_limit {
                        // No complete epoch to write back: end one now.
                        Counters::add(&self.env.counters.internal_flushes, 1);
                        inner.flush(&self.env)?;
                    }
                    drop(inner);
                    self.writeback_group()?;
                    inner = self.lock()?;
                }
            }
        }
        Err(EngineError::Failed(
            "no log space could be reclaimed after many write-back rounds".into(),
        ))
    }
}

impl Inner {
    /// Bring the open record into existence with room for one more data
    /// block (or entry), sealing the current one when it is full.
    pub(crate) fn open_record(&mut self, env: &Env, need_data: bool) -> EngineResult<()> {
        if let Some(open) = &self.open {
            let full_entries = open.entries.len() >= env.entries_max;
            let full_data = need_data && open.data_count() >= open.capacity_data;
            if !full_entries && !full_data {
                return Ok(());
            }
            self.seal(env, false)?;
        }
        let mut start = self.head;
        // A record never wraps: it needs its header and one data block
        // before the end of the lap, else it starts the next lap.
        if self.phys(start) as u64 + 2 > self.n {
            start = start.div_ceil(self.n) * self.n;
        }
        assert!(start < self.limit(), "open_record without reserved space");
        let capacity_data = env
            .record_data_max
            .min(self.n - self.phys(start) as u64 - 1);
        assert!(capacity_data >= 1);
        // Skipped slots at the end of a lap and the header slot hold nothing.
        for logical in self.head..=start {
            let slot = self.phys(logical);
            assert!(!self.slots.is_live(slot), "free slot {slot} is live");
        }
        self.head = start;
        self.open = Some(OpenRecord {
            start,
            entries: Vec::new(),
            data_entry: Vec::new(),
            data: env.record_bufs.lend(capacity_data as usize * env.bs),
            capacity_data,
            has_dirty: false,
        });
        Ok(())
    }

    /// Add a full block to the open record (or overwrite it in place if the
    /// open record already holds this address).
    pub fn append_data(
        &mut self,
        env: &Env,
        lba: u64,
        block: &[u8],
        clean: bool,
    ) -> EngineResult<()> {
        let bs = env.bs;
        assert_eq!(block.len(), bs);
        assert!(lba < env.volume_blocks);
        let crc = block_checksum(lba, block);
        self.lost.remove(&lba);
        let existing = self.map.get(lba, &self.slots);
        if !clean {
            Counters::add(&env.counters.write_bytes, 0);
            if existing.is_some() {
                Counters::add(&env.counters.write_hits, 1);
            }
        }
        if let Some(slot) = existing {
            if let Some(k) = self.open_slot_index(slot) {
                assert!(!clean, "clean fills only go to unmapped blocks");
                let was_clean = self.slots.state(slot) & state::CLEAN_INSERT != 0;
                let open = self.open.as_mut().expect("open record");
                open.data[k * bs..(k + 1) * bs].copy_from_slice(block);
                let ei = open.data_entry[k] as usize;
                open.entries[ei] = RecordEntry::Data {
                    lba,
                    crc,
                    clean: false,
                };
                open.has_dirty = true;
                self.slots.set(slot, lba, crc, state::LIVE);
                if was_clean {
                    self.clean_blocks -= 1;
                    self.dirty_blocks += 1;
                }
                return Ok(());
            }
        }
        self.open_record(env, true)?;
        let open = self.open.as_ref().expect("open record");
        let logical = open.start + 1 + open.data_count();
        assert!(logical < self.limit(), "append without reserved space");
        let slot = self.phys(logical);
        assert!(!self.slots.is_live(slot), "append into live slot {slot}");
        if let Some(old) = existing {
            self.retire_slot(old);
        }
        let st = if clean {
            state::LIVE | state::CLEAN_INSERT
        } else {
            state::LIVE
        };
        self.slots.set(slot, lba, crc, st);
        let replaced = self.map.insert(lba, slot, &self.slots);
        assert!(replaced.is_none(), "old mapping was retired first");
        let open = self.open.as_mut().expect("open record");
        open.data_entry.push(open.entries.len() as u16);
        open.entries.push(RecordEntry::Data { lba, crc, clean });
        open.data.extend_from_slice(block);
        if clean {
            self.clean_blocks += 1;
        } else {
            open.has_dirty = true;
            self.dirty_blocks += 1;
        }
        Ok(())
    }

    pub(crate) fn append_range(
        &mut self,
        env: &Env,
        kind: RangeKind,
        lba: u64,
        count: u64,
    ) -> EngineResult<()> {
        assert!(count > 0 && count <= u32::MAX as u64);
        let end = lba + count;
        // Drop cached copies inside the range.
        if count <= 65536 {
            for l in lba..end {
                if let Some(slot) = self.map.get(l, &self.slots) {
                    self.retire_range_slot(env, slot)?;
                }
                self.lost.remove(&l);
            }
        } else {
            for slot in 0..self.n as u32 {
                let l = self.slots.lba(slot);
                if self.slots.is_live(slot) && l >= lba && l < end {
                    self.retire_range_slot(env, slot)?;
                }
            }
            let gone: Vec<u64> = self.lost.range(lba..end).copied().collect();
            for l in gone {
                self.lost.remove(&l);
            }
        }
        self.open_record(env, false)?;
        let open = self.open.as_mut().expect("open record");
        open.entries.push(RecordEntry::Range {
            kind,
            lba,
            block_count: count as u32,
        });
        open.has_dirty = true;
        let start = open.start;
        self.ranges.insert(lba, end, start, kind);
        Ok(())
    }

    /// A slot inside a zeroed range. If it sits in the open record, its data
    /// entry stays (the range entry after it wins at replay and write-back).
    pub(crate) fn retire_range_slot(&mut self, _env: &Env, slot: u32) -> EngineResult<()> {
        self.retire_slot(slot);
        Ok(())
    }

    /// Read-modify-write of part of one block.
    pub(crate) fn write_partial(
        &mut self,
        env: &Env,
        lba: u64,
        within: usize,
        src: &[u8],
    ) -> EngineResult<()> {
        let bs = env.bs;
        let mut block = vec![0u8; bs];
        match self.plan_read(env, lba, &mut block)? {
            Plan::Done => {}
            Plan::Cache { slot, crc } => {
                let ok = env
                    .cache
                    .read_at(env.layout.slot_offset_bytes(slot as u64), &mut block)
                    .is_ok()
                    && block_checksum(lba, &block) == crc;
                if !ok {
                    Counters::add(&env.counters.checksum_mismatches, 1);
                    if self.slot_is_dirty(slot) {
                        self.mark_corrupt(slot);
                        return Err(EngineError::DirtyBlockCorrupt { lba });
                    }
                    env.read_origin(lba, &mut block)?;
                    let tag = self.tags.as_ref().map(|t| t.get(lba));
                    crate::integrity::check_origin_data(env, lba, &block, tag)?;
                    Counters::add(&env.counters.repairs, 1);
                }
            }
            Plan::Miss { tag } => {
                env.read_origin(lba, &mut block)?;
                // The engine lock is held, so the tag is current: a mismatch
                // is real, and merging into bad data would bless it.
                crate::integrity::check_origin_data(env, lba, &block, tag)?;
            }
        }
        block[within..within + src.len()].copy_from_slice(src);
        self.append_data(env, lba, &block, false)
    }
}
