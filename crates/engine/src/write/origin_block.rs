//! [`OriginBlock`]: the old contents of a block a partial write covers,
//! read from the origin without the engine lock.

use crate::index::WriteStamp;

/// A block read from the origin for a read-modify-write, with the write
/// stamp its miss was planned with: it stands for the block's current
/// contents only while the block is still a miss with that stamp (nothing
/// wrote, zeroed or discarded it since).
#[derive(Debug)]
pub(crate) struct OriginBlock {
    pub key: u64,
    pub stamp: WriteStamp,
    pub data: Vec<u8>,
}
