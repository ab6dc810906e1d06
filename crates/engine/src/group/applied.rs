//! What copying one epoch group to the origin put there.

use cairn_format::RangeKind;

pub(crate) struct Applied {
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
