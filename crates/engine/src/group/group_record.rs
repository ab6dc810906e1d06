//! One record of an epoch group, read back from the log (or, in degraded
//! mode, taken from memory).

use cairn_format::RecordHeader;

use cairn_device::PooledBuf;

pub(crate) struct GroupRecord {
    /// Logical offset of the header block; data blocks follow.
    pub(crate) at: u64,
    pub(crate) header: RecordHeader,
    /// The data blocks, in a pooled page-aligned buffer: read straight from
    /// the device (no bounce copy, no zeroing first) and sent to the origin
    /// from there (no copy into runs); back in the pool with the group.
    pub(crate) data: PooledBuf,
}
