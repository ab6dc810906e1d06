//! Where one volume's write-back and integrity recalculation stand (format
//! 2): the positions that change often, kept in the superblock; the
//! volume's static description is in the volume table.
//!
//! 18 bytes, little endian: `id u16, writeback_offset u64,
//! recalc_position_blocks u64`.

use crate::codec::{Reader, Writer};
use crate::DecodeError;

/// Bytes of one encoded position.
pub const VOLUME_POSITION_BYTES: usize = 18;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VolumePosition {
    /// The volume's id (its entry in the volume table).
    pub id: u16,
    /// Logical log offset before which every block of this volume is on
    /// its origin and the origin was flushed. At least the superblock's
    /// `writeback_offset` (which is the least of them).
    pub writeback_offset: u64,
    /// Origin integrity: every block of this volume below this address has
    /// had its tag computed (0 without integrity).
    pub recalc_position_blocks: u64,
}

impl VolumePosition {
    pub fn encode(&self, w: &mut Writer<'_>) {
        w.u16(self.id);
        w.u64(self.writeback_offset);
        w.u64(self.recalc_position_blocks);
    }

    pub fn decode(r: &mut Reader<'_>) -> Result<VolumePosition, DecodeError> {
        Ok(VolumePosition {
            id: r.u16()?,
            writeback_offset: r.u64()?,
            recalc_position_blocks: r.u64()?,
        })
    }
}
