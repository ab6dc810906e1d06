//! One volume as `status` and `volume list` show it: its table entry and
//! its blocks in the cache.

use cairn_format::VolumeEntry;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeStatus {
    pub entry: VolumeEntry,
    pub dirty_blocks: u64,
    pub clean_blocks: u64,
}
