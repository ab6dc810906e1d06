//! The engine proper: write path, read path, flush, write-back, checkpoints.

use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cairn_device::{BufPool, Device, PooledBuf};
use cairn_format::{
    block_checksum, record_data_blocks_max, CheckpointHeader, Layout, RecordEntry, RecordHeader,
    Superblock, ORIGIN_BLOCKS_MAX, SUPERBLOCK_OFFSETS,
};

use crate::error::{EngineError, EngineResult};
use crate::index::{remove_mapping, state, ForwardMap, SlotTable};
use crate::inflight::{Queued, RecordIo};
use crate::policy::{CacheMode, HitFilter, SequentialDetector};
use crate::ranges::RangeMap;
use crate::stats::{Counters, StatsSnapshot};
use crate::tags::TagTable;

#[derive(Debug, Clone)]
pub struct FormatOptions {
    pub block_size_bytes: u32,
    /// Overwrite an existing cairn cache.
    pub force: bool,
    /// Keep an integrity tag for every origin block (`FEATURE_INTEGRITY`).
    pub integrity: bool,
}

impl Default for FormatOptions {
    fn default() -> Self {
        FormatOptions {
            block_size_bytes: 4096,
            force: false,
            integrity: false,
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
    /// A failed cache write is tried this many times in all (when retrying
    /// it is safe, see `docs/design.md`) before the engine goes degraded.
    pub cache_write_attempts: u32,
    /// Wait before the first retry of a failed cache write, doubled before
    /// each further one. Zero in the simulation tests.
    pub cache_write_backoff_us: u64,
    /// Read cache hits through the host's page cache
    /// ([`Device::read_many_cacheable`]), so the hottest blocks are served
    /// from RAM the kernel can take back under memory pressure. Every read
    /// is still verified against its checksum, and a mismatch is re-read
    /// from the device itself before anything is called corrupt.
    pub page_cache_reads: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            promote_read_misses: true,
            unsynced_blocks_max: 4096,
            promote_after_misses: 1,
            sequential_cutoff_bytes: 4 << 20,
            cache_write_attempts: 4,
            cache_write_backoff_us: 5_000,
            page_cache_reads: true,
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
    /// `chain_seed(uuid)`: stamped on every record of this format.
    pub format_tag: u32,
    /// Origin integrity tags are kept (`Inner::tags` is `Some`).
    pub integrity: bool,
    /// Where barriers wait for sealed records written outside the lock.
    pub record_io: RecordIo,
    /// Reused record buffers.
    pub record_bufs: Arc<BufPool>,
    /// One-block buffers for record headers: without them every flush
    /// mapped and unmapped a page (a TLB shootdown across the daemon's
    /// threads per fsync'd write).
    pub header_bufs: Arc<BufPool>,
}

impl Env {
    /// Read whole origin blocks from block `lba`, counting a failure.
    pub(crate) fn read_origin(&self, lba: u64, buf: &mut [u8]) -> EngineResult<()> {
        self.origin.read_at(lba * self.bs as u64, buf).map_err(|e| {
            Counters::add(&self.counters.origin_read_errors, 1);
            EngineError::Origin(e)
        })
    }

    /// Read cache hits (slot contents the caller verifies afterwards), from
    /// the page cache when the configuration allows.
    pub(crate) fn read_cache_hits(
        &self,
        requests: &mut [(u64, &mut [u8])],
    ) -> Result<(), cairn_device::DeviceError> {
        if self.config.page_cache_reads {
            self.cache.read_many_cacheable(requests)
        } else {
            self.cache.read_many(requests)
        }
    }
}

/// The record being filled in memory. Its header goes at logical offset
/// `start`, its data blocks right after.
pub(crate) struct OpenRecord {
    pub start: u64,
    pub entries: Vec<RecordEntry>,
    /// Entry index of each data block, in data order.
    pub data_entry: Vec<u16>,
    /// Page aligned, so the record is written without a bounce copy.
    pub data: PooledBuf,
    pub capacity_data: u64,
    pub has_dirty: bool,
}

impl OpenRecord {
    pub(crate) fn data_count(&self) -> u64 {
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
    /// Records sealed without a barrier whose write may not be complete,
    /// in sequence order (see `inflight.rs`).
    pub sealed: VecDeque<Queued>,
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
    /// The engine is stopped: every request fails until restart.
    pub failed: Option<String>,
    /// Origin integrity tags, with integrity on.
    pub tags: Option<crate::tags::TagTable>,
    /// A cache write failed for good (after its retries). Nothing more may
    /// be written to the cache; `Engine::degrade` must run before any
    /// request proceeds.
    pub degrade_pending: Option<String>,
    /// Degraded mode: every dirty block was written back, the DEGRADED flag
    /// is durable in the superblock, and writes go straight to the origin.
    /// The cache device is never written again.
    pub degraded: bool,
}

pub(crate) enum Space {
    Ready,
    NeedWriteback,
}

/// How one block of a read request is served.
pub(crate) enum Plan {
    Done,
    Cache {
        slot: u32,
        crc: u32,
    },
    /// Read from the origin; with integrity on, verify against `tag` (the
    /// tag when the read was planned).
    Miss {
        tag: Option<u32>,
    },
}

pub struct Engine {
    pub(crate) env: Env,
    pub(crate) inner: Mutex<Inner>,
    pub(crate) writeback_lock: Mutex<()>,
    pub(crate) paused: AtomicBool,
    /// Set while write-back to the origin keeps failing; the last error is
    /// kept for status.
    pub(crate) origin_failing: AtomicBool,
    pub(crate) origin_last_error: Mutex<Option<String>>,
    pub(crate) mode: AtomicU8,
    pub(crate) sequential: SequentialDetector,
    pub(crate) hit_filter: HitFilter,
    /// Mirrors `Inner::degraded` so requests pick their path without the
    /// lock; the lock re-checks it.
    pub(crate) degraded: AtomicBool,
    /// Serialises degraded-mode writes, zeroes and discards: a partial
    /// block is read, patched and written whole, and two of those on the
    /// same block must not interleave.
    pub(crate) degraded_write_lock: Mutex<()>,
}

pub(crate) const SPACE_RETRIES_MAX: usize = 100_000;
/// Blocks always kept free for an empty epoch-end record (plus a lap skip).
pub(crate) const EPOCH_END_RESERVE_BLOCKS: u64 = 3;

impl Engine {
    // ----------------------------------------------------------------- setup

    /// Format `cache` for `origin`. Refuses to overwrite an existing cairn
    /// cache unless `opts.force`.
    pub fn format(
        cache: Arc<dyn Device>,
        origin: Arc<dyn Device>,
        opts: &FormatOptions,
    ) -> EngineResult<Superblock> {
        cairn_format::crc32c_self_test().map_err(EngineError::ChecksumImplementation)?;
        if !opts.force {
            if let Ok(sb) = Self::read_superblock(cache.as_ref()) {
                return Err(EngineError::AlreadyFormatted {
                    device: cache.name().to_string(),
                    origin: sb.origin_identity,
                });
            }
        }
        let bs = opts.block_size_bytes;
        check_origin_size(origin.as_ref(), bs)?;
        let origin_blocks = origin.size_bytes() / bs as u64;
        let layout = Layout::compute_with_tags(
            cache.size_bytes(),
            bs,
            opts.integrity.then_some(origin_blocks),
        )
        .map_err(|layout| EngineError::Layout {
            device: cache.name().to_string(),
            layout,
        })?;
        let uuid: [u8; 16] = rand::random();
        if opts.integrity {
            // Every tag starts unset; recalculation fills them in from the
            // origin's present contents.
            let counters = Counters::default();
            let mut tags = TagTable::new_unset(origin_blocks, layout.tag_pages, chain_seed(&uuid));
            tags.write_all(cache.as_ref(), &layout, &counters)
                .map_err(EngineError::Cache)?;
        }
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
            payload_crc: cairn_format::crc32c(&[]),
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
            features: if opts.integrity {
                cairn_format::FEATURE_INTEGRITY
            } else {
                0
            },
            recalc_position_blocks: 0,
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
        cairn_format::crc32c_self_test().map_err(EngineError::ChecksumImplementation)?;
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
        let integrity = sb.features & cairn_format::FEATURE_INTEGRITY != 0;
        let volume_blocks = sb.origin_size_bytes / bs as u64;
        let layout =
            Layout::compute_with_tags(sb.cache_size_bytes, bs, integrity.then_some(volume_blocks))
                .map_err(|layout| EngineError::Layout {
                    device: cache.name().to_string(),
                    layout,
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
            volume_blocks,
            config: opts.config.clone(),
            record_data_max: record_data_blocks_max(bs) as u64,
            entries_max: RecordHeader::entries_max(bs),
            format_tag: chain_seed(&sb.uuid),
            integrity,
            record_io: RecordIo::default(),
            record_bufs: Arc::new(BufPool::new(
                record_data_blocks_max(bs) as usize * bs as usize,
            )),
            header_bufs: Arc::new(BufPool::new(bs as usize)),
        };
        let mode = CacheMode::from_code(sb.mode).ok_or_else(|| EngineError::CheckpointDamaged {
            device: env.cache.name().to_string(),
            detail: format!("unknown cache mode code {} in the superblock", sb.mode),
        })?;
        if sb.degraded() {
            // The cache's contents may be older than the origin: nothing is
            // replayed, nothing is read from it, nothing is written to it.
            tracing::error!(
                "cache {} is DEGRADED: a cache write failed for good earlier, every dirty block was written back and writes went straight to the origin since, so the cached data may be stale and is never used. Serving the origin directly; every write is acknowledged once durable there. To cache again, fix or replace the cache device, stop cairn and run: cairn format --force --cache {} --origin {}",
                env.cache.name(),
                env.cache.name(),
                sb.origin_identity
            );
            let inner = Inner::degraded_empty(sb, layout.log_blocks);
            return Ok(Self::assemble(env, inner, mode, true));
        }
        let mut inner = crate::recovery::recover(&env, sb)?;
        if env.integrity {
            let (tags, lost_pages) = TagTable::load(
                env.cache.as_ref(),
                &env.layout,
                env.volume_blocks,
                env.format_tag,
                inner.sb.recalc_position_blocks,
            )
            .map_err(EngineError::Cache)?;
            let mut tags = tags;
            if let Some(&first) = lost_pages.first() {
                // Both copies unreadable: those tags are gone. Recompute
                // them from the origin rather than refuse the whole cache.
                let from = first * cairn_format::TAGS_PER_PAGE as u64;
                tracing::error!(
                    pages = lost_pages.len(),
                    first_block = from,
                    "integrity tag pages unreadable in both copies; their blocks are recalculated from the origin"
                );
                Counters::add(&env.counters.tag_pages_lost, lost_pages.len() as u64);
                tags.recalc_pos = tags.recalc_pos.min(from);
                inner.sb.recalc_position_blocks = tags.recalc_pos;
            }
            inner.tags = Some(tags);
            inner.heal_clean_copy_tags(&env);
        }
        if opts.force_origin && inner.sb.origin_identity != env.origin.identity() {
            let mut identity = env.origin.identity();
            identity.truncate(cairn_format::ORIGIN_IDENTITY_MAX_BYTES);
            inner.sb.origin_identity = identity;
        }
        // Bump the generation and make everything replayed durable before
        // anything new is written.
        inner.sb.generation += 1;
        // A failure here refuses the open (nothing new was written yet).
        inner.write_superblock(&env)?;
        inner.durable_seq = inner.next_seq - 1;
        Ok(Self::assemble(env, inner, mode, false))
    }

    fn assemble(env: Env, inner: Inner, mode: CacheMode, degraded: bool) -> Engine {
        assert_eq!(inner.degraded, degraded);
        Engine {
            env,
            inner: Mutex::new(inner),
            writeback_lock: Mutex::new(()),
            paused: AtomicBool::new(false),
            origin_failing: AtomicBool::new(false),
            origin_last_error: Mutex::new(None),
            mode: AtomicU8::new(mode.code()),
            sequential: SequentialDetector::default(),
            hit_filter: HitFilter::default(),
            degraded: AtomicBool::new(degraded),
            degraded_write_lock: Mutex::new(()),
        }
    }

    /// The index, for the normal (cache-writing) paths. Fails if the engine
    /// stopped, and with `DegradeRequired` once a cache write failed for
    /// good or the engine went degraded: the caller's request is then
    /// re-run on the degraded path by `with_degrade`.
    pub(crate) fn lock(&self) -> EngineResult<MutexGuard<'_, Inner>> {
        let guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reason) = &guard.failed {
            return Err(EngineError::Failed(reason.clone()));
        }
        if guard.degrade_pending.is_some() || guard.degraded {
            return Err(EngineError::DegradeRequired);
        }
        Ok(guard)
    }

    /// The index, for paths valid in every state but stopped (reads,
    /// checks, degraded writes). They never write the cache device when it
    /// is degraded or about to be.
    pub(crate) fn lock_index(&self) -> EngineResult<MutexGuard<'_, Inner>> {
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

    pub(crate) fn check_range(&self, offset: u64, length_bytes: u64) -> EngineResult<()> {
        match offset.checked_add(length_bytes) {
            Some(end) if end <= self.size_bytes() => Ok(()),
            _ => Err(EngineError::OutOfRange {
                offset,
                length_bytes,
                size_bytes: self.size_bytes(),
            }),
        }
    }

    // ---------------------------------------------------------------- status

    pub fn stats(&self) -> StatsSnapshot {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let mut s = StatsSnapshot::default();
        self.env.counters.fill(&mut s);
        s.dirty_blocks = inner.dirty_blocks;
        s.clean_blocks = inner.clean_blocks;
        s.corrupt_blocks = inner.corrupt_blocks;
        s.lost_blocks = inner.lost.len() as u64;
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
        // A degraded cache keeps no tags (see `degrade.rs`).
        s.integrity = self.env.integrity && inner.tags.is_some();
        if let Some(tags) = &inner.tags {
            s.tag_algorithm = "crc32c(lba_le64 || block)";
            s.recalc_position_blocks = tags.recalc_pos;
            s.recalc_total_blocks = tags.origin_blocks();
            s.tag_pages_dirty = tags.dirty_pages();
            s.tag_memory_bytes = tags.memory_bytes() as u64;
        }
        s.degraded = inner.degraded;
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
                let inner = self.lock_index()?;
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
                    let inner = self.lock_index()?;
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
    cairn_format::crc32c(uuid)
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
    pub(crate) fn limit(&self) -> u64 {
        self.tail.min(self.ckpt_head) + self.n
    }

    pub fn slot_is_dirty(&self, slot: u32) -> bool {
        let st = self.slots.state(slot);
        st & state::LIVE != 0 && st & state::CLEAN_INSERT == 0 && self.logical_of(slot) >= self.wb
    }

    /// A cache write failed for good (its retries, if any, are spent; the
    /// errors were counted). No further cache write may happen: the next
    /// request switches the engine to degraded mode (`Engine::degrade`).
    pub(crate) fn fail(
        &mut self,
        _env: &Env,
        what: &str,
        e: cairn_device::DeviceError,
    ) -> EngineError {
        let reason = format!("{what}: {e}");
        // Degraded mode never writes the cache device.
        assert!(!self.degraded, "cache write in degraded mode: {reason}");
        if self.degrade_pending.is_none() {
            tracing::error!(
                "cache device write failed for good ({reason}); switching to degraded mode"
            );
            self.degrade_pending = Some(reason);
        }
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

    /// After recovery: a clean copy inserted from an origin read holds what
    /// the origin held then, and the origin has not changed since (a later
    /// write would have replaced the copy in the index). Its tag may still
    /// be the pre-crash one if the write-back that produced that origin data
    /// had not persisted its tags: that write-back is redone later, but
    /// until then the tag must already describe the origin. So the tag is
    /// set from the copy's checksum. Nothing is trusted that was not
    /// verified: the copy's crc came from a verified origin read.
    pub(crate) fn heal_clean_copy_tags(&mut self, env: &Env) {
        let Some(tags) = self.tags.as_mut() else {
            return;
        };
        let zeroes = vec![0u8; env.bs];
        let mut healed = 0u64;
        for slot in 0..self.n as u32 {
            let st = self.slots.state(slot);
            if st & state::LIVE == 0 || st & state::CLEAN_INSERT == 0 || st & state::CORRUPT != 0 {
                continue;
            }
            let lba = self.slots.lba(slot);
            let crc = self.slots.crc(slot);
            let expected = cairn_format::fold_tag(crc);
            let tag = tags.get(lba);
            let agrees = tag == expected
                || (tag == cairn_format::TAG_ZERO && block_checksum(lba, &zeroes) == crc);
            if !agrees {
                tags.set(lba, expected);
                healed += 1;
            }
        }
        if healed > 0 {
            tracing::info!(
                blocks = healed,
                "integrity tags brought up to date from clean cached copies after recovery"
            );
        }
    }

    pub(crate) fn open_slot_index(&self, slot: u32) -> Option<usize> {
        let open = self.open.as_ref()?;
        let logical = self.logical_of(slot);
        if logical > open.start && logical <= open.start + open.data_count() {
            Some((logical - open.start - 1) as usize)
        } else {
            None
        }
    }
}
