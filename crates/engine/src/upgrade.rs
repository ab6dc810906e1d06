//! Upgrading a format 1 cache to format 2 in place, crash-safely.
//!
//! Format 1 leaves bytes 8 KiB..64 KiB unused, and format 2 keeps every
//! other structure (log, checkpoints, tag pages) as it was, so the upgrade
//! only adds the volume table and rewrites the superblocks:
//!
//! 1. the table (volume 0 = the v1 origin) into copy 1, then a barrier; no
//!    superblock names it yet, so a crash leaves the v1 cache as it was;
//! 2. a v2 superblock with the next sequence into the copy holding the
//!    older v1 superblock, then a barrier. Once durable it is the newest
//!    valid copy and the cache is v2; torn, the newer v1 copy still wins;
//! 3. a v2 superblock into the other copy, then a barrier, so no v1
//!    superblock is left for an older build to fall back to. Torn, the v2
//!    copy of step 2 wins.
//!
//! A crash at any point leaves a valid v1 or a valid v2 cache holding the
//! same data. A degraded v1 cache is not upgraded: degraded mode writes
//! nothing to the cache (it is served from the v1 superblock as it is).

use cairn_device::Device;
use cairn_format::{
    OriginV1, Superblock, SuperblockVolumes, VolumePosition, VolumeTable, SUPERBLOCK_OFFSETS,
};

use crate::error::{EngineError, EngineResult};
use crate::superblocks;

/// Upgrade `superblock` (format 1, describing `origin`, not degraded) and
/// the cache it came from to format 2. Returns the new superblock and its
/// table.
pub(crate) fn upgrade_v1(
    cache: &dyn Device,
    superblock: &Superblock,
    origin: &OriginV1,
) -> EngineResult<(Superblock, VolumeTable)> {
    assert!(!superblock.degraded(), "a degraded cache is never written");
    let (mut upgraded, table) = upgraded_v1(cache, superblock, origin)?;
    assert_eq!(VolumeTable::copy_for(table.sequence), 1);
    superblocks::write_table(cache, &table).map_err(EngineError::Cache)?;
    for _ in 0..2 {
        upgraded.sequence += 1;
        let at = SUPERBLOCK_OFFSETS[Superblock::copy_index(upgraded.sequence)];
        cache
            .write_vectored_and_flush(at, &[&upgraded.encode()])
            .map_err(EngineError::Cache)?;
    }
    tracing::info!(
        cache = cache.name(),
        "upgraded the cache from format 1 to format 2 (a volume table; the log and checkpoints are unchanged)"
    );
    Ok((upgraded, table))
}

/// The format 2 superblock (before its sequence is bumped for writing)
/// and volume table that `superblock` (format 1, describing `origin`)
/// upgrades to, in memory only: what an upgrade writes, and what an
/// inspection of a format 1 cache reads it as without writing.
pub(crate) fn upgraded_v1(
    cache: &dyn Device,
    superblock: &Superblock,
    origin: &OriginV1,
) -> EngineResult<(Superblock, VolumeTable)> {
    assert_eq!(superblock.volumes, SuperblockVolumes::V1(origin.clone()));
    let table = superblocks::table_of_v1(cache, superblock, origin, 1)?;
    let mut upgraded = superblock.clone();
    upgraded.volumes = SuperblockVolumes::V2 {
        table_sequence: table.sequence,
        positions: vec![VolumePosition {
            id: 0,
            writeback_offset: superblock.writeback_offset,
            recalc_position_blocks: origin.recalc_position_blocks,
        }],
    };
    Ok((upgraded, table))
}
