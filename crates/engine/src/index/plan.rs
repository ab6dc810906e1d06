//! How one block of a read is served.

use super::WriteStamp;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Already filled in: from memory (the open record or a sealed record
    /// still in flight), or zeroes (a pending zero/discard range).
    Done,
    /// Read this cache slot and check it against `crc`.
    Cache { slot: u32, crc: u32 },
    /// Read from the origin; with integrity on, verify against `tag` (the
    /// tag when the read was planned). `stamp` says whether the block was
    /// written since, before a fill inserts it.
    Miss { tag: Option<u32>, stamp: WriteStamp },
}
