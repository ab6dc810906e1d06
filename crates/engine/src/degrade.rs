//! Degraded mode: what the engine does when the cache device stops taking
//! writes.
//!
//! A cache write that fails is first retried (`log::retrying_cache_write`,
//! and whole checkpoints). When it fails for good, `Inner::fail` marks a
//! degrade as pending and nothing more is written to the log. The next
//! request (any thread) runs [`Engine::degrade`]:
//!
//! 1. every complete epoch group not yet written back (data durable in the
//!    log) is read from the cache, verified and copied to the origin, each
//!    followed by an origin flush: ordinary ordered write-back;
//! 2. the records sealed after the last epoch end are read back (verified);
//! 3. the superblock is written with the DEGRADED flag, to both copies,
//!    each with a barrier;
//! 4. those records and then the open record (acknowledged writes that
//!    were never flushed, or never reached the cache at all) go to the
//!    origin as one group with one flush, and the open record's slots leave
//!    the index.
//!
//! Only then does any request go straight to the origin. Nothing that is
//! not durable in the log reaches the origin before the DEGRADED flag is
//! durable, so a restart either replays a log that is at least as new as
//! the origin (flag not durable) or never replays it again (flag durable):
//! no record older than the origin's copy can be replayed over it. If a
//! step fails the engine stops (every request fails) and nothing is written
//! through. Once the flag is durable, open never replays or reads the cache
//! again (see `Engine::open`).
//!
//! Degraded writes, zeroes and discards drop the cached copy of every block
//! they change, then write the origin and flush it before the reply. Reads
//! still use clean cached copies of blocks not written since (they are
//! verified like every cache read, and the cache is never written again, so
//! a slot can never change under its mapping); everything else is read from
//! the origin. See `docs/design.md`.

use std::sync::atomic::Ordering;

use cairn_format::{RangeKind, RecordHeader, FEATURE_DEGRADED};

use crate::engine::*;
use crate::error::{EngineError, EngineResult};
use crate::index::{state, ForwardMap, SlotTable};
use crate::ranges::RangeMap;
use crate::recovery::place;
use crate::stats::Counters;
use crate::writeback::{apply_group, read_group, record_data_copy};

impl Engine {
    /// Is the engine in degraded mode (the cache device is no longer used
    /// for writes)?
    pub fn is_degraded(&self) -> bool {
        self.degraded.load(Ordering::SeqCst)
    }

    /// Run a request on the path for the engine's state: `op(false)` on the
    /// normal path, `op(true)` on the degraded one. If the normal path
    /// fails because a cache write failed for good (here or on another
    /// thread), switch to degraded mode and run the request again, degraded.
    /// Every request wrapped this way is idempotent: re-running it writes
    /// the same bytes again.
    pub(crate) fn with_degrade<T>(
        &self,
        mut op: impl FnMut(bool) -> EngineResult<T>,
    ) -> EngineResult<T> {
        let degraded = self.is_degraded();
        match op(degraded) {
            Err(e) if !degraded => {
                if self.degrade_if_wanted()? {
                    tracing::debug!("re-running a request on the degraded path after: {e}");
                    op(true)
                } else {
                    Err(e)
                }
            }
            result => result,
        }
    }

    /// Switch to degraded mode if a cache write failed for good. Ok(true)
    /// once degraded, Ok(false) if nothing calls for it, an error if the
    /// engine is (or just got) stopped.
    fn degrade_if_wanted(&self) -> EngineResult<bool> {
        {
            let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(reason) = &inner.failed {
                return Err(EngineError::Failed(reason.clone()));
            }
            if inner.degrade_pending.is_none() && !inner.degraded {
                return Ok(false);
            }
        }
        self.degrade()?;
        Ok(true)
    }

    /// Enter degraded mode (see the module comment). Serialised with
    /// write-back; the index is locked for the whole drain, so requests
    /// wait for it. Idempotent: a second caller finds it done.
    pub(crate) fn degrade(&self) -> EngineResult<()> {
        let _writeback = self
            .writeback_lock
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reason) = &inner.failed {
            return Err(EngineError::Failed(reason.clone()));
        }
        if inner.degraded {
            assert!(self.is_degraded());
            return Ok(());
        }
        let reason = inner
            .degrade_pending
            .clone()
            .expect("degrade runs only after a cache write failed for good");
        tracing::error!(
            dirty_blocks = inner.dirty_blocks,
            "cache device write failed ({reason}): writing every dirty block back to the origin before going degraded"
        );
        match self.drain_and_mark_degraded(&mut inner) {
            Ok(drained_blocks) => {
                inner.degrade_pending = None;
                inner.degraded = true;
                self.degraded.store(true, Ordering::SeqCst);
                Counters::add(&self.env.counters.degrade_drained_blocks, drained_blocks);
                tracing::error!(
                    drained_blocks,
                    "cache {} is DEGRADED: every dirty block is on the origin and the DEGRADED flag is durable. From now on every write goes straight to the origin and is acknowledged once durable there; unchanged clean blocks are still read from the cache. Fix or replace the cache device, then stop cairn and run `cairn format --force` on it to cache again",
                    self.env.cache.name()
                );
                Ok(())
            }
            Err(e) => {
                let stopped = format!(
                    "{reason}; then entering degraded mode failed ({e}), so nothing was written through to the origin"
                );
                tracing::error!(
                    "cache device failed and degraded mode could not be entered: {e}. The engine is stopped: every request fails until restart. The cache and the origin are as the ordinary write-back left them; a restart recovers from the log"
                );
                inner.failed = Some(stopped.clone());
                Err(EngineError::Failed(stopped))
            }
        }
    }

    /// Steps 1 to 3 of the module comment. Returns the blocks written back.
    fn drain_and_mark_degraded(&self, inner: &mut Inner) -> EngineResult<u64> {
        let env = &self.env;
        let n = inner.n;
        // The open record, if any, starts at `head`: every sealed record
        // lies before it.
        let end = inner.head;
        if let Some(open) = &inner.open {
            assert_eq!(open.start, end, "the open record starts at the head");
        }
        let mut drained_blocks = 0u64;
        // 1. Complete epoch groups (up to the last durable epoch end), as
        //    write-back does: only data that is durable in the log reaches
        //    the origin, and the origin stays the volume as of a flush.
        for _ in 0..=n {
            if inner.wb >= inner.wb_limit {
                break;
            }
            let start = inner.wb;
            let (records, pos) = read_group(env, start, inner.wb_limit, n)?;
            let applied = apply_group(env, &records)?;
            inner.commit_group(env, start, pos, &records, &applied);
            drained_blocks += applied.blocks_written;
        }
        assert_eq!(
            inner.wb, inner.wb_limit,
            "every complete epoch is on the origin"
        );
        // 2. The rest was acknowledged but never flushed: records sealed
        //    after the last epoch end, then the open record (the current
        //    request's writes may be among them; it is re-run after the
        //    switch). Read it all now, in log order, before anything else
        //    changes: if the log cannot be read, stop here. The records
        //    still queued in memory (their write failed, never started, or
        //    completed behind one that had not: see `inflight.rs`) are the
        //    end of the log up to the open record; they are taken from
        //    memory, not read back.
        let queued = inner.take_sealed(env);
        let cache_end = queued.first().map_or(end, |r| r.start);
        let start = inner.wb;
        let mut tail = Vec::new();
        let mut pos = start;
        for _ in 0..=n {
            if place(pos, n) >= cache_end {
                break;
            }
            let (mut more, next) = read_group(env, pos, cache_end, n)?;
            tail.append(&mut more);
            pos = next;
        }
        assert!(
            place(pos, n) >= cache_end,
            "degrade read every sealed record"
        );
        let sealed = tail.len();
        for (i, record) in queued.iter().enumerate() {
            let next_start = queued.get(i + 1).map_or(end, |r| r.start);
            assert!(record.start < next_start, "queued records are in log order");
            tail.push((
                record.start,
                record.header_fields.clone(),
                record_data_copy(env, &record.data),
            ));
        }
        // 3. DEGRADED, durable in both superblock copies, BEFORE any
        //    unflushed data reaches the origin. Were it the other way
        //    round, a crash in between would replay the log over an origin
        //    newer than it: reads would serve the log's older copy of a
        //    block, and later (once evicted) the origin's newer one. From
        //    here on a restart never replays the log, whichever copy
        //    survives; it serves the origin, which holds at least every
        //    flushed write (step 1).
        inner.sb.features |= FEATURE_DEGRADED;
        inner.sb.writeback_offset = inner.wb;
        for _ in 0..2 {
            inner
                .write_superblock_io(env, true)
                .map_err(EngineError::Cache)?;
        }
        inner.wb_persisted = inner.wb;
        // 4. The unflushed rest, as one group with one origin flush: the
        //    origin goes from the last flushed state straight to the
        //    acknowledged one (plus possibly part of the request in
        //    flight).
        let open = inner.open.take();
        let open_slots = open.as_ref().map(|o| (o.start, o.data_count()));
        if let Some(open) = open {
            let header = RecordHeader {
                sequence: 0,
                log_offset: open.start,
                generation: 0,
                durable_sequence: 0,
                prev_crc: 0,
                format_tag: 0,
                flags: 0,
                entries: open.entries,
            };
            tail.push((open.start, header, record_data_copy(env, &open.data)));
        }
        if !tail.is_empty() {
            let applied = apply_group(env, &tail)?;
            drained_blocks += applied.blocks_written;
            // Data taken from memory (queued records, the open record)
            // matches its checksums.
            let memory_start = queued.first().map_or(end, |r| r.start);
            assert!(
                applied
                    .bad
                    .iter()
                    .all(|&(_, logical)| logical < memory_start),
                "in-memory record data matches its checksums"
            );
            if sealed > 0 {
                inner.commit_group(env, start, pos, &tail[..sealed], &applied);
            }
        }
        // Queued records may not have reached the cache device: their slots
        // leave the index like the open record's (the origin has them now).
        for record in &queued {
            for k in 0..record.data_count {
                let slot = inner.phys(record.start + 1 + k);
                if inner.slots.is_live(slot) {
                    inner.retire_slot(slot);
                }
            }
            inner.ranges.retire_records(record.start, record.start + 1);
        }
        // The open record never reached the cache device: its slots leave
        // the index (the origin has their data now).
        if let Some((open_start, data_count)) = open_slots {
            for k in 0..data_count {
                let slot = inner.phys(open_start + 1 + k);
                if inner.slots.is_live(slot) {
                    inner.retire_slot(slot);
                }
            }
            inner.ranges.retire_records(open_start, open_start + 1);
        }
        assert_eq!(
            inner.ranges.len(),
            0,
            "every zero/discard range is on the origin"
        );
        // Nothing is dirty any more; what stays in the index are clean
        // copies (and corrupt ones, which keep reading as EIO).
        inner.wb = inner.head;
        inner.wb_limit = inner.head;
        inner.wb_persisted = inner.head;
        inner.epoch_open = false;
        inner.unsynced_blocks = 0;
        inner.recount_gauges();
        assert_eq!(inner.dirty_blocks, 0);
        // Integrity tags live on the cache device, which is not written
        // again: they could never be persisted, and a restart ignores the
        // cache. Origin reads are not verified from here on.
        if inner.tags.take().is_some() {
            tracing::error!(
                "integrity tags are dropped with the cache: origin reads are not verified while degraded"
            );
        }
        Ok(drained_blocks)
    }

    /// A degraded write: patch partial blocks at the edges (read from a
    /// verified cached copy or the origin), drop cached copies, write the
    /// origin and flush it. Durable on return.
    pub(crate) fn degraded_write(&self, offset: u64, data: &[u8]) -> EngineResult<()> {
        if data.is_empty() {
            return Ok(());
        }
        let _serial = self
            .degraded_write_lock
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let bs = self.env.bs as u64;
        let end = offset + data.len() as u64;
        let edges = self.patched_edges(offset, end, |lo, hi| {
            &data[(lo - offset) as usize..(hi - offset) as usize]
        })?;
        let full_first = offset.div_ceil(bs);
        let full_end = end / bs;
        let mut writes: Vec<(u64, &[u8])> = edges
            .iter()
            .map(|(lba, b)| (lba * bs, b.as_slice()))
            .collect();
        if full_first < full_end {
            let from = (full_first * bs - offset) as usize;
            let to = (full_end * bs - offset) as usize;
            writes.push((full_first * bs, &data[from..to]));
        }
        self.forget_cached(offset / bs, end.div_ceil(bs))?;
        Counters::add(&self.env.counters.degraded_writes, 1);
        self.env
            .origin
            .write_many_and_flush(&writes)
            .map_err(|e| self.origin_write_error(e))
    }

    /// A degraded zero or discard: whole blocks become an origin zero or
    /// discard, partial edge blocks of a zero are patched and written whole
    /// (a discard leaves them alone), then the origin is flushed.
    pub(crate) fn degraded_zero_range(
        &self,
        offset: u64,
        length_bytes: u64,
        kind: RangeKind,
    ) -> EngineResult<()> {
        let _serial = self
            .degraded_write_lock
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let bs = self.env.bs as u64;
        let end = offset + length_bytes;
        let zeroes = vec![0u8; bs as usize];
        let edges = if kind == RangeKind::Zero {
            self.patched_edges(offset, end, |lo, hi| &zeroes[..(hi - lo) as usize])?
        } else {
            Vec::new()
        };
        let full_first = offset.div_ceil(bs);
        let full_end = end / bs;
        {
            let mut inner = self.lock_index()?;
            inner.mutations += 1;
            for (lba, _) in &edges {
                inner.forget_blocks(*lba, *lba + 1);
            }
            if full_first < full_end {
                inner.forget_blocks(full_first, full_end);
            }
        }
        Counters::add(&self.env.counters.degraded_writes, 1);
        let origin = self.env.origin.as_ref();
        let writes: Vec<(u64, &[u8])> = edges
            .iter()
            .map(|(lba, b)| (lba * bs, b.as_slice()))
            .collect();
        origin
            .write_many(&writes)
            .map_err(|e| self.origin_write_error(e))?;
        if full_first < full_end {
            let (at, len) = (full_first * bs, (full_end - full_first) * bs);
            match kind {
                RangeKind::Zero => origin.write_zeroes(at, len),
                RangeKind::Discard => origin.discard(at, len),
            }
            .map_err(|e| self.origin_write_error(e))?;
        }
        origin.flush().map_err(|e| self.origin_write_error(e))
    }

    /// Degraded: every acknowledged write is durable on the origin already;
    /// flush it anyway, so a FLUSH means what it says whatever happened.
    pub(crate) fn degraded_flush(&self) -> EngineResult<()> {
        // A stopped engine answers with its error, as every request does.
        drop(self.lock_index()?);
        self.env
            .origin
            .flush()
            .map_err(|e| self.origin_write_error(e))
    }

    /// The blocks of `[offset, end)` that the request covers only in part:
    /// their current content with `patch(lo, hi)` copied over the covered
    /// bytes `[lo, hi)`. Read through the normal read path (a verified
    /// cached copy, or the origin) under the degraded write lock.
    fn patched_edges<'a>(
        &self,
        offset: u64,
        end: u64,
        patch: impl Fn(u64, u64) -> &'a [u8],
    ) -> EngineResult<Vec<(u64, Vec<u8>)>> {
        let bs = self.env.bs as u64;
        let mut edges: Vec<(u64, Vec<u8>)> = Vec::new();
        for lba in [offset / bs, (end - 1) / bs] {
            let block_start = lba * bs;
            let lo = offset.max(block_start);
            let hi = end.min(block_start + bs);
            if hi - lo == bs || edges.iter().any(|(l, _)| *l == lba) {
                continue;
            }
            let mut block = vec![0u8; bs as usize];
            self.read_blocks(lba, &mut block, false, false, false)?;
            let src = patch(lo, hi);
            assert_eq!(src.len() as u64, hi - lo);
            block[(lo - block_start) as usize..(hi - block_start) as usize].copy_from_slice(src);
            edges.push((lba, block));
        }
        Ok(edges)
    }

    /// Drop the cached copies of blocks `[first, end)` before the origin
    /// gets their new content: a read that starts after the reply must not
    /// find the old copy.
    fn forget_cached(&self, first: u64, end: u64) -> EngineResult<()> {
        let mut inner = self.lock_index()?;
        inner.mutations += 1;
        inner.forget_blocks(first, end);
        Ok(())
    }

    fn origin_write_error(&self, e: cairn_device::DeviceError) -> EngineError {
        Counters::add(&self.env.counters.origin_write_errors, 1);
        tracing::error!("degraded write to the origin failed: {e}");
        EngineError::Origin(e)
    }
}

impl Inner {
    /// The state of a cache opened with the DEGRADED flag: an empty index,
    /// nothing to replay, nothing ever written.
    pub(crate) fn degraded_empty(sb: cairn_format::Superblock, n: u64) -> Inner {
        assert!(sb.degraded());
        Inner {
            sb,
            slots: SlotTable::new(n as usize),
            map: ForwardMap::new(n as usize),
            n,
            tail: 0,
            wb: 0,
            wb_persisted: 0,
            wb_limit: 0,
            head: 0,
            ckpt_head: 0,
            next_seq: 1,
            prev_crc: 0,
            durable_seq: 0,
            unsynced_blocks: 0,
            epoch_open: false,
            open: None,
            sealed: std::collections::VecDeque::new(),
            ranges: RangeMap::default(),
            dirty_blocks: 0,
            clean_blocks: 0,
            corrupt_blocks: 0,
            lost: std::collections::BTreeSet::new(),
            mutations: 0,
            failed: None,
            degrade_pending: None,
            degraded: true,
            tags: None,
        }
    }

    /// Forget every cached copy of blocks `[first, end)`; they are about to
    /// change on the origin. A lost block is rewritten, so no longer lost.
    pub(crate) fn forget_blocks(&mut self, first: u64, end: u64) {
        assert!(self.degraded, "only degraded writes bypass the log");
        assert!(first < end);
        if end - first <= 65536 {
            for lba in first..end {
                if let Some(slot) = self.map.get(lba, &self.slots) {
                    self.retire_slot(slot);
                }
            }
        } else {
            for slot in 0..self.n as u32 {
                let lba = self.slots.lba(slot);
                if self.slots.is_live(slot) && lba >= first && lba < end {
                    self.retire_slot(slot);
                }
            }
        }
        let gone: Vec<u64> = self.lost.range(first..end).copied().collect();
        for lba in gone {
            self.lost.remove(&lba);
        }
    }

    /// Recompute the block gauges from the slot table.
    pub(crate) fn recount_gauges(&mut self) {
        let (mut dirty, mut clean, mut corrupt) = (0, 0, 0);
        for slot in 0..self.n as u32 {
            if !self.slots.is_live(slot) {
                continue;
            }
            if self.slots.state(slot) & state::CORRUPT != 0 {
                corrupt += 1;
            }
            if self.slot_is_dirty(slot) {
                dirty += 1;
            } else {
                clean += 1;
            }
        }
        self.dirty_blocks = dirty;
        self.clean_blocks = clean;
        self.corrupt_blocks = corrupt;
    }
}
