//! Ordered write-back: epoch group by epoch group, checksums verified
//! before anything reaches the origin, origin flushed after each group.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use cairn_device::PooledBuf;
use cairn_format::{block_checksum, RangeKind, RecordEntry, RecordHeader};

use crate::engine::*;
use crate::error::{EngineError, EngineResult};
use crate::index::state;
use crate::stats::Counters;

impl Engine {
    // ------------------------------------------------------------- writeback

    pub fn set_writeback_paused(&self, paused: bool) {
        self.paused.store(paused, Ordering::Relaxed);
    }

    pub fn writeback_paused(&self) -> bool {
        self.paused.load(Ordering::Relaxed)
    }

    /// One step of background write-back: one epoch group, unless paused.
    /// Returns what was written; zero blocks means nothing was eligible.
    pub fn writeback_step(&self) -> EngineResult<WritebackProgress> {
        self.with_degrade(|degraded| {
            if degraded {
                // Degrading wrote everything back; nothing is dirty since.
                return Ok(WritebackProgress::default());
            }
            if self.writeback_paused() {
                let inner = self.lock()?;
                return Ok(WritebackProgress {
                    dirty_blocks: inner.dirty_blocks,
                    ..Default::default()
                });
            }
            self.writeback_group()
        })
    }

    /// Write back everything: flush, then write back every group, then
    /// persist the write-back position. Runs even when paused.
    pub fn drain(&self) -> EngineResult<WritebackProgress> {
        self.drain_with_progress(|_| {})
    }

    pub fn drain_with_progress(
        &self,
        mut progress: impl FnMut(&WritebackProgress),
    ) -> EngineResult<WritebackProgress> {
        self.with_degrade(|degraded| {
            if degraded {
                self.degraded_flush()?;
                let p = WritebackProgress {
                    dirty_blocks: self.lock_index()?.dirty_blocks,
                    ..Default::default()
                };
                progress(&p);
                return Ok(p);
            }
            self.drain_cached(&mut progress)
        })
    }

    pub(crate) fn drain_cached(
        &self,
        progress: &mut impl FnMut(&WritebackProgress),
    ) -> EngineResult<WritebackProgress> {
        Counters::add(&self.env.counters.flushes, 1);
        self.flush_internal()?;
        let mut total = WritebackProgress::default();
        // Bounded: each group advances the write-back position.
        for _ in 0..=self.env.layout.log_blocks {
            let step = self.writeback_group()?;
            total.blocks_written += step.blocks_written;
            total.groups += step.groups;
            total.dirty_blocks = step.dirty_blocks;
            progress(&total);
            if step.groups == 0 {
                break;
            }
        }
        let mut inner = self.lock()?;
        if inner.wb_persisted != inner.wb {
            inner.persist_writeback(&self.env)?;
        }
        total.dirty_blocks = inner.dirty_blocks;
        Ok(total)
    }

    /// Write back the oldest complete epoch group, tracking origin health.
    pub(crate) fn writeback_group(&self) -> EngineResult<WritebackProgress> {
        let result = self.writeback_group_inner();
        match &result {
            Err(EngineError::Origin(e)) => {
                if !self.origin_failing.swap(true, Ordering::Relaxed) {
                    tracing::error!("origin is failing; dirty data stays on the cache: {e}");
                }
                *self
                    .origin_last_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
            }
            Ok(p) if p.groups > 0 && self.origin_failing.swap(false, Ordering::Relaxed) => {
                tracing::info!("origin recovered; write-back resumed");
            }
            _ => {}
        }
        result
    }

    /// The last origin error while the origin is failing.
    pub fn origin_error(&self) -> Option<String> {
        if !self.origin_failing.load(Ordering::Relaxed) {
            return None;
        }
        self.origin_last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub(crate) fn writeback_group_inner(&self) -> EngineResult<WritebackProgress> {
        let _serial = self
            .writeback_lock
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let env = &self.env;
        let (start, limit, n) = {
            let inner = self.lock()?;
            (inner.wb, inner.wb_limit, inner.n)
        };
        if start == limit {
            let inner = self.lock()?;
            return Ok(WritebackProgress {
                dirty_blocks: inner.dirty_blocks,
                ..Default::default()
            });
        }
        let (records, pos) = read_group(env, start, limit, n)?;
        let applied = apply_group(env, &records)?;
        // Commit: the group is on the origin.
        let mut inner = self.lock()?;
        assert_eq!(inner.wb, start, "write-back is serialized");
        inner.commit_group(env, start, pos, &records, &applied);
        Ok(WritebackProgress {
            blocks_written: applied.blocks_written,
            groups: 1,
            dirty_blocks: inner.dirty_blocks,
        })
    }
}

/// Largest write-back write to the origin: consecutive blocks are merged
/// up to this.
const RUN_BYTES_MAX: usize = 1 << 20;

/// Records read back from the log: (logical offset, header, data blocks).
/// The data sits in pooled, page-aligned buffers: read straight from the
/// device (no bounce copy, no zeroing first) and sent to the origin from
/// there (no copy into runs); they go back to the pool with the group.
pub(crate) type GroupRecords = Vec<(u64, RecordHeader, RecordData)>;

/// One record's data blocks, back in the record buffer pool on drop.
pub(crate) type RecordData = PooledBuf;

/// A pooled buffer of `len` bytes to be read into in place. Its bytes are
/// whatever the buffer held: the caller overwrites all of them.
fn record_data_for_read(env: &Env, len: usize) -> RecordData {
    let mut data = env.record_bufs.lend_full();
    data.set_len(len);
    data
}

/// A pooled copy of record data held in memory (degraded mode's unwritten
/// records).
pub(crate) fn record_data_copy(env: &Env, bytes: &[u8]) -> RecordData {
    let mut data = env.record_bufs.lend(bytes.len());
    data.extend_from_slice(bytes);
    data
}

/// What `apply_group` copied to the origin.
pub(crate) struct Applied {
    pub blocks_written: u64,
    /// What the origin now holds, in the order it was written: the ranges,
    /// then each block written with its (verified) checksum. Integrity tags
    /// follow it at commit.
    pub ranges: Vec<(RangeKind, u64, u64)>,
    pub blocks: Vec<(u64, u32)>,
    /// (address, logical offset) of dirty blocks that failed their checksum
    /// and were not copied.
    pub bad: Vec<(u64, u64)>,
}

/// Read the records from `start` to the next epoch end, or until `limit`
/// (exclusive) if no epoch end comes first. Returns them and where the next
/// record starts.
pub(crate) fn read_group(
    env: &Env,
    start: u64,
    limit: u64,
    n: u64,
) -> EngineResult<(GroupRecords, u64)> {
    let bs = env.bs;
    let mut records: GroupRecords = Vec::new();
    let mut pos = start;
    for _ in 0..n {
        let (at, header) = crate::recovery::read_record_header(env, pos, n)?.ok_or_else(|| {
            EngineError::LogDamaged {
                device: env.cache.name().to_string(),
                detail: format!("no valid record at write-back position {pos}"),
            }
        })?;
        let data_count = header.data_count();
        let mut data = record_data_for_read(env, data_count * bs);
        if data_count > 0 {
            env.cache
                .read_at(env.layout.slot_offset_bytes((at + 1) % n), &mut data)
                .map_err(|e| {
                    Counters::add(&env.counters.cache_read_errors, 1);
                    EngineError::Cache(e)
                })?;
        }
        pos = at + header.length_blocks();
        let epoch_end = header.epoch_end();
        records.push((at, header, data));
        if epoch_end || pos >= limit {
            break;
        }
    }
    assert!(pos <= limit, "write-back walked past its limit");
    Ok((records, pos))
}

/// Copy one group to the origin: its final state (ranges in order, then
/// the last valid version of each block, sorted and merged by address),
/// then one origin flush. A block that fails its checksum is never copied.
pub(crate) fn apply_group(env: &Env, records: &GroupRecords) -> EngineResult<Applied> {
    let bs = env.bs;
    let mut final_blocks: BTreeMap<u64, (usize, usize, u32)> = BTreeMap::new();
    let mut range_ops: Vec<(RangeKind, u64, u64)> = Vec::new();
    let mut bad: Vec<(u64, u64)> = Vec::new();
    for (ri, (at, header, data)) in records.iter().enumerate() {
        assert_eq!(data.len(), header.data_count() * bs);
        let mut k = 0usize;
        for entry in &header.entries {
            match *entry {
                RecordEntry::Data { lba, crc, clean } => {
                    let block = &data[k * bs..(k + 1) * bs];
                    let slot_offset = at + 1 + k as u64;
                    k += 1;
                    if clean {
                        continue;
                    }
                    if block_checksum(lba, block) != crc {
                        // Never copy a block that fails its checksum.
                        final_blocks.remove(&lba);
                        bad.push((lba, slot_offset));
                        continue;
                    }
                    final_blocks.insert(lba, (ri, k - 1, crc));
                }
                RecordEntry::Range {
                    kind,
                    lba,
                    block_count,
                } => {
                    let end = lba + block_count as u64;
                    let inside: Vec<u64> = final_blocks.range(lba..end).map(|(&l, _)| l).collect();
                    for l in inside {
                        final_blocks.remove(&l);
                    }
                    range_ops.push((kind, lba, block_count as u64));
                }
            }
        }
    }
    // Origin I/O: ranges, then data merged into runs, then one flush.
    let origin = env.origin.as_ref();
    let origin_err = |e| {
        Counters::add(&env.counters.origin_write_errors, 1);
        EngineError::Origin(e)
    };
    for &(kind, lba, count) in &range_ops {
        let (at, len) = (lba * bs as u64, count * bs as u64);
        match kind {
            RangeKind::Zero => origin.write_zeroes(at, len).map_err(origin_err)?,
            RangeKind::Discard => {
                origin.discard(at, len).map_err(origin_err)?;
            }
        }
    }
    // Runs of consecutive addresses, up to 1 MiB each, sent from the
    // records' buffers: blocks that also follow each other in one record
    // become one slice.
    let mut runs: Vec<(u64, usize, Vec<&[u8]>)> = Vec::new(); // (lba, blocks, slices)
    let mut last: Option<(usize, usize)> = None; // (record, block) of the previous block
    for (&lba, &(ri, k, _)) in &final_blocks {
        let data: &[u8] = &records[ri].2;
        let extends = runs.last().is_some_and(|(start, blocks, _)| {
            *start + *blocks as u64 == lba && (*blocks + 1) * bs <= RUN_BYTES_MAX
        });
        if !extends {
            runs.push((lba, 1, vec![&data[k * bs..(k + 1) * bs]]));
        } else {
            let (_, blocks, slices) = runs.last_mut().expect("checked above");
            *blocks += 1;
            let same_record_next = last == Some((ri, k.wrapping_sub(1)));
            match slices.last_mut() {
                Some(slice) if same_record_next => {
                    let from = k * bs - slice.len();
                    *slice = &data[from..(k + 1) * bs];
                }
                _ => slices.push(&data[k * bs..(k + 1) * bs]),
            }
        }
        last = Some((ri, k));
    }
    let writes: Vec<(u64, &[&[u8]])> = runs
        .iter()
        .map(|(lba, _, slices)| (lba * bs as u64, slices.as_slice()))
        .collect();
    origin.write_many_vectored(&writes).map_err(origin_err)?;
    origin.flush().map_err(origin_err)?;
    Ok(Applied {
        blocks_written: final_blocks.len() as u64,
        ranges: range_ops,
        blocks: final_blocks
            .iter()
            .map(|(&lba, &(_, _, crc))| (lba, crc))
            .collect(),
        bad,
    })
}

impl Inner {
    /// The group `[start, pos)` is on the origin: its dirty blocks become
    /// clean, blocks that failed their checksum are marked corrupt, its
    /// ranges are forgotten and the write-back position moves to `pos`.
    pub(crate) fn commit_group(
        &mut self,
        env: &Env,
        start: u64,
        pos: u64,
        records: &[(u64, RecordHeader, RecordData)],
        applied: &Applied,
    ) {
        let n = self.n;
        assert_eq!(self.wb, start, "groups are committed in log order");
        assert!(pos > start);
        for (at, header, _) in records {
            let mut k = 0u64;
            for entry in &header.entries {
                if let RecordEntry::Data { .. } = entry {
                    let slot = ((at + 1 + k) % n) as u32;
                    k += 1;
                    if self.slots.is_live(slot)
                        && self.slots.state(slot) & (state::CLEAN_INSERT | state::CORRUPT) == 0
                        && self.logical_of(slot) == at + k
                    {
                        self.dirty_blocks -= 1;
                        self.clean_blocks += 1;
                    }
                }
            }
        }
        for &(lba, logical) in &applied.bad {
            let slot = (logical % n) as u32;
            Counters::add(&env.counters.writeback_skipped_corrupt, 1);
            if self.slots.is_live(slot)
                && self.slots.lba(slot) == lba
                && self.logical_of(slot) == logical
            {
                tracing::error!(
                    lba,
                    "dirty block failed its checksum during write-back; not copied to the origin"
                );
                Counters::add(&env.counters.checksum_mismatches, 1);
                if self.slots.state(slot) & state::CORRUPT == 0 {
                    self.mark_corrupt(slot);
                }
                // It stays dirty-corrupt until evicted; then it is "lost".
            }
        }
        // The group is on the origin and flushed: its tags may follow, in
        // the order the origin saw it (ranges, then data). The checksums
        // were verified, so nothing is recomputed.
        self.set_tags_after_origin_write(applied);
        self.ranges.retire_records(start, pos);
        self.wb = pos;
        let bs = env.bs as u64;
        Counters::add(&env.counters.writeback_blocks, applied.blocks_written);
        Counters::add(&env.counters.writeback_bytes, applied.blocks_written * bs);
        Counters::add(&env.counters.writeback_groups, 1);
    }

    /// Integrity tags for what `applied` put on the origin (no-op without
    /// integrity).
    pub(crate) fn set_tags_after_origin_write(&mut self, applied: &Applied) {
        if let Some(tags) = self.tags.as_mut() {
            for &(kind, lba, count) in &applied.ranges {
                let tag = match kind {
                    RangeKind::Zero => cairn_format::TAG_ZERO,
                    RangeKind::Discard => cairn_format::TAG_DISCARDED,
                };
                tags.set_range(lba, count, tag);
            }
            for &(lba, crc) in &applied.blocks {
                tags.set(lba, cairn_format::fold_tag(crc));
            }
        }
    }
}
