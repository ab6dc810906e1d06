//! The log: space (eviction at the tail), sealing records, flushes,
//! superblock and checkpoint writes.

use cairn_format::{
    block_checksum, CheckpointEntry, CheckpointHeader, RecordEntry, RecordHeader, Superblock,
    Writer, CHECKPOINT_ENTRY_BYTES, CHECKPOINT_HEADER_BYTES, PENDING_RANGE_BYTES,
    SUPERBLOCK_OFFSETS,
};

use cairn_device::DeviceError;

use crate::engine::*;
use crate::error::EngineResult;
use crate::index::state;
use crate::inflight::SealedRecord;
use crate::stats::Counters;

/// Checkpoints are written in chunks of this size.
const CHECKPOINT_CHUNK_BYTES: usize = 1 << 20;

/// At most this many recently hit clean blocks move forward per eviction
/// round (each costs a cache read and a write).
const SECOND_CHANCE_MAX_BLOCKS: usize = 64;

impl Engine {
    // ----------------------------------------------------------- checkpoints

    /// Write a checkpoint of the index (and persist the write-back position).
    /// Degraded: nothing to checkpoint (the cache is not written again).
    pub fn checkpoint(&self) -> EngineResult<()> {
        self.with_degrade(|degraded| {
            if degraded {
                return Ok(());
            }
            let mut inner = self.lock()?;
            inner.checkpoint(&self.env)
        })
    }

    /// Clean shutdown: flush, checkpoint. The engine stays usable.
    /// Degraded: flush the origin (every write is durable there already).
    pub fn close(&self) -> EngineResult<()> {
        self.with_degrade(|degraded| {
            if degraded {
                return self.degraded_flush();
            }
            let mut inner = self.lock()?;
            inner.checkpoint(&self.env)
        })
    }
}

impl Inner {
    /// Make sure `blocks` more data blocks (plus headers and a possible lap
    /// skip) fit before the limit, reclaiming clean space as needed.
    pub(crate) fn ensure_space(&mut self, env: &Env, blocks: u64) -> EngineResult<Space> {
        let headers = blocks / env.record_data_max + 2;
        // The slack keeps room for a lap skip and for an empty epoch-end
        // record, so a flush can always seal even when the log is full of
        // dirty data (write-back needs that epoch end to make progress).
        let needed = blocks + headers + env.record_data_max + 1 + EPOCH_END_RESERVE_BLOCKS;
        let mut rescued = Vec::new();
        let mut ready = false;
        for _ in 0..4 {
            let from = self.append_position();
            if from + needed <= self.limit() {
                ready = true;
                break;
            }
            // 1. Evict clean slots up to the persisted write-back position,
            //    a little further than needed so second-chance blocks have
            //    room at the head.
            let target = from + needed + SECOND_CHANCE_MAX_BLOCKS as u64 + 2 - self.n;
            rescued.extend(self.evict_until(env, target));
            if from + needed <= self.limit() {
                ready = true;
                break;
            }
            // 2. Persist write-back progress so the tail may move further.
            if self.tail >= self.wb_persisted && self.wb > self.wb_persisted {
                self.persist_writeback(env)?;
                continue;
            }
            // 3. The checkpoint's head is what blocks us: take a new one.
            if self.ckpt_head < self.tail && self.ckpt_head + self.n < from + needed {
                self.checkpoint(env)?;
                continue;
            }
            break;
        }
        // Recently hit blocks that were evicted move to the head. They may
        // use room the caller wanted (it then waits for write-back, which
        // frees more), but never the reserve a flush needs.
        let keep_free = env.record_data_max + 1 + EPOCH_END_RESERVE_BLOCKS;
        self.reinsert(env, rescued, if ready { needed } else { keep_free })?;
        if ready || self.append_position() + needed <= self.limit() {
            Ok(Space::Ready)
        } else {
            Ok(Space::NeedWriteback)
        }
    }

    /// Where the next data block would go.
    fn append_position(&self) -> u64 {
        match &self.open {
            Some(open) => open.start + 1 + open.data_count(),
            None => self.head,
        }
    }

    /// Advance the tail towards `target`, evicting clean blocks, but never
    /// past the persisted write-back position (dirty data stays). Clean
    /// blocks hit since they were inserted (second chance) are read and
    /// returned, up to a bound, so the caller can move them to the head.
    pub(crate) fn evict_until(&mut self, env: &Env, target: u64) -> Vec<(u64, Vec<u8>)> {
        let mut rescued = Vec::new();
        while self.tail < target && self.tail < self.wb_persisted {
            let slot = self.phys(self.tail);
            if self.slots.is_live(slot) {
                assert!(!self.slot_is_dirty(slot), "tail passed dirty data");
                let st = self.slots.state(slot);
                if st & state::REFERENCED != 0
                    && st & state::CORRUPT == 0
                    && rescued.len() < SECOND_CHANCE_MAX_BLOCKS
                {
                    let lba = self.slots.lba(slot);
                    let mut block = vec![0u8; env.bs];
                    let read = env
                        .cache
                        .read_at(env.layout.slot_offset_bytes(slot as u64), &mut block);
                    // Check data after reading it: only a verified copy moves.
                    if read.is_ok() && block_checksum(lba, &block) == self.slots.crc(slot) {
                        rescued.push((lba, block));
                    }
                }
                if self.slots.state(slot) & state::CORRUPT != 0 {
                    // Dirty data that failed its checksum is leaving the
                    // log: remember it reads as EIO, never as stale data.
                    self.lost.insert(self.slots.lba(slot));
                }
                self.retire_slot(slot);
                Counters::add(&env.counters.evictions, 1);
            }
            self.slots.clear(slot);
            self.tail += 1;
        }
        rescued
    }

    /// Re-insert second-chance blocks at the head as clean copies, if that
    /// still leaves `needed` blocks free; otherwise they stay evicted.
    fn reinsert(
        &mut self,
        env: &Env,
        rescued: Vec<(u64, Vec<u8>)>,
        needed: u64,
    ) -> EngineResult<()> {
        for (lba, block) in rescued {
            let from = self.append_position();
            // One block, a possible new header and lap skip, plus the room
            // the caller asked for.
            if from + 3 + needed > self.limit() || self.map.get(lba, &self.slots).is_some() {
                continue;
            }
            self.append_data(env, lba, &block, true)?;
            Counters::add(&env.counters.second_chances, 1);
        }
        Ok(())
    }

    /// Seal the open record into the log (one vectored write, no barrier).
    /// With `epoch_end`, also seals an empty record if there is nothing open
    /// but earlier records of this epoch exist.
    pub(crate) fn seal(&mut self, env: &Env, epoch_end: bool) -> EngineResult<()> {
        self.seal_with(env, epoch_end, false)
    }

    /// Seal; with `barrier`, the write and the barrier go down together (one
    /// system call on io_uring), after every record sealed before it is
    /// written. Without a barrier the record is queued and written outside
    /// the lock (see `inflight.rs`).
    pub(crate) fn seal_with(
        &mut self,
        env: &Env,
        epoch_end: bool,
        barrier: bool,
    ) -> EngineResult<()> {
        assert!(!self.degraded, "no log record is sealed in degraded mode");
        if barrier {
            self.complete_sealed(env)?;
        }
        let open = match self.open.take() {
            Some(open) => open,
            None => {
                if !epoch_end {
                    return Ok(());
                }
                let mut start = self.head;
                if self.phys(start) as u64 + 2 > self.n {
                    start = start.div_ceil(self.n) * self.n;
                }
                if start + 1 > self.limit() {
                    // Only right after recovery: the tail restarts at the
                    // checkpoint's, behind clean data it may now evict.
                    let _ = self.evict_until(env, start + 1 - self.n);
                }
                assert!(start < self.limit(), "no room for an epoch-end record");
                self.head = start;
                OpenRecord {
                    start,
                    entries: Vec::new(),
                    data_entry: Vec::new(),
                    data: env.record_bufs.lend(0),
                    capacity_data: 0,
                    has_dirty: false,
                }
            }
        };
        let header = RecordHeader {
            sequence: self.next_seq,
            log_offset: open.start,
            generation: self.sb.generation,
            durable_sequence: self.durable_seq,
            prev_crc: self.prev_crc,
            format_tag: crate::engine::chain_seed(&self.sb.uuid),
            flags: if epoch_end {
                cairn_format::RECORD_FLAG_EPOCH_END
            } else {
                0
            },
            entries: open.entries.clone(),
        };
        let (hbuf, hcrc) = header.encode(env.bs as u32);
        // Aligned like the data, so the record goes down without a copy.
        let hbuf = {
            let mut aligned = env.header_bufs.lend(hbuf.len());
            aligned.extend_from_slice(&hbuf);
            aligned
        };
        let at = env.layout.slot_offset_bytes(self.phys(open.start) as u64);
        let length = header.length_blocks();
        assert!(
            self.phys(open.start) as u64 + length <= self.n,
            "record wraps"
        );
        assert_eq!(open.data.len(), open.data_count() as usize * env.bs);
        // Check data before writing it: every block must match its entry.
        for (k, &ei) in open.data_entry.iter().enumerate() {
            if let RecordEntry::Data { lba, crc, .. } = open.entries[ei as usize] {
                debug_assert_eq!(
                    block_checksum(lba, &open.data[k * env.bs..(k + 1) * env.bs]),
                    crc
                );
            }
        }
        if barrier {
            let bufs: &[&[u8]] = if open.data.is_empty() {
                &[&hbuf]
            } else {
                &[&hbuf, &open.data]
            };
            // A barrier that failed may also have lost the records sealed
            // since the last one (a failed fsync drops dirty pages);
            // retrying this write cannot bring them back, so that case goes
            // degraded at once.
            let retry_safe = self.unsynced_blocks == 0;
            let result = retrying_cache_write(env, "sealing a log record", retry_safe, || {
                env.cache.write_vectored_and_flush(at, bufs)
            });
            if let Err(e) = result {
                self.open = Some(open);
                return Err(self.fail(env, "sealing a log record", e));
            }
        }
        Counters::add(&env.counters.records_sealed, 1);
        Counters::add(
            &env.counters.cache_bytes_written,
            (length as usize * env.bs) as u64,
        );
        self.prev_crc = hcrc;
        self.next_seq += 1;
        self.head = open.start + length;
        self.unsynced_blocks += length;
        self.epoch_open = !epoch_end;
        if barrier {
            Counters::add(&env.counters.cache_barriers, 1);
            self.durable_seq = self.next_seq - 1;
            self.unsynced_blocks = 0;
        } else {
            let record = SealedRecord::new(env, open.start, at, header, hbuf, open.data);
            self.queue_sealed(env, record)?;
        }
        Ok(())
    }

    /// Seal and make durable everything written so far; ends an epoch.
    pub fn flush(&mut self, env: &Env) -> EngineResult<()> {
        let open_dirty = self.open.as_ref().is_some_and(|o| o.has_dirty);
        if !open_dirty && !self.epoch_open && self.unsynced_blocks == 0 {
            // Nothing new to persist (an open record of clean fills may
            // wait: losing it loses nothing).
            return Ok(());
        }
        self.seal_with(env, true, true)?;
        self.wb_limit = self.head;
        Ok(())
    }

    pub fn write_superblock(&mut self, env: &Env) -> EngineResult<()> {
        // Retrying is safe only if no sealed record waits for a barrier.
        let retry_safe = self.unsynced_blocks == 0;
        // Tags first: a superblock never advances the write-back or
        // recalculation position past tags that are not durable. A failed
        // persist changes nothing, so it is retried whole.
        if let Some(tags) = self.tags.as_mut() {
            let persisted =
                retrying_cache_write(env, "writing integrity tag pages", retry_safe, || {
                    tags.persist(env.cache.as_ref(), &env.layout, &env.counters)
                });
            let recalc_pos = tags.recalc_pos;
            if let Err(e) = persisted {
                return Err(self.fail(env, "writing integrity tag pages", e));
            }
            self.sb.recalc_position_blocks = recalc_pos;
        }
        if let Err(e) = self.write_superblock_io(env, retry_safe) {
            return Err(self.fail(env, "writing the superblock", e));
        }
        Ok(())
    }

    /// Write the next superblock copy durably. The sequence only moves on
    /// once the copy is durable, so a retry (or the degraded superblock
    /// after a failure) rewrites the same copy, and the other copy, the last
    /// good one, is never the one at risk.
    pub(crate) fn write_superblock_io(
        &mut self,
        env: &Env,
        retry_safe: bool,
    ) -> Result<(), cairn_device::DeviceError> {
        assert!(
            !self.degraded,
            "degraded mode never writes the superblock again"
        );
        let mut next = self.sb.clone();
        next.sequence += 1;
        let buf = next.encode();
        let at = SUPERBLOCK_OFFSETS[Superblock::copy_index(next.sequence)];
        retrying_cache_write(env, "writing the superblock", retry_safe, || {
            env.cache.write_vectored_and_flush(at, &[&buf])
        })?;
        self.sb.sequence = next.sequence;
        Counters::add(&env.counters.cache_bytes_written, buf.len() as u64);
        Counters::add(&env.counters.cache_barriers, 1);
        Counters::add(&env.counters.superblock_writes, 1);
        Ok(())
    }

    pub(crate) fn persist_writeback(&mut self, env: &Env) -> EngineResult<()> {
        self.sb.writeback_offset = self.wb;
        self.write_superblock(env)?;
        self.wb_persisted = self.wb;
        Ok(())
    }

    /// Snapshot the index into the inactive checkpoint slot, then point the
    /// superblock at it.
    pub fn checkpoint(&mut self, env: &Env) -> EngineResult<()> {
        self.flush(env)?;
        // Clean fills still open are sealed too, so the snapshot has them.
        if self.open.is_some() {
            self.seal_with(env, true, true)?;
            self.wb_limit = self.head;
        }
        assert!(self.open.is_none());
        assert_eq!(self.unsynced_blocks, 0, "a checkpoint follows a barrier");
        // The slot is retried whole: its chunks are plain writes covered by
        // the header's barrier, so if that barrier fails the chunks must be
        // written again too, not just the header.
        let attempts = env.config.cache_write_attempts.max(1);
        let mut backoff_us = env.config.cache_write_backoff_us;
        let mut attempt = 1;
        let header = loop {
            match self.write_checkpoint_slot(env) {
                Ok(header) => break header,
                Err(e) => {
                    Counters::add(&env.counters.cache_write_errors, 1);
                    if attempt >= attempts {
                        return Err(self.fail(env, "writing a checkpoint", e));
                    }
                    tracing::warn!(
                        "writing a checkpoint failed (attempt {attempt} of {attempts}), retrying: {e}"
                    );
                    Counters::add(&env.counters.cache_write_retries, 1);
                    backoff(&mut backoff_us);
                    attempt += 1;
                }
            }
        };
        let target = 1 - self.sb.active_checkpoint;
        self.sb.active_checkpoint = target;
        self.sb.checkpoint_sequence = header.sequence;
        self.sb.writeback_offset = self.wb;
        self.write_superblock(env)?;
        self.wb_persisted = self.wb;
        self.ckpt_head = self.head;
        Counters::add(&env.counters.checkpoints, 1);
        Ok(())
    }

    /// Stream the index into the inactive checkpoint slot and write its
    /// header with a barrier. The superblock is not touched.
    fn write_checkpoint_slot(&self, env: &Env) -> Result<CheckpointHeader, DeviceError> {
        // Streamed in bounded chunks: a checkpoint of a full 4 GiB cache is
        // 16 MiB, and building it whole would double the daemon's memory.
        let target = 1 - self.sb.active_checkpoint;
        let slot_at = env.layout.checkpoint_offset_bytes(target);
        let ranges = self.ranges.to_pending();
        let live = self.dirty_blocks + self.clean_blocks;
        let payload_len = CheckpointHeader::payload_bytes(live, ranges.len() as u32);
        assert!(
            CHECKPOINT_HEADER_BYTES as u64 + cairn_format::align_up(payload_len, env.bs as u64)
                <= env.layout.checkpoint_slot_bytes
        );
        let chunk_bytes = CHECKPOINT_CHUNK_BYTES.max(env.bs);
        let mut chunk = vec![0u8; chunk_bytes];
        let mut used = 0usize;
        let mut at = slot_at + CHECKPOINT_HEADER_BYTES as u64;
        let mut payload_crc = 0u32;
        let mut entry_count = 0u64;
        let mut written = 0u64;
        let mut put = |bytes: &[u8; 32], len: usize, last: bool| -> Result<(), DeviceError> {
            // Items may straddle chunks: the payload on disk is contiguous,
            // so every chunk but the last is written whole.
            let mut src = &bytes[..len];
            loop {
                let n = src.len().min(chunk_bytes - used);
                chunk[used..used + n].copy_from_slice(&src[..n]);
                used += n;
                src = &src[n..];
                let flush_full = used == chunk_bytes;
                let flush_last = last && src.is_empty() && used > 0;
                if flush_full || flush_last {
                    payload_crc = cairn_format::crc32c_append(payload_crc, &chunk[..used]);
                    // Only the final chunk can be partial: pad it to a whole
                    // block; the crc covers the payload only.
                    let io_len = cairn_format::align_up(used as u64, env.bs as u64) as usize;
                    chunk[used..io_len].fill(0);
                    env.cache.write_at(at, &chunk[..io_len])?;
                    at += io_len as u64;
                    written += io_len as u64;
                    used = 0;
                }
                if src.is_empty() {
                    return Ok(());
                }
            }
        };
        for slot in 0..self.n as u32 {
            if !self.slots.is_live(slot) {
                continue;
            }
            let entry = CheckpointEntry {
                slot,
                lba: self.slots.lba(slot),
                crc: self.slots.crc(slot),
                state: self.slots.state(slot) & state::PERSISTED,
            };
            let mut bytes = [0u8; 32];
            entry.encode(&mut Writer::new(&mut bytes[..CHECKPOINT_ENTRY_BYTES]));
            put(&bytes, CHECKPOINT_ENTRY_BYTES, false)?;
            entry_count += 1;
        }
        assert_eq!(entry_count, live, "every live slot is in the checkpoint");
        for r in &ranges {
            let mut bytes = [0u8; 32];
            r.encode(&mut Writer::new(&mut bytes[..PENDING_RANGE_BYTES]));
            put(&bytes, PENDING_RANGE_BYTES, false)?;
        }
        put(&[0u8; 32], 0, true)?;
        Counters::add(&env.counters.cache_bytes_written, written);
        let header = CheckpointHeader {
            sequence: self.sb.checkpoint_sequence + 1,
            generation: self.sb.generation,
            head_offset: self.head,
            next_record_sequence: self.next_seq,
            prev_crc: self.prev_crc,
            tail_offset: self.tail,
            writeback_offset: self.wb,
            durable_sequence: self.durable_seq,
            entry_count,
            range_count: ranges.len() as u32,
            payload_crc,
        };
        // The header goes last, with the barrier that covers the payload.
        let hbuf = header.encode();
        env.cache.write_vectored_and_flush(slot_at, &[&hbuf])?;
        Counters::add(&env.counters.cache_bytes_written, hbuf.len() as u64);
        Counters::add(&env.counters.cache_barriers, 1);
        Ok(header)
    }
}

/// Run one cache write, retrying it up to `cache_write_attempts` times in
/// all with a doubling backoff when `retry_safe`. Every failed attempt is
/// counted in `cache_write_errors`.
pub(crate) fn retrying_cache_write(
    env: &Env,
    what: &str,
    retry_safe: bool,
    mut op: impl FnMut() -> Result<(), DeviceError>,
) -> Result<(), DeviceError> {
    let attempts = if retry_safe {
        env.config.cache_write_attempts.max(1)
    } else {
        1
    };
    let mut backoff_us = env.config.cache_write_backoff_us;
    let mut attempt = 1;
    loop {
        match op() {
            Ok(()) => {
                if attempt > 1 {
                    tracing::warn!("{what}: succeeded on attempt {attempt} of {attempts}");
                }
                return Ok(());
            }
            Err(e) => {
                Counters::add(&env.counters.cache_write_errors, 1);
                if attempt >= attempts {
                    return Err(e);
                }
                tracing::warn!("{what} failed (attempt {attempt} of {attempts}), retrying: {e}");
                Counters::add(&env.counters.cache_write_retries, 1);
                backoff(&mut backoff_us);
                attempt += 1;
            }
        }
    }
}

/// Sleep for the current backoff and double it. The engine owns no clock:
/// this only waits, and zero (the simulation tests) does not wait at all.
fn backoff(backoff_us: &mut u64) {
    if *backoff_us > 0 {
        std::thread::sleep(std::time::Duration::from_micros(*backoff_us));
        *backoff_us = backoff_us.saturating_mul(2);
    }
}
