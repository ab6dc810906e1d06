//! How many cached blocks are dirty and clean, in all and per volume: the
//! gauges `status` and the metrics show, kept as the index changes so no
//! question scans the slot table.

use cairn_format::{key_volume, VOLUMES_MAX};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VolumeBlocks {
    pub dirty: u64,
    pub clean: u64,
}

#[derive(Default)]
pub(crate) struct BlockCounts {
    dirty: u64,
    clean: u64,
    by_volume: [VolumeBlocks; VOLUMES_MAX],
}

impl BlockCounts {
    pub(crate) fn dirty(&self) -> u64 {
        self.dirty
    }

    pub(crate) fn clean(&self) -> u64 {
        self.clean
    }

    pub(crate) fn of_volume(&self, volume: u16) -> VolumeBlocks {
        self.by_volume[volume as usize]
    }

    /// A block of `key` became cached, dirty or clean.
    pub(crate) fn add(&mut self, key: u64, dirty: bool) {
        let v = &mut self.by_volume[key_volume(key) as usize];
        if dirty {
            self.dirty += 1;
            v.dirty += 1;
        } else {
            self.clean += 1;
            v.clean += 1;
        }
    }

    /// A cached block of `key`, dirty or clean, left the index.
    pub(crate) fn remove(&mut self, key: u64, dirty: bool) {
        let v = &mut self.by_volume[key_volume(key) as usize];
        if dirty {
            assert!(self.dirty > 0 && v.dirty > 0, "a dirty block was counted");
            self.dirty -= 1;
            v.dirty -= 1;
        } else {
            assert!(self.clean > 0 && v.clean > 0, "a clean block was counted");
            self.clean -= 1;
            v.clean -= 1;
        }
    }

    /// A cached block of `key` went from dirty to clean, or back.
    pub(crate) fn set_dirty(&mut self, key: u64, dirty: bool) {
        self.remove(key, !dirty);
        self.add(key, dirty);
    }
}
