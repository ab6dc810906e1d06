//! The engine proper: write path, read path, flush, write-back, checkpoints.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cairn_device::Device;
use cairn_format::{
    block_checksum, record_data_blocks_max, CheckpointEntry, CheckpointHeader, Layout, RangeKind,
    RecordEntry, RecordHeader, Superblock, Writer, CHECKPOINT_HEADER_BYTES, ORIGIN_BLOCKS_MAX,
    PENDING_RANGES_MAX, SUPERBLOCK_OFFSETS,
};

use crate::error::{EngineError, EngineResult};
use crate::index::{remove_mapping, state, ForwardMap, SlotTable};
use crate::policy::{CacheMode, HitFilter, SequentialDetector};
use crate::ranges::RangeMap;
use crate::stats::{Counters, StatsSnapshot};

#[derive(Debug, Clone)]
pub struct FormatOptions {
    pub block_size_bytes: u32,
    /// Overwrite an existing cairn cache.
    pub force: bool,
}

impl Default for FormatOptions {
    fn default() -> Self {
        FormatOptions {
            block_size_bytes: 4096,
            force: false,
        }
    }
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Insert blocks read from the origin into the cache as clean.
    pub promote_read_misses: bool,
    /// Force an internal flush once this many sealed blocks are waiting for
    /// a barrier. Bounds how far recovery must look for records that prove
    /// a damaged one was acknowledged, and gives write-back epoch boundaries
    /// during long streams without client flushes.
    pub unsynced_blocks_max: u64,
    /// Promote a missed block on its Nth miss (Open CAS nhit); 1 = always.
    pub promote_after_misses: u32,
    /// Reads continuing a sequential stream longer than this are not
    /// promoted (counted as bypassed); 0 disables the cutoff.
    pub sequential_cutoff_bytes: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            promote_read_misses: true,
            unsynced_blocks_max: 4096,
            promote_after_misses: 1,
            sequential_cutoff_bytes: 4 << 20,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Open even if the origin's identity differs from the recorded one
    /// (the new identity is recorded).
    pub force_origin: bool,
    pub config: EngineConfig,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WritebackProgress {
    pub blocks_written: u64,
    pub groups: u64,
    /// Dirty blocks left after this step.
    pub dirty_blocks: u64,
}

/// Immutable context shared by every operation.
pub(crate) struct Env {
    pub cache: Arc<dyn Device>,
    pub origin: Arc<dyn Device>,
    pub layout: Layout,
    pub counters: Counters,
    pub bs: usize,
    pub volume_blocks: u64,
    pub config: EngineConfig,
    pub record_data_max: u64,
    pub entries_max: usize,
}

/// The record being filled in memory. Its header goes at logical offset
/// `start`, its data blocks right after.
pub(crate) struct OpenRecord {
    pub start: u64,
    pub entries: Vec<RecordEntry>,
    /// Entry index of each data block, in data order.
    pub data_entry: Vec<u16>,
    pub data: Vec<u8>,
    pub capacity_data: u64,
    pub has_dirty: bool,
}

impl OpenRecord {
    fn data_count(&self) -> u64 {
        self.data_entry.len() as u64
    }
}

pub(crate) struct Inner {
    pub sb: Superblock,
    pub slots: SlotTable,
    pub map: ForwardMap,
    pub n: u64,
    /// Logical offsets (monotonic; physical slot = offset % n).
    /// tail <= wb_persisted <= wb <= wb_limit <= head.
    pub tail: u64,
    pub wb: u64,
    pub wb_persisted: u64,
    /// End of the last durable epoch-end record: write-back may go this far.
    pub wb_limit: u64,
    pub head: u64,
    /// Head at the newest checkpoint; replay starts there, so the log must
    /// never lap it.
    pub ckpt_head: u64,
    pub next_seq: u64,
    pub prev_crc: u32,
    pub durable_seq: u64,
    pub unsynced_blocks: u64,
    /// Records were sealed since the last epoch end.
    pub epoch_open: bool,
    pub open: Option<OpenRecord>,
    pub ranges: RangeMap,
    pub dirty_blocks: u64,
    pub clean_blocks: u64,
    pub corrupt_blocks: u64,
    /// Blocks whose dirty data failed its checksum and left the log: they
    /// read as EIO until rewritten (never as stale origin data).
    pub lost: BTreeSet<u64>,
    /// Bumped by every write, zero and discard; a read fill is inserted
    /// only if nothing changed since the origin read began.
    pub mutations: u64,
    pub failed: Option<String>,
}

enum Space {
    Ready,
    NeedWriteback,
}

/// How one block of a read request is served.
enum Plan {
    Done,
    Cache { slot: u32, crc: u32 },
    Miss,
}

pub struct Engine {
    env: Env,
    inner: Mutex<Inner>,
    writeback_lock: Mutex<()>,
    paused: AtomicBool,
    /// Set while write-back to the origin keeps failing; the last error is
    /// kept for status.
    origin_failing: AtomicBool,
    origin_last_error: Mutex<Option<String>>,
    mode: AtomicU8,
    sequential: SequentialDetector,
    hit_filter: HitFilter,
}

const SPACE_RETRIES_MAX: usize = 100_000;
/// Blocks always kept free for an empty epoch-end record (plus a lap skip).
const EPOCH_END_RESERVE_BLOCKS: u64 = 3;

impl Engine {
    // ----------------------------------------------------------------- setup

    /// Format `cache` for `origin`. Refuses to overwrite an existing cairn
    /// cache unless `opts.force`.
    pub fn format(
        cache: Arc<dyn Device>,
        origin: Arc<dyn Device>,
        opts: &FormatOptions,
    ) -> EngineResult<Superblock> {
        if !opts.force {
            if let Ok(sb) = Self::read_superblock(cache.as_ref()) {
                return Err(EngineError::AlreadyFormatted {
                    device: cache.name().to_string(),
                    origin: sb.origin_identity,
                });
            }
        }
        let bs = opts.block_size_bytes;
        let layout =
            Layout::compute(cache.size_bytes(), bs).map_err(|source| EngineError::Layout {
                device: cache.name().to_string(),
                source,
            })?;
        check_origin_size(origin.as_ref(), bs)?;
        let uuid: [u8; 16] = rand::random();
        let ckpt = CheckpointHeader {
            sequence: 1,
            generation: 1,
            head_offset: 0,
            next_record_sequence: 1,
            prev_crc: chain_seed(&uuid),
            tail_offset: 0,
            writeback_offset: 0,
            durable_sequence: 0,
            entry_count: 0,
            range_count: 0,
            payload_crc: crc32c::crc32c(&[]),
        };
        let ckpt_buf = ckpt.encode();
        cache
            .write_at(layout.checkpoint_offset_bytes(0), &ckpt_buf)
            .map_err(EngineError::Cache)?;
        cache.flush().map_err(EngineError::Cache)?;
        let mut identity = origin.identity();
        identity.truncate(cairn_format::ORIGIN_IDENTITY_MAX_BYTES);
        let mut sb = Superblock {
            sequence: 1,
            uuid,
            block_size_bytes: bs,
            cache_size_bytes: cache.size_bytes(),
            origin_size_bytes: origin.size_bytes(),
            origin_identity: identity,
            log_blocks: layout.log_blocks,
            checkpoint_slot_bytes: layout.checkpoint_slot_bytes,
            generation: 1,
            active_checkpoint: 0,
            checkpoint_sequence: 1,
            writeback_offset: 0,
            mode: 0,
            features: 0,
        };
        // Write both copies so no superblock of an earlier format survives.
        for seq in [1u64, 2] {
            sb.sequence = seq;
            cache
                .write_at(
                    SUPERBLOCK_OFFSETS[Superblock::copy_index(seq)],
                    &sb.encode(),
                )
                .map_err(EngineError::Cache)?;
        }
        cache.flush().map_err(EngineError::Cache)?;
        Ok(sb)
    }

    /// Read and validate the newest superblock of a cache device.
    pub fn read_superblock(cache: &dyn Device) -> EngineResult<Superblock> {
        let mut bufs = [vec![0u8; 4096], vec![0u8; 4096]];
        let mut results = Vec::with_capacity(2);
        for (i, buf) in bufs.iter_mut().enumerate() {
            if cache.size_bytes() < SUPERBLOCK_OFFSETS[i] + 4096 {
                return Err(EngineError::NotFormatted {
                    device: cache.name().to_string(),
                });
            }
            cache
                .read_at(SUPERBLOCK_OFFSETS[i], buf)
                .map_err(EngineError::Cache)?;
            results.push(Superblock::decode(buf));
        }
        let b = results.pop().expect("two results");
        let a = results.pop().expect("two results");
        let magic_a = matches!(a, Err(cairn_format::DecodeError::BadMagic { .. }));
        let magic_b = matches!(b, Err(cairn_format::DecodeError::BadMagic { .. }));
        match Superblock::newest(a, b) {
            Ok(sb) => Ok(sb),
            Err(_) if magic_a && magic_b => Err(EngineError::NotFormatted {
                device: cache.name().to_string(),
            }),
            Err((copy_a, copy_b)) => Err(EngineError::SuperblockDamaged {
                device: cache.name().to_string(),
                copy_a,
                copy_b,
            }),
        }
    }

    /// Open a formatted cache: load the newest checkpoint, replay the log.
    pub fn open(
        cache: Arc<dyn Device>,
        origin: Arc<dyn Device>,
        opts: &OpenOptions,
    ) -> EngineResult<Engine> {
        let sb = Self::read_superblock(cache.as_ref())?;
        let bs = sb.block_size_bytes;
        if origin.identity() != sb.origin_identity && !opts.force_origin {
            return Err(EngineError::WrongOrigin {
                recorded: sb.origin_identity.clone(),
                given: origin.identity(),
            });
        }
        if origin.size_bytes() != sb.origin_size_bytes {
            return Err(EngineError::OriginSizeChanged {
                origin: origin.name().to_string(),
                recorded_bytes: sb.origin_size_bytes,
                given_bytes: origin.size_bytes(),
            });
        }
        if cache.size_bytes() < sb.cache_size_bytes {
            return Err(EngineError::CacheShrunk {
                device: cache.name().to_string(),
                size_bytes: cache.size_bytes(),
                recorded_bytes: sb.cache_size_bytes,
            });
        }
        let layout =
            Layout::compute(sb.cache_size_bytes, bs).map_err(|source| EngineError::Layout {
                device: cache.name().to_string(),
                source,
            })?;
        if layout.log_blocks != sb.log_blocks
            || layout.checkpoint_slot_bytes != sb.checkpoint_slot_bytes
        {
            return Err(EngineError::CheckpointDamaged {
                device: cache.name().to_string(),
                detail: "superblock layout does not match the computed layout".into(),
            });
        }
        let env = Env {
            cache,
            origin,
            layout,
            counters: Counters::default(),
            bs: bs as usize,
            volume_blocks: sb.origin_size_bytes / bs as u64,
            config: opts.config.clone(),
            record_data_max: record_data_blocks_max(bs) as u64,
            entries_max: RecordHeader::entries_max(bs),
        };
        let mode = CacheMode::from_code(sb.mode).ok_or_else(|| EngineError::CheckpointDamaged {
            device: env.cache.name().to_string(),
            detail: format!("unknown cache mode code {} in the superblock", sb.mode),
        })?;
        let mut inner = crate::recovery::recover(&env, sb)?;
        if opts.force_origin && inner.sb.origin_identity != env.origin.identity() {
            let mut identity = env.origin.identity();
            identity.truncate(cairn_format::ORIGIN_IDENTITY_MAX_BYTES);
            inner.sb.origin_identity = identity;
        }
        // Bump the generation and make everything replayed durable before
        // anything new is written.
        inner.sb.generation += 1;
        inner.write_superblock(&env)?;
        inner.durable_seq = inner.next_seq - 1;
        Ok(Engine {
            env,
            inner: Mutex::new(inner),
            writeback_lock: Mutex::new(()),
            paused: AtomicBool::new(false),
            origin_failing: AtomicBool::new(false),
            origin_last_error: Mutex::new(None),
            mode: AtomicU8::new(mode.code()),
            sequential: SequentialDetector::default(),
            hit_filter: HitFilter::default(),
        })
    }

    fn lock(&self) -> EngineResult<MutexGuard<'_, Inner>> {
        let guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reason) = &guard.failed {
            return Err(EngineError::Failed(reason.clone()));
        }
        Ok(guard)
    }

    pub fn block_size_bytes(&self) -> u32 {
        self.env.bs as u32
    }

    pub fn size_bytes(&self) -> u64 {
        self.env.volume_blocks * self.env.bs as u64
    }

    pub fn superblock(&self) -> Superblock {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .sb
            .clone()
    }

    fn check_range(&self, offset: u64, length_bytes: u64) -> EngineResult<()> {
        match offset.checked_add(length_bytes) {
            Some(end) if end <= self.size_bytes() => Ok(()),
            _ => Err(EngineError::OutOfRange {
                offset,
                length_bytes,
                size_bytes: self.size_bytes(),
            }),
        }
    }

    // ----------------------------------------------------------------- reads

    /// Read `buf.len()` bytes at `offset`. Any alignment is accepted.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> EngineResult<()> {
        self.read_with(offset, buf, false)
    }

    /// Read and promote every missed block, ignoring the sequential cutoff
    /// and the n-hit policy: a prefetch (NBD CACHE, `cairn warm`).
    pub fn read_uncut(&self, offset: u64, buf: &mut [u8]) -> EngineResult<()> {
        self.read_with(offset, buf, true)
    }

    fn read_with(&self, offset: u64, buf: &mut [u8], prefetch: bool) -> EngineResult<()> {
        self.check_range(offset, buf.len() as u64)?;
        let c = &self.env.counters;
        Counters::add(&c.reads, 1);
        Counters::add(&c.read_bytes, buf.len() as u64);
        if buf.is_empty() {
            return Ok(());
        }
        let bs = self.env.bs as u64;
        let first = offset / bs;
        let last = (offset + buf.len() as u64 - 1) / bs;
        let count = (last - first + 1) as usize;
        // Whole blocks are staged here when the request is unaligned.
        let aligned = offset.is_multiple_of(bs) && (buf.len() as u64).is_multiple_of(bs);
        let mut staging = if aligned {
            Vec::new()
        } else {
            vec![0u8; count * self.env.bs]
        };
        let bypass = !prefetch
            && self.sequential.observe(
                offset,
                buf.len() as u64,
                self.env.config.sequential_cutoff_bytes,
            );
        let promote = self.env.config.promote_read_misses && self.mode().caches_reads() && !bypass;
        {
            let blocks: &mut [u8] = if aligned { buf } else { &mut staging };
            self.read_blocks(first, blocks, promote, bypass, prefetch)?;
        }
        if !aligned {
            let skip = (offset - first * bs) as usize;
            buf.copy_from_slice(&staging[skip..skip + buf.len()]);
        }
        Ok(())
    }

    /// Read whole blocks starting at block `first` into `out`.
    fn read_blocks(
        &self,
        first: u64,
        out: &mut [u8],
        promote: bool,
        bypass: bool,
        prefetch: bool,
    ) -> EngineResult<()> {
        let bs = self.env.bs;
        let count = out.len() / bs;
        let c = &self.env.counters;
        let mut plans = Vec::with_capacity(count);
        let mutations_before;
        {
            let mut inner = self.lock()?;
            mutations_before = inner.mutations;
            for (i, block) in out.chunks_mut(bs).enumerate() {
                plans.push(inner.plan_read(&self.env, first + i as u64, block)?);
            }
        }
        // Cache hits, read outside the lock and verified below.
        let mut reqs: Vec<(u64, &mut [u8])> = Vec::new();
        let mut hit_index = Vec::new();
        let mut miss_runs: Vec<(usize, usize)> = Vec::new();
        {
            let mut blocks: Vec<&mut [u8]> = out.chunks_mut(bs).collect();
            let mut i = 0;
            let mut rest: Vec<Option<&mut [u8]>> = blocks.drain(..).map(Some).collect();
            while i < count {
                match plans[i] {
                    Plan::Done => i += 1,
                    Plan::Cache { slot, .. } => {
                        let b = rest[i].take().expect("block taken once");
                        reqs.push((self.env.layout.slot_offset_bytes(slot as u64), b));
                        hit_index.push(i);
                        i += 1;
                    }
                    Plan::Miss => {
                        let start = i;
                        while i < count && matches!(plans[i], Plan::Miss) {
                            i += 1;
                        }
                        miss_runs.push((start, i));
                    }
                }
            }
            if !reqs.is_empty() {
                if let Err(e) = self.env.cache.read_many(&mut reqs) {
                    Counters::add(&c.cache_read_errors, 1);
                    tracing::warn!("cache read failed, retrying block by block: {e}");
                    // Mark every hit for individual handling below.
                    for (_, b) in reqs.iter_mut() {
                        b.fill(0);
                    }
                }
            }
        }
        // Misses: one origin read per contiguous run.
        for &(start, end) in &miss_runs {
            let at = (first + start as u64) * bs as u64;
            let slice = &mut out[start * bs..end * bs];
            if let Err(e) = self.env.origin.read_at(at, slice) {
                Counters::add(&c.origin_read_errors, 1);
                return Err(EngineError::Origin(e));
            }
            Counters::add(&c.read_misses, (end - start) as u64);
        }
        // Verify hits.
        for &i in &hit_index {
            let Plan::Cache { slot, crc } = plans[i] else {
                unreachable!()
            };
            let lba = first + i as u64;
            let block = &mut out[i * bs..(i + 1) * bs];
            if block_checksum(lba, block) == crc {
                Counters::add(&c.read_hits, 1);
                continue;
            }
            self.read_block_slow(lba, slot, crc, block)?;
        }
        // Promote misses as clean copies.
        if bypass {
            let missed: usize = miss_runs.iter().map(|&(s, e)| e - s).sum();
            Counters::add(&c.bypassed, missed as u64);
        }
        if promote && !miss_runs.is_empty() {
            let mut inner = self.lock()?;
            if inner.mutations == mutations_before {
                for &(start, end) in &miss_runs {
                    for i in start..end {
                        let lba = first + i as u64;
                        if inner.map.get(lba, &inner.slots).is_some() {
                            continue;
                        }
                        if !prefetch
                            && !self
                                .hit_filter
                                .miss(lba, self.env.config.promote_after_misses)
                        {
                            Counters::add(&c.promotions_skipped, 1);
                            continue;
                        }
                        if !inner.promote(&self.env, lba, &out[i * bs..(i + 1) * bs])? {
                            break;
                        }
                        Counters::add(&c.promotions, 1);
                    }
                }
            }
        }
        Ok(())
    }

    /// A cache hit that failed its checksum (or whose read failed): find out
    /// whether the mapping moved under us, or the copy is really bad.
    fn read_block_slow(&self, lba: u64, slot: u32, crc: u32, block: &mut [u8]) -> EngineResult<()> {
        let c = &self.env.counters;
        let mut inner = self.lock()?;
        // Re-read under the lock: nothing can move now.
        match inner.plan_read(&self.env, lba, block)? {
            Plan::Done => Ok(()),
            Plan::Miss => {
                drop(inner);
                self.env
                    .origin
                    .read_at(lba * self.env.bs as u64, block)
                    .map_err(|e| {
                        Counters::add(&c.origin_read_errors, 1);
                        EngineError::Origin(e)
                    })?;
                Ok(())
            }
            Plan::Cache {
                slot: now_slot,
                crc: now_crc,
            } => {
                let read_ok = match self
                    .env
                    .cache
                    .read_at(self.env.layout.slot_offset_bytes(now_slot as u64), block)
                {
                    Ok(()) => true,
                    Err(e) => {
                        Counters::add(&c.cache_read_errors, 1);
                        tracing::warn!("cache read of block {lba} failed: {e}");
                        false
                    }
                };
                if read_ok && block_checksum(lba, block) == now_crc {
                    Counters::add(&c.read_hits, 1);
                    return Ok(());
                }
                let _ = (slot, crc);
                if read_ok {
                    Counters::add(&c.checksum_mismatches, 1);
                }
                if inner.slot_is_dirty(now_slot) {
                    tracing::error!(
                        lba,
                        slot = now_slot,
                        "dirty cache block failed its checksum"
                    );
                    inner.mark_corrupt(now_slot);
                    return Err(EngineError::DirtyBlockCorrupt { lba });
                }
                // Clean: the origin has the data. Serve it and repair.
                tracing::warn!(
                    lba,
                    slot = now_slot,
                    "clean cache block bad; serving from origin and repairing"
                );
                self.env
                    .origin
                    .read_at(lba * self.env.bs as u64, block)
                    .map_err(|e| {
                        Counters::add(&c.origin_read_errors, 1);
                        EngineError::Origin(e)
                    })?;
                inner.retire_slot(now_slot);
                if inner.promote(&self.env, lba, block)? {
                    Counters::add(&c.repairs, 1);
                }
                Ok(())
            }
        }
    }

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
        drop(inner);
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
    fn write_through(&self, mode: CacheMode, first: u64, end: u64) -> EngineResult<()> {
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
    fn flush_internal(&self) -> EngineResult<()> {
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
        progress: impl FnMut(&WritebackProgress),
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
        self.drain_with_progress(progress)
    }

    /// Make every write acknowledged so far durable. Costs one cache barrier
    /// when there is something to persist, none otherwise.
    pub fn flush(&self) -> EngineResult<()> {
        Counters::add(&self.env.counters.flushes, 1);
        let mut inner = self.lock()?;
        inner.flush(&self.env)
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

    fn zero_range(&self, offset: u64, length_bytes: u64, kind: RangeKind) -> EngineResult<()> {
        self.check_range(offset, length_bytes)?;
        if length_bytes == 0 {
            return Ok(());
        }
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
        if self.writeback_paused() {
            let inner = self.lock()?;
            return Ok(WritebackProgress {
                dirty_blocks: inner.dirty_blocks,
                ..Default::default()
            });
        }
        self.writeback_group()
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
        self.flush()?;
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
    fn writeback_group(&self) -> EngineResult<WritebackProgress> {
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

    fn writeback_group_inner(&self) -> EngineResult<WritebackProgress> {
        let _serial = self
            .writeback_lock
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let env = &self.env;
        let bs = env.bs;
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
        // Walk records from the write-back position to the next epoch end.
        let mut records: Vec<(u64, RecordHeader, Vec<u8>)> = Vec::new();
        let mut pos = start;
        for _ in 0..n {
            let (at, header) =
                crate::recovery::read_record_header(env, pos, n)?.ok_or_else(|| {
                    EngineError::LogDamaged {
                        device: env.cache.name().to_string(),
                        detail: format!("no valid record at write-back position {pos}"),
                    }
                })?;
            let data_count = header.data_count();
            let mut data = vec![0u8; data_count * bs];
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
        assert!(pos <= limit, "write-back walked past the durable limit");
        // Final state of the group: ranges in order, then the last valid
        // version of each block.
        let mut final_blocks: BTreeMap<u64, (usize, usize)> = BTreeMap::new();
        let mut range_ops: Vec<(RangeKind, u64, u64)> = Vec::new();
        let mut bad: Vec<(u64, u64)> = Vec::new();
        for (ri, (at, header, data)) in records.iter().enumerate() {
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
                        final_blocks.insert(lba, (ri, k - 1));
                    }
                    RecordEntry::Range {
                        kind,
                        lba,
                        block_count,
                    } => {
                        let end = lba + block_count as u64;
                        let inside: Vec<u64> =
                            final_blocks.range(lba..end).map(|(&l, _)| l).collect();
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
        let mut runs: Vec<(u64, Vec<u8>)> = Vec::new();
        for (&lba, &(ri, k)) in &final_blocks {
            let block = &records[ri].2[k * bs..(k + 1) * bs];
            match runs.last_mut() {
                Some((start_lba, buf))
                    if *start_lba + (buf.len() / bs) as u64 == lba && buf.len() < (1 << 20) =>
                {
                    buf.extend_from_slice(block)
                }
                _ => runs.push((lba, block.to_vec())),
            }
        }
        let writes: Vec<(u64, &[u8])> = runs
            .iter()
            .map(|(lba, buf)| (lba * bs as u64, buf.as_slice()))
            .collect();
        origin.write_many(&writes).map_err(origin_err)?;
        origin.flush().map_err(origin_err)?;
        // Commit: the group is on the origin.
        let mut inner = self.lock()?;
        assert_eq!(inner.wb, start, "write-back is serialized");
        for (at, header, _) in &records {
            let mut k = 0u64;
            for entry in &header.entries {
                if let RecordEntry::Data { .. } = entry {
                    let slot = ((at + 1 + k) % n) as u32;
                    k += 1;
                    if inner.slots.is_live(slot)
                        && inner.slots.state(slot) & (state::CLEAN_INSERT | state::CORRUPT) == 0
                        && inner.logical_of(slot) == at + k
                    {
                        inner.dirty_blocks -= 1;
                        inner.clean_blocks += 1;
                    }
                }
            }
        }
        for &(lba, logical) in &bad {
            let slot = (logical % n) as u32;
            Counters::add(&env.counters.writeback_skipped_corrupt, 1);
            if inner.slots.is_live(slot)
                && inner.slots.lba(slot) == lba
                && inner.logical_of(slot) == logical
            {
                tracing::error!(
                    lba,
                    "dirty block failed its checksum during write-back; not copied to the origin"
                );
                Counters::add(&env.counters.checksum_mismatches, 1);
                if inner.slots.state(slot) & state::CORRUPT == 0 {
                    inner.mark_corrupt(slot);
                }
                // It stays dirty-corrupt until evicted; then it is "lost".
            }
        }
        inner.ranges.retire_records(start, pos);
        inner.wb = pos;
        let blocks_written = final_blocks.len() as u64;
        Counters::add(&env.counters.writeback_blocks, blocks_written);
        Counters::add(&env.counters.writeback_bytes, blocks_written * bs as u64);
        Counters::add(&env.counters.writeback_groups, 1);
        Ok(WritebackProgress {
            blocks_written,
            groups: 1,
            dirty_blocks: inner.dirty_blocks,
        })
    }

    // ----------------------------------------------------------- checkpoints

    /// Write a checkpoint of the index (and persist the write-back position).
    pub fn checkpoint(&self) -> EngineResult<()> {
        let mut inner = self.lock()?;
        inner.checkpoint(&self.env)
    }

    /// Clean shutdown: flush, checkpoint. The engine stays usable.
    pub fn close(&self) -> EngineResult<()> {
        self.checkpoint()
    }

    // ---------------------------------------------------------------- status

    pub fn stats(&self) -> StatsSnapshot {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let mut s = StatsSnapshot::default();
        self.env.counters.fill(&mut s);
        s.dirty_blocks = inner.dirty_blocks;
        s.clean_blocks = inner.clean_blocks;
        s.corrupt_blocks = inner.corrupt_blocks;
        s.cache_blocks = inner.n;
        s.free_blocks = inner.n - (inner.dirty_blocks + inner.clean_blocks).min(inner.n);
        s.block_size_bytes = self.env.bs as u64;
        s.volume_size_bytes = self.size_bytes();
        s.pending_ranges = inner.ranges.len() as u64;
        s.writeback_offset = inner.wb;
        s.head_offset = inner.head;
        s.writeback_limit_offset = inner.wb_limit;
        s.tail_offset = inner.tail;
        s.index_memory_bytes = (inner.slots.memory_bytes() + inner.map.memory_bytes()) as u64;
        s.writeback_paused = self.writeback_paused();
        s.origin_failing = self.origin_failing.load(Ordering::Relaxed);
        s.mode = self.mode().name();
        s.policy_memory_bytes = self.hit_filter.memory_bytes() as u64;
        s.failed = inner.failed.is_some();
        s
    }

    /// Is this block cached (for block status and tests)?
    pub fn is_cached(&self, lba: u64) -> bool {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.map.get(lba, &inner.slots).is_some()
    }

    /// Verify every live cached block against its checksum. Returns the
    /// origin addresses (in blocks) that failed.
    pub fn check(&self, mut progress: impl FnMut(u64, u64)) -> EngineResult<Vec<u64>> {
        self.flush()?;
        let n = self.env.layout.log_blocks;
        let bs = self.env.bs;
        let mut bad = Vec::new();
        let mut block = vec![0u8; bs];
        for slot in 0..n as u32 {
            let entry = {
                let inner = self.lock()?;
                if inner.slots.is_live(slot) {
                    Some((inner.slots.lba(slot), inner.slots.crc(slot)))
                } else {
                    None
                }
            };
            if let Some((lba, crc)) = entry {
                let ok = self
                    .env
                    .cache
                    .read_at(self.env.layout.slot_offset_bytes(slot as u64), &mut block)
                    .is_ok()
                    && block_checksum(lba, &block) == crc;
                if !ok {
                    let inner = self.lock()?;
                    // Only report if the mapping did not move meanwhile.
                    if inner.slots.is_live(slot)
                        && inner.slots.lba(slot) == lba
                        && inner.slots.crc(slot) == crc
                    {
                        bad.push(lba);
                    }
                }
            }
            if slot % 4096 == 0 || slot as u64 + 1 == n {
                progress(slot as u64 + 1, n);
            }
        }
        Ok(bad)
    }
}

/// The chain value the first record of a freshly formatted log links to.
/// Derived from the uuid so records of an earlier format never match.
pub(crate) fn chain_seed(uuid: &[u8; 16]) -> u32 {
    crc32c::crc32c(uuid)
}

fn check_origin_size(origin: &dyn Device, bs: u32) -> EngineResult<()> {
    let size = origin.size_bytes();
    if size == 0 || !size.is_multiple_of(bs as u64) {
        return Err(EngineError::OriginSizeUnaligned {
            origin: origin.name().to_string(),
            size_bytes: size,
            block_size_bytes: bs,
        });
    }
    let max_bytes = (ORIGIN_BLOCKS_MAX + 1).saturating_mul(bs as u64);
    if size / bs as u64 > ORIGIN_BLOCKS_MAX + 1 {
        return Err(EngineError::OriginTooLarge {
            origin: origin.name().to_string(),
            size_bytes: size,
            max_bytes,
            block_size_bytes: bs,
        });
    }
    Ok(())
}

impl Inner {
    pub fn phys(&self, logical: u64) -> u32 {
        (logical % self.n) as u32
    }

    /// Logical offset of a slot holding data between tail and head.
    pub fn logical_of(&self, slot: u32) -> u64 {
        let tail_phys = self.tail % self.n;
        self.tail + (slot as u64 + self.n - tail_phys) % self.n
    }

    /// First logical offset that may not be written: the tail one lap on,
    /// or the newest checkpoint's head one lap on, whichever is sooner.
    fn limit(&self) -> u64 {
        self.tail.min(self.ckpt_head) + self.n
    }

    pub fn slot_is_dirty(&self, slot: u32) -> bool {
        let st = self.slots.state(slot);
        st & state::LIVE != 0 && st & state::CLEAN_INSERT == 0 && self.logical_of(slot) >= self.wb
    }

    fn fail(&mut self, env: &Env, what: &str, e: cairn_device::DeviceError) -> EngineError {
        Counters::add(&env.counters.cache_write_errors, 1);
        let reason = format!("{what}: {e}");
        tracing::error!("cache device failed: {reason}");
        self.failed = Some(reason);
        EngineError::Cache(e)
    }

    /// Drop a slot from the index (superseded, evicted or repaired).
    pub fn retire_slot(&mut self, slot: u32) {
        let st = self.slots.state(slot);
        if st & state::LIVE == 0 {
            return;
        }
        let dirty = self.slot_is_dirty(slot);
        if st & state::CORRUPT != 0 {
            self.corrupt_blocks -= 1;
        }
        if dirty {
            self.dirty_blocks -= 1;
        } else {
            self.clean_blocks -= 1;
        }
        let lba = self.slots.lba(slot);
        remove_mapping(&mut self.map, &self.slots, lba, slot);
        self.slots.set_state(slot, 0);
    }

    pub fn mark_corrupt(&mut self, slot: u32) {
        let st = self.slots.state(slot);
        if st & state::CORRUPT == 0 {
            self.slots.set_state(slot, st | state::CORRUPT);
            self.corrupt_blocks += 1;
        }
    }

    fn open_slot_index(&self, slot: u32) -> Option<usize> {
        let open = self.open.as_ref()?;
        let logical = self.logical_of(slot);
        if logical > open.start && logical <= open.start + open.data_count() {
            Some((logical - open.start - 1) as usize)
        } else {
            None
        }
    }

    fn plan_read(&mut self, env: &Env, lba: u64, block: &mut [u8]) -> EngineResult<Plan> {
        let bs = env.bs;
        if let Some(slot) = self.map.get(lba, &self.slots) {
            if let Some(k) = self.open_slot_index(slot) {
                let open = self.open.as_ref().expect("open record");
                block.copy_from_slice(&open.data[k * bs..(k + 1) * bs]);
                assert_eq!(
                    block_checksum(lba, block),
                    self.slots.crc(slot),
                    "open record data"
                );
                Counters::add(&env.counters.read_hits, 1);
                return Ok(Plan::Done);
            }
            if self.slots.state(slot) & state::CORRUPT != 0 {
                return Err(EngineError::DirtyBlockCorrupt { lba });
            }
            let st = self.slots.state(slot);
            self.slots.set_state(slot, st | state::REFERENCED);
            return Ok(Plan::Cache {
                slot,
                crc: self.slots.crc(slot),
            });
        }
        if self.lost.contains(&lba) {
            return Err(EngineError::DirtyBlockCorrupt { lba });
        }
        if self.ranges.covering(lba).is_some() {
            block.fill(0);
            Counters::add(&env.counters.read_zero_hits, 1);
            return Ok(Plan::Done);
        }
        Ok(Plan::Miss)
    }

    /// Insert a clean copy (read fill or repair). Returns false if there was
    /// no room without evicting dirty data (then nothing is inserted).
    fn promote(&mut self, env: &Env, lba: u64, block: &[u8]) -> EngineResult<bool> {
        if !matches!(self.ensure_space(env, 1)?, Space::Ready) {
            return Ok(false);
        }
        self.append_data(env, lba, block, true)?;
        Ok(true)
    }

    /// Bring the open record into existence with room for one more data
    /// block (or entry), sealing the current one when it is full.
    fn open_record(&mut self, env: &Env, need_data: bool) -> EngineResult<()> {
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
            data: Vec::with_capacity(capacity_data as usize * env.bs),
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

    fn append_range(
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
    fn retire_range_slot(&mut self, _env: &Env, slot: u32) -> EngineResult<()> {
        self.retire_slot(slot);
        Ok(())
    }

    /// Read-modify-write of part of one block.
    fn write_partial(
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
                    env.origin
                        .read_at(lba * bs as u64, &mut block)
                        .map_err(|e| {
                            Counters::add(&env.counters.origin_read_errors, 1);
                            EngineError::Origin(e)
                        })?;
                    Counters::add(&env.counters.repairs, 1);
                }
            }
            Plan::Miss => {
                env.origin
                    .read_at(lba * bs as u64, &mut block)
                    .map_err(|e| {
                        Counters::add(&env.counters.origin_read_errors, 1);
                        EngineError::Origin(e)
                    })?;
            }
        }
        block[within..within + src.len()].copy_from_slice(src);
        self.append_data(env, lba, &block, false)
    }

    /// Make sure `blocks` more data blocks (plus headers and a possible lap
    /// skip) fit before the limit, reclaiming clean space as needed.
    fn ensure_space(&mut self, env: &Env, blocks: u64) -> EngineResult<Space> {
        let headers = blocks / env.record_data_max + 2;
        // The slack keeps room for a lap skip and for an empty epoch-end
        // record, so a flush can always seal even when the log is full of
        // dirty data (write-back needs that epoch end to make progress).
        let needed = blocks + headers + env.record_data_max + 1 + EPOCH_END_RESERVE_BLOCKS;
        let from = match &self.open {
            Some(open) => open.start + 1 + open.data_count(),
            None => self.head,
        };
        for _ in 0..4 {
            if from + needed <= self.limit() {
                return Ok(Space::Ready);
            }
            let target = from + needed - self.n;
            // 1. Evict clean slots up to the persisted write-back position.
            self.evict_until(env, target);
            if from + needed <= self.limit() {
                return Ok(Space::Ready);
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
        if from + needed <= self.limit() {
            Ok(Space::Ready)
        } else {
            Ok(Space::NeedWriteback)
        }
    }

    /// Advance the tail towards `target`, evicting clean blocks, but never
    /// past the persisted write-back position (dirty data stays).
    fn evict_until(&mut self, env: &Env, target: u64) {
        while self.tail < target && self.tail < self.wb_persisted {
            let slot = self.phys(self.tail);
            if self.slots.is_live(slot) {
                assert!(!self.slot_is_dirty(slot), "tail passed dirty data");
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
    }

    /// Seal the open record into the log (one vectored write, no barrier).
    /// With `epoch_end`, also seals an empty record if there is nothing open
    /// but earlier records of this epoch exist.
    fn seal(&mut self, env: &Env, epoch_end: bool) -> EngineResult<()> {
        self.seal_with(env, epoch_end, false)
    }

    /// Seal; with `barrier`, the write and the barrier go down together (one
    /// system call on io_uring).
    fn seal_with(&mut self, env: &Env, epoch_end: bool, barrier: bool) -> EngineResult<()> {
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
                    self.evict_until(env, start + 1 - self.n);
                }
                assert!(start < self.limit(), "no room for an epoch-end record");
                self.head = start;
                OpenRecord {
                    start,
                    entries: Vec::new(),
                    data_entry: Vec::new(),
                    data: Vec::new(),
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
            flags: if epoch_end {
                cairn_format::RECORD_FLAG_EPOCH_END
            } else {
                0
            },
            entries: open.entries.clone(),
        };
        let (hbuf, hcrc) = header.encode(env.bs as u32);
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
        let bufs: &[&[u8]] = if open.data.is_empty() {
            &[&hbuf]
        } else {
            &[&hbuf, &open.data]
        };
        let result = if barrier {
            env.cache.write_vectored_and_flush(at, bufs)
        } else {
            env.cache.write_vectored_at(at, bufs)
        };
        if let Err(e) = result {
            self.open = Some(open);
            return Err(self.fail(env, "sealing a log record", e));
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
        self.sb.sequence += 1;
        let buf = self.sb.encode();
        let at = SUPERBLOCK_OFFSETS[Superblock::copy_index(self.sb.sequence)];
        self.write_durably(env, at, &buf, "the superblock")?;
        Counters::add(&env.counters.superblock_writes, 1);
        Ok(())
    }

    /// Write metadata and make it durable (write, then one barrier).
    fn write_durably(&mut self, env: &Env, at: u64, buf: &[u8], what: &str) -> EngineResult<()> {
        if let Err(e) = env.cache.write_vectored_and_flush(at, &[buf]) {
            return Err(self.fail(env, &format!("writing {what}"), e));
        }
        Counters::add(&env.counters.cache_bytes_written, buf.len() as u64);
        Counters::add(&env.counters.cache_barriers, 1);
        Ok(())
    }

    fn persist_writeback(&mut self, env: &Env) -> EngineResult<()> {
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
        let mut entries = Vec::with_capacity((self.dirty_blocks + self.clean_blocks) as usize);
        for slot in 0..self.n as u32 {
            if self.slots.is_live(slot) {
                entries.push(CheckpointEntry {
                    slot,
                    lba: self.slots.lba(slot),
                    crc: self.slots.crc(slot),
                    state: self.slots.state(slot) & state::PERSISTED,
                });
            }
        }
        assert_eq!(entries.len() as u64, self.dirty_blocks + self.clean_blocks);
        let ranges = self.ranges.to_pending();
        let payload_len =
            CheckpointHeader::payload_bytes(entries.len() as u64, ranges.len() as u32) as usize;
        let total = cairn_format::align_up(
            (CHECKPOINT_HEADER_BYTES + payload_len) as u64,
            env.bs as u64,
        ) as usize;
        assert!(total as u64 <= env.layout.checkpoint_slot_bytes);
        let mut buf = vec![0u8; total];
        {
            let mut w = Writer::new(&mut buf[CHECKPOINT_HEADER_BYTES..]);
            for e in &entries {
                e.encode(&mut w);
            }
            for r in &ranges {
                r.encode(&mut w);
            }
        }
        let payload_crc =
            crc32c::crc32c(&buf[CHECKPOINT_HEADER_BYTES..CHECKPOINT_HEADER_BYTES + payload_len]);
        let header = CheckpointHeader {
            sequence: self.sb.checkpoint_sequence + 1,
            generation: self.sb.generation,
            head_offset: self.head,
            next_record_sequence: self.next_seq,
            prev_crc: self.prev_crc,
            tail_offset: self.tail,
            writeback_offset: self.wb,
            durable_sequence: self.durable_seq,
            entry_count: entries.len() as u64,
            range_count: ranges.len() as u32,
            payload_crc,
        };
        buf[..CHECKPOINT_HEADER_BYTES].copy_from_slice(&header.encode());
        let target = 1 - self.sb.active_checkpoint;
        let at = env.layout.checkpoint_offset_bytes(target);
        self.write_durably(env, at, &buf, "a checkpoint")?;
        self.sb.active_checkpoint = target;
        self.sb.checkpoint_sequence = header.sequence;
        self.sb.writeback_offset = self.wb;
        self.write_superblock(env)?;
        self.wb_persisted = self.wb;
        self.ckpt_head = self.head;
        Counters::add(&env.counters.checkpoints, 1);
        Ok(())
    }
}
