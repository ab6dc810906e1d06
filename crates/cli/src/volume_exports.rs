//! The engine's volumes as the NBD server's exports: one export per
//! volume, named as the volume, added at start and when `volume add`
//! runs while serving.

use std::sync::Arc;

use anyhow::{Context, Result};
use cairn_engine::{CacheMode, Engine, VolumeEntry};
use cairn_nbd::{ExportOptions, Exports};

use crate::export::{EngineExport, Latencies};

/// What serving a new volume needs: the server's exports, the engine and
/// the latency histograms its requests feed.
#[derive(Clone, Copy)]
pub struct VolumeExports<'a> {
    pub exports: &'a Exports,
    pub engine: &'a Arc<Engine>,
    pub latencies: &'a Arc<Latencies>,
}

impl VolumeExports<'_> {
    /// Export `volume` under its name.
    pub fn add(&self, volume: &VolumeEntry) -> Result<()> {
        let export = EngineExport::new(self.engine.clone(), volume.id, self.latencies.clone())
            .with_context(|| format!("volume {:?}", volume.name))?;
        self.exports
            .add(
                &volume.name,
                Arc::new(export),
                ExportOptions {
                    description: Some(description(volume)),
                    read_only: false,
                },
            )
            .with_context(|| format!("exporting volume {:?}", volume.name))
    }
}

/// The export's description (`nbdinfo --list`): the cache volume, its
/// origin and its mode.
pub fn description(volume: &VolumeEntry) -> String {
    let mode = CacheMode::name_of_code(volume.mode);
    format!(
        "cairn volume {} over {} ({mode})",
        volume.id, volume.origin_identity
    )
}
