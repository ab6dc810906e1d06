//! The origins of the volumes the engine serves, by volume id. Every path
//! that reads or writes an origin finds it here from a block's key, so the
//! rest of the engine (index, log, ranges, write-back groups) deals in keys
//! only. The set changes only when a volume is added or removed.

use std::sync::{Arc, RwLock};

use cairn_format::{key_lba, key_volume, VOLUMES_MAX};

use crate::error::{EngineError, EngineResult};
use crate::volume_origin::VolumeOrigin;

pub(crate) struct Origins {
    /// Indexed by volume id (ids are below `VOLUMES_MAX`).
    by_id: RwLock<Vec<Option<Arc<VolumeOrigin>>>>,
}

impl Origins {
    pub(crate) fn new(volumes: Vec<VolumeOrigin>) -> Origins {
        let mut by_id: Vec<Option<Arc<VolumeOrigin>>> = vec![None; VOLUMES_MAX];
        for v in volumes {
            let id = v.id as usize;
            assert!(
                id < VOLUMES_MAX && by_id[id].is_none(),
                "volume ids unique and in range"
            );
            by_id[id] = Some(Arc::new(v));
        }
        Origins {
            by_id: RwLock::new(by_id),
        }
    }

    /// The volume with this id, if it is served.
    pub(crate) fn get(&self, id: u16) -> Option<Arc<VolumeOrigin>> {
        self.by_id
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(id as usize)
            .cloned()
            .flatten()
    }

    /// The volume a key belongs to, and the key's block address on its
    /// origin. A key of a volume that is not served (removed meanwhile) is
    /// an error, never another volume's block.
    pub(crate) fn of_key(&self, key: u64) -> EngineResult<(Arc<VolumeOrigin>, u64)> {
        let id = key_volume(key);
        let volume = self
            .get(id)
            .ok_or(EngineError::NoSuchVolume { volume_id: id })?;
        Ok((volume, key_lba(key)))
    }

    /// Serve `volume` from now on (its id is free: a new table entry).
    pub(crate) fn insert(&self, volume: VolumeOrigin) {
        let mut by_id = self.by_id.write().unwrap_or_else(|p| p.into_inner());
        let cell = &mut by_id[volume.id as usize];
        assert!(cell.is_none(), "volume {} added twice", volume.id);
        *cell = Some(Arc::new(volume));
    }

    /// Stop serving volume `id` (its table entry is gone).
    pub(crate) fn remove(&self, id: u16) -> Option<Arc<VolumeOrigin>> {
        let mut by_id = self.by_id.write().unwrap_or_else(|p| p.into_inner());
        by_id.get_mut(id as usize).and_then(Option::take)
    }

    /// Is `key` a block of a volume that takes new data (served and not
    /// being removed)?
    pub(crate) fn takes_new_data(&self, key: u64) -> bool {
        self.get(key_volume(key)).is_some_and(|v| !v.is_closed())
    }

    /// Every volume served, by id.
    pub(crate) fn all(&self) -> Vec<Arc<VolumeOrigin>> {
        self.by_id
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .flatten()
            .cloned()
            .collect()
    }

    /// The first volume (id 0), which the engine's single-volume entry
    /// points, integrity tags and the degraded-mode messages refer to.
    pub(crate) fn first(&self) -> Arc<VolumeOrigin> {
        self.get(0)
            .expect("volume 0 is served for the engine's life")
    }
}
