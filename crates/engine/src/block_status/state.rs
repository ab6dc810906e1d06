//! What a run of the volume holds, as block status reports it.

/// The `base:allocation` answer for a run of the volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    /// Holds data (or may): cached, written, or allocated on the origin.
    Data,
    /// Reads as zeroes (a write-zeroes cairn still tracks).
    Zero,
    /// Reads as zeroes and holds nothing: a discard cairn still tracks, a
    /// block discarded with integrity tags, or a hole in the origin.
    Hole,
}

/// A run of the volume in one state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockStatusRun {
    pub length_bytes: u64,
    pub state: BlockState,
}
