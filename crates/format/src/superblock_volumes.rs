//! What a superblock says about the volumes it serves: format 1 describes
//! its one origin in the superblock itself; format 2 names the volume table
//! that describes them, and keeps each volume's positions.

use crate::origin_v1::OriginV1;
use crate::volume_position::VolumePosition;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SuperblockVolumes {
    /// Format 1: one origin, described here.
    V1(OriginV1),
    /// Format 2.
    V2 {
        /// The sequence of the volume table this superblock belongs to:
        /// only the copy with this sequence is read.
        table_sequence: u64,
        /// One per volume of that table, by id.
        positions: Vec<VolumePosition>,
    },
}
