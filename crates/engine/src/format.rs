//! Formatting a cache device for an origin.

use std::sync::Arc;

use cairn_device::{ClaimMode, Device, OriginClaim};
use cairn_format::{
    origin_identity_for_superblock, tag_pages_for, CheckpointHeader, Layout, Superblock,
    SuperblockVolumes, TagExtent, VolumeEntry, VolumePosition, VolumeState, VolumeTable,
    ORIGIN_BLOCKS_MAX,
};

use crate::env::chain_seed;
use crate::error::{EngineError, EngineResult};
use crate::options::FormatOptions;
use crate::stats::Counters;
use crate::superblocks;
use crate::tags::TagTable;
use crate::volume_tags::VolumeTags;

/// Format `cache` for `origin`. Refuses to overwrite an existing cairn
/// cache unless `opts.force`.
pub(crate) fn format(
    cache: Arc<dyn Device>,
    origin: Arc<dyn Device>,
    opts: &FormatOptions,
) -> EngineResult<Superblock> {
    cairn_format::crc32c_self_test().map_err(EngineError::ChecksumImplementation)?;
    // The cache this format replaces, whose claim on the origin (if it
    // held one) passes to the new cache.
    let replaced = superblocks::read_newest(cache.as_ref()).ok();
    if !opts.force {
        refuse_formatted(cache.as_ref(), replaced.as_ref())?;
    }
    let block_bytes = opts.block_size_bytes;
    check_origin_size(origin.as_ref(), block_bytes)?;
    let origin_blocks = origin.size_bytes() / block_bytes as u64;
    let first_pages = if opts.integrity {
        tag_pages_for(origin_blocks)
    } else {
        0
    };
    let reserve_pages = tag_pages_for(opts.integrity_reserve_bytes / block_bytes as u64);
    let layout = Layout::compute_with_tag_pages(
        cache.size_bytes(),
        block_bytes,
        first_pages + reserve_pages,
    )
    .map_err(|layout| EngineError::Layout {
        device: cache.name().to_string(),
        layout,
    })?;
    let uuid: [u8; 16] = rand::random();
    // Before anything is written: a refused claim leaves the device as it
    // was.
    crate::origin_claims::claim(
        cache.as_ref(),
        origin.as_ref(),
        &uuid,
        ClaimMode::Format {
            replaces: replaced.map(|s| OriginClaim::format_uuid(&s.uuid)),
        },
    )?;
    // With a reserve the area is shared out in extents, the first
    // volume's (if any) from page 0.
    let extents = reserve_pages > 0;
    let tag_area_pages = if extents { layout.tag_pages } else { 0 };
    if opts.integrity {
        // Every tag starts unset; recalculation fills them in from the
        // origin's present contents.
        let extent = TagExtent {
            volume_id: 0,
            first_page: 0,
            pages: first_pages,
        };
        TagTable::empty(chain_seed(&uuid))
            .add_fresh(
                cache.as_ref(),
                &layout,
                VolumeTags::new_unset(extent, origin_blocks),
                &[0],
                &Counters::default(),
            )
            .map_err(EngineError::Cache)?;
    }
    write_empty_checkpoint(cache.as_ref(), &layout, &uuid)?;
    let table = first_volume_table(cache.as_ref(), origin.as_ref(), opts, uuid, tag_area_pages)?;
    superblocks::write_table(cache.as_ref(), &table).map_err(EngineError::Cache)?;
    let mut superblock = Superblock {
        sequence: 1,
        uuid,
        block_size_bytes: block_bytes,
        cache_size_bytes: cache.size_bytes(),
        log_blocks: layout.log_blocks,
        checkpoint_slot_bytes: layout.checkpoint_slot_bytes,
        generation: 1,
        active_checkpoint: 0,
        checkpoint_sequence: 1,
        writeback_offset: 0,
        features: features_for(&layout, extents),
        volumes: SuperblockVolumes::V2 {
            table_sequence: table.sequence,
            positions: vec![VolumePosition {
                id: 0,
                writeback_offset: 0,
                recalc_position_blocks: 0,
            }],
        },
    };
    superblocks::write_both(cache.as_ref(), &mut superblock).map_err(EngineError::Cache)?;
    Ok(superblock)
}

/// The superblock's feature bits for a cache of `layout`. Records are large
/// wherever the log holds enough of them; tiny caches keep 256 KiB records,
/// whose reserve for the next record is a quarter of the size.
fn features_for(layout: &Layout, tag_extents: bool) -> u32 {
    let tags = match (layout.tag_pages > 0, tag_extents) {
        (false, _) => 0,
        (true, false) => cairn_format::FEATURE_INTEGRITY,
        (true, true) => cairn_format::FEATURE_INTEGRITY | cairn_format::FEATURE_TAG_EXTENTS,
    };
    let records = if layout.holds_large_records() {
        cairn_format::FEATURE_LARGE_RECORDS
    } else {
        0
    };
    tags | records
}

/// Refuses a device that already holds a cairn cache, naming the origin
/// the cache is for.
fn refuse_formatted(cache: &dyn Device, existing: Option<&Superblock>) -> EngineResult<()> {
    let Some(existing) = existing else {
        return refuse_known_contents(cache);
    };
    let origin = superblocks::read_table(cache, existing)
        .ok()
        .and_then(|t| t.volumes().first().map(|v| v.origin_identity.clone()))
        .unwrap_or_else(|| "an unreadable volume table".into());
    Err(EngineError::AlreadyFormatted {
        device: cache.name().to_string(),
        origin,
    })
}

/// A device with no cairn superblock may still hold a filesystem, a
/// volume manager's or a partition table's data, or a cairn cache whose
/// superblocks are damaged (its dirty data may exist nowhere else).
fn refuse_known_contents(cache: &dyn Device) -> EngineResult<()> {
    match superblocks::existing_contents(cache)? {
        None => Ok(()),
        Some(what) => Err(EngineError::HoldsData {
            device: cache.name().to_string(),
            what,
        }),
    }
}

/// The table of a new cache: volume 0, in write-back mode with serve's
/// default settings.
fn first_volume_table(
    cache: &dyn Device,
    origin: &dyn Device,
    opts: &FormatOptions,
    uuid: [u8; 16],
    tag_area_pages: u64,
) -> EngineResult<VolumeTable> {
    let volume = VolumeEntry {
        id: 0,
        state: VolumeState::Active,
        name: opts.volume_name.clone(),
        // Cut at a character boundary: `String::truncate` panics inside one.
        origin_identity: origin_identity_for_superblock(&origin.identity()).to_string(),
        origin_size_bytes: origin.size_bytes(),
        mode: 0,
        integrity: opts.integrity,
        dirty_share_pct: None,
        settings: Default::default(),
        tag_first_page: 0,
    };
    VolumeTable::new_with_tag_area(1, uuid, tag_area_pages, vec![volume]).map_err(|e| {
        EngineError::InvalidVolume {
            device: cache.name().to_string(),
            detail: e.to_string(),
        }
    })
}

/// Checkpoint 1 in slot 0: an empty index, an empty log.
fn write_empty_checkpoint(
    cache: &dyn Device,
    layout: &Layout,
    uuid: &[u8; 16],
) -> EngineResult<()> {
    let checkpoint = CheckpointHeader {
        sequence: 1,
        generation: 1,
        head_offset: 0,
        next_record_sequence: 1,
        prev_crc: chain_seed(uuid),
        tail_offset: 0,
        writeback_offset: 0,
        durable_sequence: 0,
        entry_count: 0,
        range_count: 0,
        payload_crc: cairn_format::crc32c(&[]),
        lost_count: 0,
    };
    cache
        .write_at(layout.checkpoint_offset_bytes(0), &checkpoint.encode())
        .map_err(EngineError::Cache)?;
    cache.flush().map_err(EngineError::Cache)
}

pub(crate) fn check_origin_size(origin: &dyn Device, block_bytes: u32) -> EngineResult<()> {
    check_origin_size_bytes(origin, origin.size_bytes(), block_bytes)
}

/// [`check_origin_size`] for `size` bytes of `origin` (the size recorded
/// at format, for an origin that grew since).
pub(crate) fn check_origin_size_bytes(
    origin: &dyn Device,
    size: u64,
    block_bytes: u32,
) -> EngineResult<()> {
    if size == 0 || !size.is_multiple_of(block_bytes as u64) {
        return Err(EngineError::OriginSizeUnaligned {
            origin: origin.name().to_string(),
            size_bytes: size,
            block_size_bytes: block_bytes,
        });
    }
    let max_bytes = (ORIGIN_BLOCKS_MAX + 1).saturating_mul(block_bytes as u64);
    if size / block_bytes as u64 > ORIGIN_BLOCKS_MAX + 1 {
        return Err(EngineError::OriginTooLarge {
            origin: origin.name().to_string(),
            size_bytes: size,
            max_bytes,
            block_size_bytes: block_bytes,
        });
    }
    Ok(())
}
