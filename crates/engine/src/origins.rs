//! The origins of the volumes the engine serves, by volume id. Every path
//! that reads or writes an origin finds it here from a block's key, so the
//! rest of the engine (index, log, ranges, write-back groups) deals in keys
//! only. The set changes only when a volume is added or removed.
//!
//! What every request asks (is this volume served and taking new data,
//! how big is it) is kept in atomics beside the table of devices, so the
//! entry points and each append under the engine lock read one word
//! instead of taking a lock and cloning an `Arc` per request or per block.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use cairn_format::{key_lba, key_volume, VOLUMES_MAX};

use crate::error::{EngineError, EngineResult};
use crate::volume_origin::VolumeOrigin;

pub(crate) struct Origins {
    /// Indexed by volume id (ids are below `VOLUMES_MAX`).
    by_id: RwLock<Vec<Option<Arc<VolumeOrigin>>>>,
    /// Bit `id`: volume `id` is served and takes new data (not being
    /// removed).
    taking: AtomicU32,
    /// Each served volume's size in blocks, 0 for an id not served.
    blocks: [AtomicU64; VOLUMES_MAX],
}

const _: () = assert!(VOLUMES_MAX <= u32::BITS as usize);

impl Origins {
    pub(crate) fn new(volumes: Vec<VolumeOrigin>) -> Origins {
        let origins = Origins {
            by_id: RwLock::new(vec![None; VOLUMES_MAX]),
            taking: AtomicU32::new(0),
            blocks: std::array::from_fn(|_| AtomicU64::new(0)),
        };
        for v in volumes {
            origins.insert(v);
        }
        origins
    }

    /// Volume `id`'s size in blocks, if it is served and takes new data
    /// (the entry points' check; no lock).
    pub(crate) fn taking_blocks(&self, id: u16) -> Option<u64> {
        let id = id as usize;
        if id >= VOLUMES_MAX || self.taking.load(Ordering::SeqCst) & (1 << id) == 0 {
            return None;
        }
        Some(self.blocks[id].load(Ordering::SeqCst))
    }

    /// Let volume `id` take new data or not (its removal closes it first).
    pub(crate) fn set_taking(&self, id: u16, taking: bool) {
        assert!((id as usize) < VOLUMES_MAX);
        if taking {
            self.taking.fetch_or(1 << id, Ordering::SeqCst);
        } else {
            self.taking.fetch_and(!(1 << id), Ordering::SeqCst);
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
        let id = volume.id;
        let cell = &mut by_id[id as usize];
        assert!(cell.is_none(), "volume {id} added twice");
        self.blocks[id as usize].store(volume.blocks, Ordering::SeqCst);
        *cell = Some(Arc::new(volume));
        self.set_taking(id, true);
    }

    /// Stop serving volume `id` (its table entry is gone).
    pub(crate) fn remove(&self, id: u16) -> Option<Arc<VolumeOrigin>> {
        let mut by_id = self.by_id.write().unwrap_or_else(|p| p.into_inner());
        let removed = by_id.get_mut(id as usize).and_then(Option::take);
        if removed.is_some() {
            self.set_taking(id, false);
            self.blocks[id as usize].store(0, Ordering::SeqCst);
        }
        removed
    }

    /// Is `key` a block of a volume that takes new data (served and not
    /// being removed)?
    pub(crate) fn takes_new_data(&self, key: u64) -> bool {
        self.taking_blocks(key_volume(key)).is_some()
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
