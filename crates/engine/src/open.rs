//! Opening a formatted cache: check it belongs to this origin, upgrade a
//! format 1 cache in place, recover its state, load the integrity tags,
//! and make what was replayed durable. Or, to look at it only
//! ([`inspect`]), the same reading and recovery with no origin and no
//! write.

use std::sync::Arc;

use cairn_device::{ClaimMode, Device};
use cairn_format::{
    origin_identity_for_superblock, Layout, Superblock, SuperblockVolumes, TagArea, VolumeEntry,
    VolumeTable,
};

use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::health::Health;
use crate::index::Index;
use crate::log::{Log, LogPositions, WritebackCursors};
use crate::options::{EngineConfig, OpenOptions};
use crate::policy::CacheMode;
use crate::recovery;
use crate::state::State;
use crate::stats::Counters;
use crate::superblocks::{self, LOG_COUNTER_LIMIT};
use crate::tags::TagTable;
use crate::unopened_origin::UnopenedOrigin;
use crate::upgrade;
use crate::volume_origin::VolumeOrigin;

/// What opening produced.
pub(crate) struct Opened {
    pub(crate) env: Env,
    pub(crate) state: State,
    /// Each volume's mode, by id.
    pub(crate) modes: Vec<(u16, CacheMode)>,
}

/// Finds the origin device of a volume of the table (the caller opens it
/// from the recorded identity, or from what the user named).
pub type OriginResolver<'a> = dyn FnMut(&VolumeEntry) -> EngineResult<Arc<dyn Device>> + 'a;

/// What the cache device alone says, checked: its newest superblock, its
/// volume table, the first volume's entry, the layout and each volume's
/// mode.
struct CacheRead {
    superblock: Superblock,
    volumes: VolumeTable,
    first: VolumeEntry,
    layout: Layout,
    modes: Vec<(u16, CacheMode)>,
}

/// Read and check what every open starts from. Reads only.
fn read_cache(cache: &dyn Device) -> EngineResult<CacheRead> {
    cairn_format::crc32c_self_test().map_err(EngineError::ChecksumImplementation)?;
    let superblock = superblocks::read_newest(cache)?;
    let volumes = superblocks::read_table(cache, &superblock)?;
    let first = first_volume(cache, &volumes)?.clone();
    let layout = check_cache(cache, &superblock, &volumes)?;
    let modes = volumes
        .volumes()
        .iter()
        .map(|volume| Ok((volume.id, mode_of(cache, volume)?)))
        .collect::<EngineResult<Vec<_>>>()?;
    Ok(CacheRead {
        superblock,
        volumes,
        first,
        layout,
        modes,
    })
}

pub(crate) fn open(
    cache: Arc<dyn Device>,
    resolve: &mut OriginResolver<'_>,
    opts: &OpenOptions,
) -> EngineResult<Opened> {
    let read = read_cache(cache.as_ref())?;
    let (superblock, first) = (&read.superblock, &read.first);
    let mut origins = Vec::with_capacity(read.volumes.volumes().len());
    for volume in read.volumes.volumes() {
        let origin = resolve(volume)?;
        // Only the first volume's origin is the one a user may name anew.
        let force = opts.force_origin && volume.id == first.id;
        check_origin(origin.as_ref(), superblock, volume, force)?;
        // A crashed cache's origin may have been claimed by another cache
        // since: replaying this one's log over it would roll it back.
        crate::origin_claims::claim(
            cache.as_ref(),
            origin.as_ref(),
            &superblock.uuid,
            ClaimMode::Open { adopt: force },
        )?;
        origins.push(VolumeOrigin::new(
            volume.id,
            origin,
            volume.origin_size_bytes / superblock.block_size_bytes as u64,
        ));
    }
    let first_id = first.id;
    let env = env_of(cache, origins, &read, opts.config.clone());
    let CacheRead {
        superblock,
        volumes,
        modes,
        ..
    } = read;
    if superblock.degraded() {
        tracing::error!(
            "cache {} is DEGRADED: a cache write failed for good earlier, every dirty block was written back and writes went straight to the origin since, so the cached data may be stale and is never used. Serving origin {} directly; every write is acknowledged once durable there",
            env.cache.name(),
            env.origins.first().device().identity()
        );
        return Ok(open_degraded(env, superblock, volumes, modes));
    }
    let (superblock, volumes) = match &superblock.volumes {
        SuperblockVolumes::V1(v1) => upgrade::upgrade_v1(env.cache.as_ref(), &superblock, v1)?,
        SuperblockVolumes::V2 { .. } => (superblock, volumes),
    };
    let mut state = recover_state(&env, superblock, volumes)?;
    record_new_identities(&env, &mut state, opts.force_origin.then_some(first_id))?;
    // Bump the generation and make everything replayed durable before
    // anything new is written. A failure here refuses the open (nothing
    // new was written yet).
    state.superblock.generation += 1;
    state.write_superblock(&env)?;
    state.log.recovered(state.superblock.generation);
    Ok(Opened { env, state, modes })
}

/// Open `cache` to look at it, changing nothing: no origin is opened
/// (each volume's is an [`UnopenedOrigin`] that refuses every I/O), a
/// format 1 cache is read as the format 2 one its upgrade would make, the
/// log is replayed into memory only, and nothing is written back to the
/// device: no claim, no upgrade, no superblock. The state is exactly what
/// [`open`] would recover, so its figures (dirty blocks and all) are the
/// ones a daemon starting now would show.
pub(crate) fn inspect(cache: Arc<dyn Device>) -> EngineResult<Opened> {
    let read = read_cache(cache.as_ref())?;
    let block_bytes = read.superblock.block_size_bytes as u64;
    let origins = read
        .volumes
        .volumes()
        .iter()
        .map(|volume| {
            VolumeOrigin::new(
                volume.id,
                Arc::new(UnopenedOrigin::of(volume)),
                volume.origin_size_bytes / block_bytes,
            )
        })
        .collect();
    let env = env_of(cache, origins, &read, EngineConfig::default());
    let CacheRead {
        superblock,
        volumes,
        modes,
        ..
    } = read;
    if superblock.degraded() {
        return Ok(open_degraded(env, superblock, volumes, modes));
    }
    let (superblock, volumes) = match &superblock.volumes {
        SuperblockVolumes::V1(v1) => upgrade::upgraded_v1(env.cache.as_ref(), &superblock, v1)?,
        SuperblockVolumes::V2 { .. } => (superblock, volumes),
    };
    let mut state = recover_state(&env, superblock, volumes)?;
    state.log.recovered(state.superblock.generation);
    Ok(Opened { env, state, modes })
}

/// The engine's shared context over `cache` and the volumes' `origins`.
fn env_of(
    cache: Arc<dyn Device>,
    origins: Vec<VolumeOrigin>,
    read: &CacheRead,
    config: EngineConfig,
) -> Env {
    let health = if read.superblock.degraded() {
        Health::degraded()
    } else {
        Health::default()
    };
    Env::new(
        cache,
        origins,
        read.layout,
        &read.superblock,
        &read.first,
        config,
        health,
    )
}

/// Recovery, then the integrity tags: the state every open starts from.
/// Reads the cache device only.
fn recover_state(env: &Env, superblock: Superblock, volumes: VolumeTable) -> EngineResult<State> {
    let mut state = recovery::recover(env, superblock, volumes)?;
    if env.integrity {
        state.tags = Some(load_tags(env, &mut state)?);
    }
    Ok(state)
}

/// How an origin's identity now matches the one recorded (both compared
/// as the table stores them, cut to its limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IdentityMatch {
    Same,
    /// Recorded by its path alone, before a file's identity named its
    /// inode: the path matches, which is all that was checked then.
    PathOnly,
    Different,
}

fn identity_match(recorded: &str, identity: &str) -> IdentityMatch {
    if origin_identity_for_superblock(identity) == recorded {
        IdentityMatch::Same
    } else if cairn_device::identity_without_inode(recorded) == recorded
        && origin_identity_for_superblock(cairn_device::identity_without_inode(identity))
            == recorded
    {
        IdentityMatch::PathOnly
    } else {
        IdentityMatch::Different
    }
}

/// With `--force-origin`, the `forced` volume's origin is the one given
/// now: record its identity if it changed. An origin file recorded by its
/// path alone (formatted before identities named the inode) is only
/// reported: recording its inode unasked would make the cache unopenable
/// by an older cairn, so it takes `--force` once.
fn record_new_identities(env: &Env, state: &mut State, forced: Option<u16>) -> EngineResult<()> {
    let mut volumes = state.volumes.volumes().to_vec();
    let mut changed = false;
    for v in volumes.iter_mut() {
        let Some(origin) = env.origins.get(v.id) else {
            continue;
        };
        let identity = origin.device().identity();
        let recorded = v.origin_identity.as_str();
        let matched = identity_match(recorded, &identity);
        if matched == IdentityMatch::PathOnly && forced != Some(v.id) {
            tracing::warn!(
                volume = v.name.as_str(),
                origin = recorded,
                "this cache knows its origin by path only, so another file or disk put at \
                 that path would not be noticed; `cairn serve --force` once records the file's \
                 inode or the disk's id too (an older cairn then needs --origin PATH --force to \
                 open it)"
            );
        }
        if forced == Some(v.id) && matched != IdentityMatch::Same {
            v.origin_identity = origin_identity_for_superblock(&identity).to_string();
            changed = true;
        }
    }
    if !changed {
        return Ok(());
    }
    let table =
        state
            .volumes
            .with_volumes(volumes)
            .map_err(|e| EngineError::SuperblockInvalid {
                device: env.cache.name().to_string(),
                detail: format!("the volume table with the new origin: {e}"),
            })?;
    state.write_volume_table(env, table)
}

fn mode_of(cache: &dyn Device, volume: &VolumeEntry) -> EngineResult<CacheMode> {
    CacheMode::from_code(volume.mode).ok_or_else(|| EngineError::SuperblockInvalid {
        device: cache.name().to_string(),
        detail: format!(
            "unknown cache mode code {} for volume {:?}",
            volume.mode, volume.name
        ),
    })
}

/// The first volume (id 0): the one format made, which the single-volume
/// entry points serve and the integrity tags cover.
fn first_volume<'a>(cache: &dyn Device, volumes: &'a VolumeTable) -> EngineResult<&'a VolumeEntry> {
    volumes
        .by_id(0)
        .ok_or_else(|| EngineError::SuperblockInvalid {
            device: cache.name().to_string(),
            detail: format!(
                "the volume table lists no volume 0 (ids {:?})",
                volumes.volumes().iter().map(|v| v.id).collect::<Vec<_>>()
            ),
        })
}

/// A volume's origin must be the one it was made for (unless `force`), of
/// the size it had (or grown, if it is known to be the same device), and
/// one `format` accepts for the block size.
fn check_origin(
    origin: &dyn Device,
    superblock: &Superblock,
    volume: &VolumeEntry,
    force: bool,
) -> EngineResult<()> {
    // The table holds the identity as format stored it (cut to the
    // limit), so that is what is compared.
    let identity = origin.identity();
    let matched = identity_match(&volume.origin_identity, &identity);
    if matched == IdentityMatch::Different && !force {
        return Err(EngineError::WrongOrigin {
            recorded: volume.origin_identity.clone(),
            given: origin.identity(),
        });
    }
    let (recorded_bytes, given_bytes) = (volume.origin_size_bytes, origin.size_bytes());
    // The table passed its checksum, but its fields are still device
    // contents: the recorded size gets the checks format made.
    let check_recorded = || {
        crate::format::check_origin_size_bytes(origin, recorded_bytes, superblock.block_size_bytes)
    };
    if given_bytes == recorded_bytes {
        return check_recorded();
    }
    // A shrunk origin would lose the blocks past its end that the cache
    // holds or writes back: never. A grown one holds every block the cache
    // knows, where it was: served at the recorded size, if the origin is
    // known to be the same device (a lasting identity that matches, or
    // the operator's --force); otherwise its size is the only sign that
    // another export or disk now answers to the name.
    // Lasting as recorded (a recorded identity cut to the superblock's
    // limit may have lost its inode or id) and recorded whole, so that
    // `Same` compared all of it.
    let same_device = matched == IdentityMatch::Same
        && origin_identity_for_superblock(&identity) == identity
        && cairn_device::identity_is_lasting(&volume.origin_identity);
    if given_bytes < recorded_bytes || !(same_device || force) {
        return Err(EngineError::OriginSizeChanged {
            origin: origin.name().to_string(),
            recorded_bytes,
            given_bytes,
        });
    }
    check_recorded()?;
    origin.serve_at_recorded_size(recorded_bytes);
    tracing::warn!(
        volume = volume.name.as_str(),
        origin = origin.name(),
        recorded_bytes,
        given_bytes,
        "the origin grew since the cache was formatted; cairn serves the {recorded_bytes} bytes it was formatted for, and the rest is not reachable through it (to use the new size: `cairn flush` to write everything back, stop cairn, then `cairn format --force` the cache)"
    );
    Ok(())
}

/// The cache must be laid out as the superblock says, with a tag area
/// that holds the tags of the volumes with integrity. Returns the layout.
fn check_cache(
    cache: &dyn Device,
    superblock: &Superblock,
    volumes: &VolumeTable,
) -> EngineResult<Layout> {
    if cache.size_bytes() < superblock.cache_size_bytes {
        return Err(EngineError::CacheShrunk {
            device: cache.name().to_string(),
            size_bytes: cache.size_bytes(),
            recorded_bytes: superblock.cache_size_bytes,
        });
    }
    let block_bytes = superblock.block_size_bytes;
    // The superblock passed its checksum, but its fields are still device
    // contents: the counters that only grow must be far from overflowing.
    for (field, value) in [
        ("sequence", superblock.sequence),
        ("generation", superblock.generation),
        ("checkpoint_sequence", superblock.checkpoint_sequence),
        ("writeback_offset", superblock.writeback_offset),
    ] {
        if value >= LOG_COUNTER_LIMIT {
            return Err(EngineError::SuperblockInvalid {
                device: cache.name().to_string(),
                detail: format!("{field} {value} is out of range"),
            });
        }
    }
    let area = tag_area(cache, superblock, volumes)?;
    let layout =
        Layout::compute_with_tag_pages(superblock.cache_size_bytes, block_bytes, area.pages())
            .map_err(|layout| EngineError::Layout {
                device: cache.name().to_string(),
                layout,
            })?;
    if layout.log_blocks != superblock.log_blocks
        || layout.checkpoint_slot_bytes != superblock.checkpoint_slot_bytes
    {
        return Err(EngineError::CheckpointDamaged {
            device: cache.name().to_string(),
            detail: "superblock layout does not match the computed layout".into(),
        });
    }
    // Device contents: a superblock claiming large records over a log too
    // small for them (format never writes one) would make write-back and
    // eviction wait for room that never comes.
    if superblock.features & cairn_format::FEATURE_LARGE_RECORDS != 0
        && !layout.holds_large_records()
    {
        return Err(EngineError::SuperblockInvalid {
            device: cache.name().to_string(),
            detail: format!(
                "it claims records of up to 1 MiB, but its log of {} blocks is too small for them",
                layout.log_blocks
            ),
        });
    }
    Ok(layout)
}

/// A cache whose DEGRADED flag is set: its contents may be older than the
/// origin, so nothing is replayed, nothing is read from it, nothing is
/// written to it. The engine serves the origin directly.
fn open_degraded(
    env: Env,
    superblock: Superblock,
    volumes: VolumeTable,
    modes: Vec<(u16, CacheMode)>,
) -> Opened {
    assert!(superblock.degraded());
    let slot_count = env.layout.log_blocks;
    let log = Log::new(
        slot_count,
        superblock.generation,
        LogPositions {
            tail: 0,
            writeback: WritebackCursors::new(
                &volumes
                    .volumes()
                    .iter()
                    .map(|v| (v.id, 0))
                    .collect::<Vec<_>>(),
            ),
            writeback_limit: 0,
            head: 0,
            checkpoint_head: 0,
            next_sequence: 1,
            prev_crc: 0,
            durable_sequence: 0,
        },
    );
    let state = State {
        superblock,
        volumes,
        log,
        index: Index::new(slot_count),
        tags: None,
    };
    Opened { env, state, modes }
}

/// Load every integrity tag. Pages unreadable in both copies are
/// recalculated from the origin rather than refusing the whole cache.
fn load_tags(env: &Env, state: &mut State) -> EngineResult<TagTable> {
    let area = tag_area(env.cache.as_ref(), &state.superblock, &state.volumes)?;
    let block_bytes = env.block_size_bytes as u64;
    let table = &state.volumes;
    let superblock = &state.superblock;
    let (mut tags, lost) = TagTable::load(
        env.cache.as_ref(),
        &env.layout,
        &area,
        env.format_tag,
        |id| {
            table
                .by_id(id)
                .map_or(0, |v| v.origin_size_bytes / block_bytes)
        },
        |id| superblocks::recalc_position(superblock, id),
    )
    .map_err(EngineError::Cache)?;
    for pages in lost {
        let from = pages.first_page * cairn_format::TAGS_PER_PAGE as u64;
        tracing::error!(
            volume_id = pages.volume_id,
            pages = pages.count,
            first_block = from,
            "integrity tag pages unreadable in both copies; their blocks are recalculated from the origin"
        );
        Counters::add(&env.counters.tag_pages_lost, pages.count);
        let volume = tags.volume_mut(pages.volume_id).expect("loaded volume");
        volume.recalc_pos = volume.recalc_pos.min(from);
        let at = volume.recalc_pos;
        superblocks::set_recalc_position(&mut state.superblock, pages.volume_id, at);
    }
    let healed = tags.heal_from_clean_copies(state.index.clean_copies(), env.block_size_bytes);
    if healed > 0 {
        tracing::info!(
            blocks = healed,
            "integrity tags brought up to date from clean cached copies after recovery"
        );
    }
    Ok(tags)
}

/// The tag area the superblock and the table describe, checked (both are
/// device contents).
fn tag_area(
    cache: &dyn Device,
    superblock: &Superblock,
    volumes: &VolumeTable,
) -> EngineResult<TagArea> {
    let invalid = |detail: String| EngineError::SuperblockInvalid {
        device: cache.name().to_string(),
        detail,
    };
    let area =
        TagArea::of(superblock.features, volumes, superblock.block_size_bytes).map_err(|e| {
            invalid(format!(
                "the integrity tag area does not fit the volume table: {e}"
            ))
        })?;
    // Both copies must fit the cache: a larger count is damage (and the
    // layout's sums must not be fed one).
    let pages_max = superblock.cache_size_bytes / (2 * cairn_format::TAG_PAGE_BYTES as u64);
    if area.pages() > pages_max {
        return Err(invalid(format!(
            "a tag area of {} pages does not fit a cache of {} bytes",
            area.pages(),
            superblock.cache_size_bytes
        )));
    }
    Ok(area)
}

#[cfg(test)]
mod tests {
    use super::{identity_match, IdentityMatch};
    use cairn_format::ORIGIN_IDENTITY_MAX_BYTES;

    #[test]
    fn an_origin_file_matches_by_inode_or_by_path_only_when_recorded_so() {
        let now = "file:/srv/o.img#ino=5";
        assert_eq!(identity_match(now, now), IdentityMatch::Same);
        // Recorded before identities named the inode: the path decides.
        assert_eq!(
            identity_match("file:/srv/o.img", now),
            IdentityMatch::PathOnly
        );
        // Another file at the same path.
        assert_eq!(
            identity_match("file:/srv/o.img#ino=4", now),
            IdentityMatch::Different
        );
        assert_eq!(
            identity_match("file:/srv/other.img", now),
            IdentityMatch::Different
        );
        assert_eq!(
            identity_match("nbd+unix:///?socket=/s", "nbd+unix:///?socket=/t"),
            IdentityMatch::Different
        );
        // A path-only identity near the table's limit, whose inode the
        // limit would cut in half, still matches by its path.
        let path = format!("file:/{}", "p".repeat(ORIGIN_IDENTITY_MAX_BYTES - 8));
        assert!(path.len() < ORIGIN_IDENTITY_MAX_BYTES);
        let with_inode = format!("{path}#ino=123456");
        assert!(with_inode.len() > ORIGIN_IDENTITY_MAX_BYTES);
        assert_eq!(identity_match(&path, &with_inode), IdentityMatch::PathOnly);
    }
}
