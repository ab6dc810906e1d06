//! A cache looked at without being changed ([`crate::Engine::inspect`]):
//! the engine recovered into memory over origins it never opened, behind
//! a type that offers only what reads its state. No request, write-back,
//! checkpoint or close can reach the device through it.

use cairn_format::{StoredSettings, Superblock, VolumeEntry};

use crate::engine::Engine;
use crate::stats::StatsSnapshot;
use crate::volume_status::VolumeStatus;

pub struct Inspection {
    engine: Engine,
}

impl Inspection {
    pub(crate) fn new(engine: Engine) -> Inspection {
        Inspection { engine }
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
