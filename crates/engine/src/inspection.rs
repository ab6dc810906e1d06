//! A cache looked at without being changed ([`Inspection::open`]): the
//! engine recovered into memory over origins it never opened, behind a
//! type that offers only what reads its state. No request, write-back,
//! checkpoint or close can reach the device through it.

use std::sync::Arc;

use cairn_device::Device;
use cairn_format::{StoredSettings, Superblock, VolumeEntry};

use crate::engine::Engine;
use crate::error::EngineResult;
use crate::open;
use crate::stats::StatsSnapshot;
use crate::volume_status::VolumeStatus;

pub struct Inspection {
    engine: Engine,
}

impl Inspection {
    /// Look at a formatted cache without changing it and without its
    /// origins: the superblocks, the checkpoint and the log replayed into
    /// memory give the state a daemon starting now would recover (the
    /// dirty blocks and all), and nothing is written. For a status while
    /// no daemon serves the cache, when an origin may be unreachable.
    pub fn open(cache: Arc<dyn Device>) -> EngineResult<Inspection> {
        Ok(Inspection {
            engine: Engine::of_opened(open::inspect(cache)?),
        })
    }

    /// The gauges as recovered (dirty, clean, free blocks, log positions),
    /// the lifetime counters of the newest checkpoint; the since-start
    /// counters are all zero (nothing ran).
    pub fn stats(&self) -> StatsSnapshot {
        self.engine.stats()
    }

    pub fn superblock(&self) -> Superblock {
        self.engine.superblock()
    }

    /// The first volume (id 0, the one format made).
    pub fn volume(&self) -> VolumeEntry {
        self.engine.volume()
    }

    /// Every volume with its blocks in the cache, in table order.
    pub fn volumes_status(&self) -> Vec<VolumeStatus> {
        self.engine.volumes_status()
    }

    pub fn stored_settings(&self) -> StoredSettings {
        self.engine.stored_settings()
    }

    pub fn block_size_bytes(&self) -> u32 {
        self.engine.block_size_bytes()
    }
}
