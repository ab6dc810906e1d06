//! What copying one epoch group to the origin put there.

use cairn_format::RangeKind;

use crate::error::EngineError;
use crate::volume_set::VolumeSet;

/// Only the volumes whose part reached their origin count: the rest of
/// this struct describes them alone.
pub(crate) struct Applied {
    /// The served volumes whose part of the group is on their origin,
    /// flushed (also those with nothing in the group).
    pub(crate) done: VolumeSet,
    /// The served volumes whose origin failed, with the error; their part
    /// of the group is tried again later.
    pub(crate) failed: Vec<(u16, EngineError)>,
    pub(crate) blocks_written: u64,
    /// What the origin now holds, in the order it was written: the ranges,
    /// then each block written with its (verified) checksum. Integrity tags
    /// follow it at commit.
    pub(crate) ranges: Vec<(RangeKind, u64, u64)>,
    pub(crate) blocks: Vec<(u64, u32)>,
    /// (address, logical offset) of dirty blocks that failed their checksum
    /// and were not copied.
    pub(crate) bad: Vec<(u64, u64)>,
}
