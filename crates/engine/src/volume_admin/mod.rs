//! Adding a volume to a cache that is open: a new origin, its own NBD
//! export name, blocks named by keys with its id.
//!
//! The change is one volume table write: the table with the new entry
//! into the copy the superblock does not name, a barrier, then the
//! superblock that names it and holds the new volume's positions (see
//! `State::write_volume_table`). A crash before that superblock is durable
//! leaves the cache as it was; nothing of the new volume is in the log
//! until requests reach it, which they do only once the call returns.

mod entry_change;
mod tag_extent;

pub(crate) use entry_change::{changed, check_dirty_share, id_of, set_dirty_share};
use entry_change::{entry_of, next_table};

use std::sync::Arc;

use cairn_device::{ClaimMode, Device};
use cairn_format::{
    origin_identity_for_superblock, SuperblockVolumes, VolumeEntry, VolumePosition, VolumeState,
    VolumeTable,
};

use crate::error::{EngineError, EngineResult};
use crate::parts::Parts;
use crate::policy::CacheMode;
use crate::volume_origin::VolumeOrigin;

/// What a new volume is: its name (the NBD export name), mode, whether it
/// keeps integrity tags, and its share of the log for dirty data.
#[derive(Debug, Clone)]
pub struct NewVolume {
    pub name: String,
    pub mode: CacheMode,
    pub integrity: bool,
    /// Percent of the log its dirty data may hold while other volumes use
    /// the cache (1..=100); `None` for the default (half with two
    /// volumes, less with more: see `write/dirty_share.rs`).
    pub dirty_share_pct: Option<u8>,
}

/// Add a volume on `origin`. Returns its entry as written.
pub(crate) fn add(
    p: Parts<'_>,
    origin: Arc<dyn Device>,
    new: &NewVolume,
) -> EngineResult<VolumeEntry> {
    let env = p.env;
    let invalid = |detail: String| EngineError::InvalidVolume {
        device: env.cache.name().to_string(),
        detail,
    };
    check_dirty_share(env, new.dirty_share_pct)?;
    crate::format::check_origin_size(origin.as_ref(), env.block_size_bytes as u32)?;
    let blocks = origin.size_bytes() / env.block_size_bytes as u64;
    let identity = origin_identity_for_superblock(&origin.identity()).to_string();
    // What can be refused at once is, before any tag page is written.
    let uuid = {
        let st = p.state.normal(env)?;
        check_unique(&st.volumes, &new.name, &identity)?;
        st.superblock.uuid
    };
    // Without the engine lock: the origin may be remote and slow.
    crate::origin_claims::claim(
        env.cache.as_ref(),
        origin.as_ref(),
        &uuid,
        ClaimMode::AddVolume,
    )?;
    // Its tag pages are written without the lock (see `tag_extent`); the
    // reservation is released when it drops, after `st` (declared later).
    let (mut tags, reserved) = match new.integrity {
        true => {
            let (tags, reserved) = tag_extent::fresh_tags(p, blocks)?;
            (Some(tags), Some(reserved))
        }
        false => (None, None),
    };
    let mut st = p.state.normal(env)?;
    let table = &st.volumes;
    check_unique(table, &new.name, &identity)?;
    let id = table.free_id().ok_or(EngineError::TooManyVolumes {
        max: cairn_format::VOLUMES_MAX,
    })?;
    let entry = VolumeEntry {
        id,
        state: VolumeState::Active,
        name: new.name.clone(),
        origin_identity: identity,
        origin_size_bytes: origin.size_bytes(),
        mode: new.mode.code(),
        integrity: tags.is_some(),
        dirty_share_pct: new.dirty_share_pct,
        settings: Default::default(),
        tag_first_page: tags.as_ref().map_or(0, |t| t.first_page),
    };
    if let Some(tags) = tags.as_mut() {
        tag_extent::claim(p, st.superblock.features, table, tags)?;
        tags.volume_id = id;
    }
    let mut volumes = table.volumes().to_vec();
    volumes.push(entry.clone());
    let next = table
        .with_volumes(volumes)
        .map_err(|e| invalid(e.to_string()))?;
    // The volume has nothing in the log yet: its write-back starts at the
    // last durable epoch end, past every record of a removed volume that
    // had its id.
    let at = st.log.add_volume(id);
    let SuperblockVolumes::V2 { positions, .. } = &mut st.superblock.volumes else {
        // Only a degraded format 1 cache keeps a v1 superblock, and the
        // normal path refused it above.
        unreachable!("a cache taking writes is format 2");
    };
    positions.push(VolumePosition {
        id,
        writeback_offset: at,
        recalc_position_blocks: 0,
    });
    if let Err(e) = st.write_volume_table(env, next) {
        if let SuperblockVolumes::V2 { positions, .. } = &mut st.superblock.volumes {
            positions.retain(|p| p.id != id);
        }
        st.log.remove_volume(id);
        return Err(e);
    }
    if let (Some(table), Some(volume)) = (st.tags.as_mut(), tags) {
        // Both copies were written: copy 0 is as new as copy 1.
        table.insert_fresh(volume, 0);
    }
    if let Some(reserved) = reserved {
        reserved.release(&mut st);
    }
    start_serving(p, origin, &entry, new.mode);
    Ok(entry)
}

/// After its table is written: the new volume's write-back, health,
/// policy and origin start from nothing left by a removed volume that had
/// its id.
fn start_serving(p: Parts<'_>, origin: Arc<dyn Device>, entry: &VolumeEntry, mode: CacheMode) {
    let id = entry.id;
    p.writeback.forget_volume(id);
    p.env.health.set_origin_failing(id, false);
    p.env.health.set_origin_fenced(id, false);
    p.policy.set_mode_of(id, mode);
    p.env.origins.insert(VolumeOrigin::new(
        id,
        origin,
        entry.origin_size_bytes / p.env.block_size_bytes as u64,
    ));
    tracing::info!(
        volume = entry.name,
        id,
        origin = entry.origin_identity,
        "volume added"
    );
}

/// A new volume's name and origin must be no other volume's: two volumes
/// writing back to one origin would overwrite each other.
fn check_unique(table: &VolumeTable, name: &str, identity: &str) -> EngineResult<()> {
    if let Some(existing) = table.by_name(name) {
        return Err(EngineError::VolumeExists {
            name: existing.name.clone(),
        });
    }
    if let Some(existing) = table
        .volumes()
        .iter()
        .find(|v| v.origin_identity == identity)
    {
        return Err(EngineError::OriginInUse {
            origin: identity.to_string(),
            name: existing.name.clone(),
        });
    }
    Ok(())
}

/// First step of removing volume `name`: take no new request for it and
/// let nothing new of it into the log (requests already past the entry
/// points fail when they append). Returns its entry and origin; the
/// caller drains write-back, then calls [`forget`], or [`reopen`] if the
/// drain failed. (Write-back still reaches its origin meanwhile.)
pub(crate) fn close(p: Parts<'_>, name: &str) -> EngineResult<VolumeEntry> {
    let env = p.env;
    // A degraded cache writes no new table.
    let st = p.state.normal(env)?;
    let entry = removable(&st.volumes, name)?;
    if env.origins.get(entry.id).is_none() {
        return Err(EngineError::NoSuchVolume {
            volume_id: entry.id,
        });
    }
    env.origins.set_taking(entry.id, false);
    drop(st);
    Ok(entry)
}

/// Volume `name` of `table`, if it may be removed (the first volume stays).
pub(crate) fn removable(table: &VolumeTable, name: &str) -> EngineResult<VolumeEntry> {
    let entry = entry_of(table, name)?;
    if entry.id == 0 {
        return Err(EngineError::FirstVolumeKept { name: name.into() });
    }
    Ok(entry)
}

/// Undo [`close`] after a failed drain: the volume is served again.
pub(crate) fn reopen(p: Parts<'_>, entry: &VolumeEntry) {
    p.env.origins.set_taking(entry.id, true);
}

/// Last step of removing a volume, once write-back drained it: drop its
/// cached copies, write a checkpoint (replay starts after it, so no record
/// of the volume is read again, and its id may be given to another), then
/// the table without it. A crash before the table is durable leaves the
/// volume in the table with nothing cached (its origin holds all of it);
/// `volume remove` is simply run again.
pub(crate) fn forget(p: Parts<'_>, entry: &VolumeEntry) -> EngineResult<()> {
    let (origin, uuid) = forget_locked(p, entry)?;
    // Every block is on the origin and the volume is gone from the table:
    // another cache may have the origin now. Without the engine lock (the
    // origin may be remote and slow).
    if let Some(origin) = origin {
        crate::origin_claims::release(origin.device(), &uuid);
    }
    Ok(())
}

/// [`forget`]'s steps under the locks. Returns the volume's origin and the
/// cache's uuid, for releasing its claim.
fn forget_locked(
    p: Parts<'_>,
    entry: &VolumeEntry,
) -> EngineResult<(Option<Arc<VolumeOrigin>>, [u8; 16])> {
    let env = p.env;
    // A background step of the volume may still run (the durable log grew
    // since the drain, so it looked behind), and so may a recalculation or
    // scrub step that read its origin: each must end before its position,
    // its origin, its tags and, once reused, its id go. The exclusive lock
    // waits for all of them (a step of any volume holds it shared).
    let _exclusive = p.writeback.lock();
    let mut st = p.state.normal(env)?;
    let st = &mut *st;
    let blocks = st.index.volume_blocks(entry.id);
    if blocks.dirty > 0 {
        // Write-back did not reach everything (its origin failed meanwhile).
        return Err(EngineError::VolumeNotDrained {
            name: entry.name.clone(),
            dirty_blocks: blocks.dirty,
        });
    }
    let first = cairn_format::block_key(entry.id, 0);
    let end = first + cairn_format::ORIGIN_BLOCKS_MAX + 1;
    // Blocks whose only copy failed its checksum read as EIO: dropped with
    // the volume they would silently become the origin's older data. (So
    // every block forgotten below is clean: if a later step fails and the
    // volume is served again, its origin holds what they held.)
    let unreadable = st.index.unreadable_in(first, end);
    if unreadable > 0 {
        return Err(EngineError::VolumeHasLostBlocks {
            name: entry.name.clone(),
            blocks: unreadable,
        });
    }
    st.index.forget_range(first, end);
    crate::checkpoint::write(env, st)?;
    let volumes: Vec<VolumeEntry> = st
        .volumes
        .volumes()
        .iter()
        .filter(|v| v.id != entry.id)
        .cloned()
        .collect();
    let next = next_table(env, &st.volumes, volumes)?;
    let SuperblockVolumes::V2 { positions, .. } = &mut st.superblock.volumes else {
        unreachable!("a cache taking writes is format 2");
    };
    let kept = positions
        .iter()
        .position(|p| p.id == entry.id)
        .map(|i| positions.remove(i));
    if let Err(e) = st.write_volume_table(env, next) {
        if let (Some(position), SuperblockVolumes::V2 { positions, .. }) =
            (kept, &mut st.superblock.volumes)
        {
            positions.push(position);
        }
        return Err(e);
    }
    st.log.remove_volume(entry.id);
    if let Some(tags) = st.tags.as_mut() {
        // Its extent is free in the new table; the pages stay as they are
        // until an add writes them whole again.
        tags.remove_volume(entry.id);
    }
    p.writeback.forget_volume(entry.id);
    p.env.health.set_origin_failing(entry.id, false);
    p.env.health.set_origin_fenced(entry.id, false);
    let origin = env.origins.remove(entry.id);
    p.policy.set_mode_of(entry.id, CacheMode::WriteBack);
    tracing::info!(volume = entry.name, id = entry.id, "volume removed");
    Ok((origin, st.superblock.uuid))
}

#[cfg(test)]
mod tests;
