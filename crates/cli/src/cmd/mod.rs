//! One module per command; here, what they share: opening the devices and
//! the engine, progress bars, and running an admin request online or
//! offline.

pub mod check;
pub mod completions;
pub mod connection_args;
pub mod demo;
pub mod flush;
pub mod format;
pub mod manpages;
pub mod mode;
mod policy_args;
pub mod serve;
pub mod set;
pub mod status;
pub mod top;
pub mod volume;
pub mod warm;

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use cairn_device::{Device, OpenMode};
use cairn_engine::{Engine, EngineConfig, OpenOptions};
use indicatif::{ProgressBar, ProgressStyle};

use crate::admin::exec::{execute, Target};
use crate::admin::{client, AdminReply, AdminRequest};
pub use crate::devices::{open_cache, open_origin, open_origin_with};

/// The policy settings stored in the cache's volume table (`cairn set`),
/// read before the engine opens (it opens with one of them).
pub fn read_stored_settings(cache_path: &Path) -> Result<cairn_engine::StoredSettings> {
    let cache = open_cache(cache_path, OpenMode::Shared)?;
    Ok(first_volume(cache.as_ref())?.settings)
}

/// The origin recorded in the volume table, as something we can open.
fn recorded_origin(cache: &dyn Device) -> Result<String> {
    let volume = first_volume(cache)?;
    Ok(cairn_device::spec_of_identity(&volume.origin_identity).to_string())
}

/// The cache's first volume, as its volume table records it.
fn first_volume(cache: &dyn Device) -> Result<cairn_engine::VolumeEntry> {
    let table = Engine::read_volume_table(cache)?;
    table
        .volumes()
        .first()
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("cache {}: its volume table lists no volume", cache.name()))
}

pub fn open_engine(cache_path: &Path, origin: Option<&str>, force: bool) -> Result<Arc<Engine>> {
    open_engine_with(cache_path, origin, force, EngineConfig::default())
}

pub fn open_engine_with(
    cache_path: &Path,
    origin: Option<&str>,
    force: bool,
    config: EngineConfig,
) -> Result<Arc<Engine>> {
    let cache = open_cache(cache_path, OpenMode::Exclusive)?;
    let origin_spec = match origin {
        Some(o) => o.to_string(),
        None => recorded_origin(cache.as_ref())?,
    };
    crate::devices::refuse_same_file(cache_path, &origin_spec)?;
    let origin = open_origin_with(&origin_spec, Some(config.origin_queue_depth))?;
    tracing::info!(
        cache_backend = cache.backend(),
        origin_backend = origin.backend(),
        page_cache_reads = config.page_cache_reads,
        "devices opened"
    );
    let queue_depth = config.origin_queue_depth;
    let opts = OpenOptions {
        force_origin: force,
        config,
    };
    // The first volume's origin is the one named (or recorded); every
    // other volume's is opened from the identity its table entry records.
    let mut resolve = |volume: &cairn_engine::VolumeEntry| {
        if volume.id == 0 {
            return Ok(origin.clone());
        }
        let spec = cairn_device::spec_of_identity(&volume.origin_identity);
        open_origin_with(spec, Some(queue_depth)).map_err(|e| {
            cairn_engine::EngineError::VolumeOriginOpen {
                name: volume.name.clone(),
                origin: volume.origin_identity.clone(),
                detail: format!("{e:#}"),
            }
        })
    };
    Ok(Arc::new(Engine::open_volumes(cache, &mut resolve, &opts)?))
}

/// Run `request` on `cache`: through the daemon serving it if one answers,
/// else on the devices opened here. Both run `admin::exec::execute`; every
/// reply before the final `Ok` goes to `on_reply`. Offline, a request that
/// only reads (`status`, `volume list`) is answered from the cache device
/// alone, opened read-only, with no origin (`status_offline`).
pub fn run_request(
    cache: &Path,
    request: &AdminRequest,
    mut on_reply: impl FnMut(AdminReply),
) -> Result<()> {
    if let Some(answer) = client::ask_daemon(cache, request, &mut on_reply) {
        return Ok(answer?);
    }
    if let Some(reply) = crate::status_offline::answer(cache, request)? {
        on_reply(reply);
        return Ok(());
    }
    let engine = open_engine(cache, None, false)?;
    let target = Target {
        engine: &engine,
        cache,
        served: false,
        server: None,
        latency: None,
        settings: None,
        exports: None,
    };
    let result = execute(&target, request, &mut on_reply);
    // Closed after a failure too, as the daemon would keep serving; the
    // request's own error is the one reported.
    let closed = engine.close();
    result?;
    Ok(closed?)
}

/// A progress bar (drawn only on a terminal) fed by `Progress` replies.
pub struct Progress(ProgressBar);

impl Progress {
    pub fn new(what: &str) -> Progress {
        let pb = ProgressBar::new(0);
        pb.set_style(
            ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({eta})")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        pb.set_message(what.to_string());
        Progress(pb)
    }

    pub fn set(&self, done: u64, total: u64) {
        self.0.set_length(total);
        self.0.set_position(done);
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}
