//! What each admin request does to an engine. The daemon runs it for a
//! client and sends the replies over the socket; with no daemon, the CLI
//! opens the devices and runs the very same code, handling the replies
//! itself. So online and offline are one algorithm with two transports.

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use cairn_engine::{CacheMode, Engine, EngineError, NewVolume, ScrubOptions, StoredSettings};

use super::command_error::CommandError;
use super::{AdminReply, AdminRequest, SettingsChange};
use crate::settings::{EffectiveSettings, SharedSettings};
use crate::volume_exports::VolumeExports;

/// The least time between two progress replies: a line per block would
/// cost more than the work it reports.
pub const PROGRESS_INTERVAL_MS: u64 = 200;

/// The engine a request runs on, and what the replies need to know about it.
pub struct Target<'a> {
    pub engine: &'a Engine,
    /// The cache path as the user named it, for messages.
    pub cache: &'a Path,
    /// Whether a daemon serves this engine (the `served` status field).
    pub served: bool,
    /// The NBD server's counters, when a daemon serves it.
    pub server: Option<cairn_nbd::ServerStats>,
    /// Request latency histograms (JSON), when a daemon serves it.
    pub latency: Option<serde_json::Value>,
    /// The daemon's settings in force, when a daemon serves it.
    pub settings: Option<SharedSettings>,
    /// Where a volume added while serving is exported.
    pub exports: Option<VolumeExports<'a>>,
}

/// Run `request`, sending every reply but the final `Ok`/`Error` to `emit`.
pub fn execute(
    target: &Target,
    request: &AdminRequest,
    emit: &mut dyn FnMut(AdminReply),
) -> Result<(), CommandError> {
    let engine = target.engine;
    match request {
        AdminRequest::Status => {
            let mut status = crate::status::status_json(
                &engine.stats(),
                &engine.superblock(),
                &engine.volume(),
                target.served,
                target.server.as_ref(),
                target.latency.clone(),
                settings_now(target).to_json(),
            );
            if let (serde_json::Value::Object(m), AdminReply::Volumes { volumes }) =
                (&mut status, volumes_reply(target))
            {
                m.insert("volumes".into(), volumes);
            }
            emit(AdminReply::Status { status });
        }
        AdminRequest::Flush => {
            let mut progress = Throttle::default();
            let p = engine.drain_with_progress(|p| progress.drain(p, emit))?;
            emit(drained(engine, p.blocks_written));
        }
        AdminRequest::Mode { mode } => {
            let mut progress = Throttle::default();
            let p = engine.set_mode(*mode, |p| progress.drain(p, emit))?;
            emit(drained(engine, p.blocks_written));
        }
        AdminRequest::Check => {
            let mut progress = Throttle::default();
            let bad = engine.check(|done, total| progress.step(done, total, emit))?;
            let bs = engine.block_size_bytes() as u64;
            for lba in bad {
                emit(AdminReply::BadBlock {
                    lba,
                    offset_bytes: lba * bs,
                });
            }
        }
        AdminRequest::CheckOrigin {
            rate_bytes_per_s,
            repair,
        } => check_origin(target, *rate_bytes_per_s, *repair, emit)?,
        AdminRequest::Warm {
            offset_bytes,
            length_bytes,
        } => {
            check_range(*offset_bytes, *length_bytes, engine.size_bytes())?;
            let cached_blocks = warm(engine, *offset_bytes, *length_bytes)?;
            emit(AdminReply::Warmed { cached_blocks });
        }
        AdminRequest::Set { change } => set(target, change, emit)?,
        AdminRequest::VolumeAdd {
            name,
            origin,
            mode,
            integrity,
            dirty_share_pct,
        } => {
            let new = NewVolume {
                name: name.clone(),
                mode: *mode,
                integrity: *integrity,
                dirty_share_pct: *dirty_share_pct,
            };
            add_volume(target, origin, &new)?;
            emit(volumes_reply(target));
        }
        AdminRequest::VolumeSet {
            name,
            mode,
            dirty_share_pct,
        } => set_volume(target, name, *mode, *dirty_share_pct, emit)?,
        AdminRequest::VolumeList => emit(volumes_reply(target)),
        AdminRequest::VolumeRemove { name, force } => {
            remove_volume(target, name, *force)?;
            emit(volumes_reply(target));
        }
    }
    Ok(())
}

/// `cairn volume set`: the dirty share (0: the default), then the mode
/// (leaving write-back drains the volume, with progress).
fn set_volume(
    target: &Target,
    name: &str,
    mode: Option<CacheMode>,
    dirty_share_pct: Option<u8>,
    emit: &mut dyn FnMut(AdminReply),
) -> Result<(), CommandError> {
    let engine = target.engine;
    if let Some(pct) = dirty_share_pct {
        engine.set_volume_dirty_share(name, (pct != 0).then_some(pct))?;
    }
    if let Some(mode) = mode {
        let mut progress = Throttle::default();
        let p = engine.set_volume_mode(name, mode, |p| progress.drain(p, emit))?;
        emit(drained(engine, p.blocks_written));
    }
    emit(volumes_reply(target));
    Ok(())
}

/// `cairn volume add`: open the origin here (the daemon, when served),
/// add the volume, and export it at once when served.
fn add_volume(target: &Target, origin: &str, new: &NewVolume) -> Result<(), CommandError> {
    // What the engine would refuse anyway, asked before the origin is
    // opened: another volume's origin is open (and locked) here already,
    // and the lock's message would hide the real reason.
    let table = target.engine.volume_table();
    if let Some(v) = table.by_name(&new.name) {
        return Err(EngineError::VolumeExists {
            name: v.name.clone(),
        }
        .into());
    }
    let given =
        std::fs::canonicalize(origin).map_or(origin.to_string(), |p| p.display().to_string());
    if let Some(v) = table
        .volumes()
        .iter()
        .find(|v| cairn_device::spec_of_identity(&v.origin_identity) == given)
    {
        return Err(EngineError::OriginInUse {
            origin: v.origin_identity.clone(),
            name: v.name.clone(),
        }
        .into());
    }
    let device = crate::devices::open_origin(origin)
        .map_err(|e| CommandError::VolumeOrigin(format!("{e:#}")))?;
    let entry = target.engine.add_volume(device, new)?;
    if let Some(exports) = &target.exports {
        exports
            .add(&entry)
            .map_err(|e| CommandError::Export(format!("{e:#}")))?;
    }
    Ok(())
}

/// `cairn volume remove`: while served, stop exporting the volume first
/// (refused while clients use it, unless `force`), so no request reaches
/// it during the drain; then drain and drop it. If that fails, the volume
/// is exported again.
fn remove_volume(target: &Target, name: &str, force: bool) -> Result<(), CommandError> {
    let entry = target.engine.removable_volume(name)?;
    let Some(exports) = &target.exports else {
        target.engine.remove_volume(name)?;
        return Ok(());
    };
    exports.exports.remove(name, force).map_err(|e| match e {
        cairn_nbd::ExportsError::Busy { connections, .. } => CommandError::VolumeInUse {
            name: name.into(),
            connections,
        },
        other => CommandError::Export(other.to_string()),
    })?;
    if let Err(e) = target.engine.remove_volume(name) {
        if let Err(again) = exports.add(&entry) {
            tracing::error!("volume {name:?} could not be removed, nor exported again: {again:#}");
        }
        return Err(e.into());
    }
    Ok(())
}

fn volumes_reply(target: &Target) -> AdminReply {
    let served = target.exports.as_ref().map(|e| e.exports.list());
    AdminReply::Volumes {
        volumes: crate::status::volumes_json(
            &target.engine.volumes_status(),
            target.engine.block_size_bytes(),
            served.as_deref(),
        ),
    }
}

/// The settings in force: the daemon's, or (offline) the stored ones over
/// the defaults.
fn settings_now(target: &Target) -> EffectiveSettings {
    match &target.settings {
        Some(shared) => shared.get(),
        None => {
            EffectiveSettings::resolve(&StoredSettings::default(), &target.engine.stored_settings())
        }
    }
}

/// `cairn set`: store the change; while serving, apply it at once (the
/// page-cache setting only at the next start: the engine opens with it).
fn set(
    target: &Target,
    change: &SettingsChange,
    emit: &mut dyn FnMut(AdminReply),
) -> Result<(), CommandError> {
    let engine = target.engine;
    let stored = change
        .apply(&engine.stored_settings())
        .map_err(CommandError::BadSettings)?;
    let mut restart_needed = Vec::new();
    // While serving: what runs from now on, checked before anything is
    // stored. This run's flags stay unless the change names them; the
    // engine opened with the page-cache setting, which stays as it runs.
    let live = match &target.settings {
        Some(shared) => {
            let running = shared.get();
            let named = change.names();
            let mut flags = running.flags_except(&named);
            flags.page_cache_reads = running.values.page_cache_reads;
            let mut now = EffectiveSettings::resolve(&flags, &stored);
            now.sources[6] = running.sources[6];
            if named.contains(&"page_cache_reads")
                && stored.page_cache_reads != running.values.page_cache_reads
            {
                restart_needed.push("page_cache_reads".to_string());
            }
            now.check().map_err(CommandError::BadSettings)?;
            Some((shared, now))
        }
        None => None,
    };
    engine.store_settings(stored)?;
    if let Some((shared, now)) = live {
        engine.set_read_policy(now.sequential_cutoff_bytes(), now.promote_after_misses());
        shared.set(now);
    }
    emit(AdminReply::SettingsStored {
        settings: settings_now(target).to_json(),
        restart_needed,
    });
    Ok(())
}

fn drained(engine: &Engine, blocks_written: u64) -> AdminReply {
    // Dirty blocks whose data failed its checksum cannot be written back.
    let s = engine.stats();
    AdminReply::Drained {
        blocks_written,
        unrecoverable_blocks: s.corrupt_blocks + s.lost_blocks,
    }
}

fn check_origin(
    target: &Target,
    rate_bytes_per_s: u64,
    repair: bool,
    emit: &mut dyn FnMut(AdminReply),
) -> Result<(), CommandError> {
    let engine = target.engine;
    if !engine.integrity() {
        return Err(CommandError::NoIntegrity {
            cache: target.cache.display().to_string(),
        });
    }
    let opts = ScrubOptions {
        repair,
        rate_bytes_per_s: (rate_bytes_per_s > 0).then_some(rate_bytes_per_s),
    };
    let mut progress = Throttle::default();
    let report = engine.scrub_origin(&opts, |done, total| progress.step(done, total, emit))?;
    let bs = engine.block_size_bytes() as u64;
    // The report names blocks by key: the volume and its address.
    let table = engine.volume_table();
    let place = |key: u64| {
        let volume = table
            .by_id(cairn_format::key_volume(key))
            .map_or_else(String::new, |v| v.name.clone());
        let lba = cairn_format::key_lba(key);
        (volume, lba, lba * bs)
    };
    let cached: HashSet<u64> = report.mismatches_cached.iter().copied().collect();
    for &key in &report.mismatches {
        let (volume, lba, offset_bytes) = place(key);
        emit(AdminReply::OriginMismatch {
            volume,
            lba,
            offset_bytes,
            cached_copy: cached.contains(&key),
        });
    }
    for &key in &report.repaired {
        let (volume, lba, offset_bytes) = place(key);
        emit(AdminReply::OriginRepaired {
            volume,
            lba,
            offset_bytes,
        });
    }
    emit(AdminReply::Scrubbed {
        blocks_checked: report.blocks_checked,
        blocks_verified: report.blocks_verified,
        blocks_unverified: report.blocks_unverified,
        blocks_discarded: report.blocks_discarded,
        blocks_skipped: report.blocks_skipped,
    });
    Ok(())
}

/// A range given to `warm` must lie within the volume, like NBD CACHE
/// (EINVAL past the end): clipping it would report success for blocks
/// that do not exist. An empty range must still start inside.
fn check_range(offset_bytes: u64, length_bytes: u64, size_bytes: u64) -> Result<(), CommandError> {
    let inside = offset_bytes < size_bytes
        && offset_bytes
            .checked_add(length_bytes)
            .is_some_and(|end| end <= size_bytes);
    if inside {
        Ok(())
    } else {
        Err(CommandError::RangePastEnd {
            offset_bytes,
            length_bytes,
            size_bytes,
        })
    }
}

/// Read a range so its blocks are promoted into the cache (`cairn warm`).
/// Returns the blocks of the range now cached.
pub fn warm(engine: &Engine, offset_bytes: u64, length_bytes: u64) -> Result<u64, EngineError> {
    crate::export::prefetch(engine, 0, offset_bytes, length_bytes)?;
    let end = offset_bytes
        .saturating_add(length_bytes)
        .min(engine.size_bytes());
    let bs = engine.block_size_bytes() as u64;
    Ok((offset_bytes / bs..end.div_ceil(bs))
        .filter(|&b| engine.is_cached(b))
        .count() as u64)
}

/// Emits a progress reply at most every [`PROGRESS_INTERVAL_MS`], plus the
/// first and the last.
#[derive(Default)]
struct Throttle {
    last: Option<Instant>,
}

impl Throttle {
    fn step(&mut self, done: u64, total: u64, emit: &mut dyn FnMut(AdminReply)) {
        let due = match self.last {
            None => true,
            Some(t) => t.elapsed() >= Duration::from_millis(PROGRESS_INTERVAL_MS),
        };
        if due || done >= total {
            self.last = Some(Instant::now());
            emit(AdminReply::Progress { done, total });
        }
    }

    /// Write-back progress: blocks written out of written plus still dirty.
    fn drain(&mut self, p: &cairn_engine::WritebackProgress, emit: &mut dyn FnMut(AdminReply)) {
        self.step(p.blocks_written, p.blocks_written + p.dirty_blocks, emit);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A warm range must lie within the volume: one that only runs past
    /// the end is refused like one that starts past it, not clipped.
    #[test]
    fn warm_ranges_past_the_end_are_refused() {
        let size = 64 * MIB;
        assert!(check_range(0, size, size).is_ok());
        assert!(check_range(63 * MIB, MIB, size).is_ok());
        assert!(check_range(4 * MIB, 0, size).is_ok());
        for (offset, length) in [
            (63 * MIB, 4 * MIB),
            (200 * MIB, MIB),
            (size, 0),
            (MIB, u64::MAX),
        ] {
            let e = check_range(offset, length, size).expect_err("past the end");
            assert_eq!(
                e.to_string(),
                format!("range of {length} bytes at offset {offset} runs past the end of the 67108864-byte volume")
            );
        }
        let advice = crate::advice::for_command(&check_range(63 * MIB, 4 * MIB, size).unwrap_err());
        assert_eq!(
            advice.as_deref(),
            Some("to warm up to the end of the volume, give 66060288:1048576")
        );
    }
}
