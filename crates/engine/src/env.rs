//! The context every part of the engine shares: the cache device and the
//! volumes' origins, the cache's geometry, the configuration, the counters, the buffer pools and
//! the engine's health. Fixed at open except for the counters and health.

use std::sync::Arc;

use cairn_device::{Backing, Device, DeviceError, SizeClassPool};
use cairn_format::{
    key_lba, key_volume, record_data_blocks_max, Layout, RecordHeader, Superblock, VolumeEntry,
};

use crate::error::EngineResult;
use crate::health::Health;
use crate::lifetime::LifetimeBase;
use crate::options::EngineConfig;
use crate::origins::Origins;
use crate::sealed::RecordIo;
use crate::sealed::RecordWriters;
use crate::stats::Counters;
use crate::sync_watch::SyncWatch;
use crate::volume_origin::VolumeOrigin;
use cairn_device::BufPool;

/// Read buffers up to this size are pooled; larger ones come and go.
const READ_BUF_CLASS_MAX_BYTES: usize = 1 << 20;
/// Idle bytes each read buffer size class keeps at most...
const READ_BUF_CLASS_IDLE_BYTES: usize = 1 << 20;
/// ...but at least this many buffers (a queue depth of small reads).
const READ_BUF_CLASS_IDLE_MIN: usize = 4;

pub(crate) struct Env {
    pub(crate) cache: Arc<dyn Device>,
    /// Each volume's origin, found from a block's key.
    pub(crate) origins: Origins,
    pub(crate) layout: Layout,
    /// Shared with the record writer threads.
    pub(crate) counters: Arc<Counters>,
    /// The counters' totals from earlier runs (the checkpoint's).
    pub(crate) lifetime: LifetimeBase,
    pub(crate) block_size_bytes: usize,
    /// The first volume's size in blocks (the single-volume entry points').
    pub(crate) volume_blocks: u64,
    pub(crate) config: EngineConfig,
    /// Most data blocks in one log record.
    pub(crate) record_data_blocks_max: u64,
    /// Most entries (data blocks and ranges) in one record header.
    pub(crate) record_entries_max: usize,
    /// `chain_seed(uuid)`: stamped on every record of this format.
    pub(crate) format_tag: u32,
    /// The cache has a tag area (`State::tags` is `Some` until a degrade
    /// drops them), whether or not a volume keeps tags in it yet.
    pub(crate) integrity: bool,
    pub(crate) health: Health,
    /// Where barriers wait for sealed records written outside the lock.
    pub(crate) record_io: Arc<RecordIo>,
    /// The cache device's syncs in progress, and whether one failed: a
    /// barrier vouches for nothing until the syncs around its own ended.
    pub(crate) syncs: SyncWatch,
    /// Threads that write sealed records for reactor tasks.
    pub(crate) record_writers: RecordWriters,
    /// Reused record buffers.
    pub(crate) record_bufs: Arc<BufPool>,
    /// One-block buffers for record headers: without them every flush
    /// mapped and unmapped a page (a TLB shootdown across the daemon's
    /// threads per fsync'd write).
    pub(crate) header_bufs: Arc<BufPool>,
    /// Buffers reads fill and hand to the caller (an NBD reply goes out of
    /// one without a copy): page aligned for O_DIRECT, by size class.
    pub(crate) read_bufs: SizeClassPool,
    /// Origin reads of misses in flight (`EngineConfig::origin_queue_depth`).
    pub(crate) origin_slots: cairn_io::Semaphore,
}

impl Env {
    /// `first` is volume 0's entry; `origins` holds it and every other
    /// volume served.
    pub(crate) fn new(
        cache: Arc<dyn Device>,
        origins: Vec<VolumeOrigin>,
        layout: Layout,
        superblock: &Superblock,
        first: &VolumeEntry,
        config: EngineConfig,
        health: Health,
    ) -> Env {
        let block_size_bytes = superblock.block_size_bytes;
        let record_data_blocks_max = record_data_blocks_max(block_size_bytes, superblock.features);
        let record_bytes_max = record_data_blocks_max as usize * block_size_bytes as usize;
        let origin_slots = cairn_io::Semaphore::new(config.origin_queue_depth.max(1) as u64);
        Env {
            origin_slots,
            cache,
            origins: Origins::new(origins),
            layout,
            counters: Arc::new(Counters::default()),
            lifetime: LifetimeBase::default(),
            block_size_bytes: block_size_bytes as usize,
            volume_blocks: first.origin_size_bytes / block_size_bytes as u64,
            config,
            record_data_blocks_max: record_data_blocks_max as u64,
            record_entries_max: RecordHeader::entries_max(block_size_bytes),
            format_tag: chain_seed(&superblock.uuid),
            integrity: superblock.features & cairn_format::FEATURE_INTEGRITY != 0,
            health,
            record_io: Arc::new(RecordIo::default()),
            syncs: SyncWatch::default(),
            record_writers: RecordWriters::default(),
            record_bufs: Arc::new(BufPool::with_backing(
                Backing::Mapped,
                record_bytes_max,
                record_bufs_idle_max(record_bytes_max),
            )),
            header_bufs: Arc::new(BufPool::new(block_size_bytes as usize)),
            read_bufs: SizeClassPool::new(
                Backing::Heap,
                4096,
                READ_BUF_CLASS_MAX_BYTES,
                READ_BUF_CLASS_IDLE_BYTES,
                READ_BUF_CLASS_IDLE_MIN,
            ),
        }
    }

    /// Byte offset of a log slot on the cache device.
    pub(crate) fn slot_offset_bytes(&self, slot: u32) -> u64 {
        self.layout.slot_offset_bytes(slot as u64)
    }

    /// Is `key` a block of a volume the engine serves? Keys come from the
    /// device too (records, checkpoints): one outside every volume is
    /// damage.
    pub(crate) fn key_valid(&self, key: u64) -> bool {
        self.origins
            .get(key_volume(key))
            .is_some_and(|v| key_lba(key) < v.blocks)
    }

    /// Are the `count` keys from `key` blocks of one served volume?
    pub(crate) fn keys_valid(&self, key: u64, count: u64) -> bool {
        count > 0
            && key
                .checked_add(count - 1)
                .is_some_and(|last| key_volume(last) == key_volume(key) && self.key_valid(last))
            && self.key_valid(key)
    }

    /// The origin of the volume that byte `offset` of the key space (block
    /// `key` is bytes `key * block_size_bytes..`) falls in, and where that
    /// byte is on the origin. A request never crosses from one volume into
    /// the next, so one answer serves all of it.
    pub(crate) fn origin_of_offset(&self, offset: u64) -> EngineResult<(Arc<VolumeOrigin>, u64)> {
        let block_bytes = self.block_size_bytes as u64;
        let (volume, lba) = self.origins.of_key(offset / block_bytes)?;
        Ok((volume, lba * block_bytes + offset % block_bytes))
    }

    /// Read one cache slot with O_DIRECT (the medium itself, never the page
    /// cache), counting a failure.
    pub(crate) fn read_slot(&self, slot: u32, block: &mut [u8]) -> Result<(), DeviceError> {
        self.cache
            .read_at(self.slot_offset_bytes(slot), block)
            .inspect_err(|_| Counters::add(&self.counters.cache_read_errors, 1))
    }
}

/// The chain value the first record of a freshly formatted log links to.
/// Derived from the uuid so records of an earlier format never match.
pub(crate) fn chain_seed(uuid: &[u8; 16]) -> u32 {
    cairn_format::crc32c(uuid)
}

/// Idle record buffers kept for reuse: 4 MiB of them (16 of 256 KiB, as
/// before large records, or 4 of 1 MiB), and never fewer than 4. With 16
/// idle 1 MiB buffers the W5 daemon (a 4 GiB cache full of 4 KiB blocks)
/// measured 8.37 MiB of RSS per GiB of cache, with this bound 8.09, and the
/// build before large records 8.02 (one run each); a stream of 64 KiB
/// writes keeps about three records in use at once.
fn record_bufs_idle_max(record_bytes_max: usize) -> usize {
    const RECORD_BUFS_IDLE_BYTES: usize = 4 << 20;
    (RECORD_BUFS_IDLE_BYTES / record_bytes_max.max(1)).max(4)
}
