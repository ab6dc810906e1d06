//! The volume table of format v2: the volumes one cache serves, each its own
//! origin and NBD export. It lives in the 56 KiB that v1 leaves unused
//! between the second superblock copy and the metadata area, so a v1 cache
//! is upgraded in place without moving anything.
//!
//! Two copies, like the superblocks: the table with sequence `s` is written
//! to copy `s % 2`. Unlike the superblocks, the newest copy does not win by
//! itself: the superblock names the sequence of the table it belongs to,
//! and only that copy is read. Changing the table is therefore one write of
//! the other copy, a barrier, then the superblock that names it. A crash
//! before that superblock is durable leaves the old superblock naming the
//! old table, still intact in its copy.
//!
//! A copy, little endian:
//!
//! ```text
//! 0    magic u64 "CAIRNVOL"
//! 8    version u32 (2, the format version that introduced the table)
//! 12   volume_count u32 (at most VOLUMES_MAX)
//! 16   sequence u64
//! 24   uuid [16]  the cache's (the superblock's): a table left by an
//!                 earlier format of the device never matches
//! 40   tag_area_pages u64  with `FEATURE_TAG_EXTENTS`: tag pages (per copy)
//!                          the area holds, shared out among the volumes
//!                          with integrity; zero otherwise
//! 48   reserved, zero, up to 64
//! 64   volume_count entries of VOLUME_ENTRY_BYTES, then zeroes
//! end-4 crc32c of the copy with this field zeroed
//! ```

use crate::codec::{check_magic, crc_with_hole, Reader, Writer};
use crate::volume_entry::{VolumeEntry, VOLUME_ENTRY_BYTES};
use crate::{DecodeError, METADATA_AREA_OFFSET, SUPERBLOCK_BYTES, SUPERBLOCK_OFFSETS, VOLUMES_MAX};

pub const VOLUME_TABLE_MAGIC: u64 = u64::from_le_bytes(*b"CAIRNVOL");
/// The table's own version: the format version that introduced it.
pub const VOLUME_TABLE_VERSION: u32 = 2;
/// Bytes of one copy of the table.
pub const VOLUME_TABLE_COPY_BYTES: usize = 28 << 10;
/// Byte offsets of the two copies: right after the superblocks, ending
/// where the metadata area begins.
pub const VOLUME_TABLE_OFFSETS: [u64; 2] = [
    SUPERBLOCK_OFFSETS[1] + SUPERBLOCK_BYTES as u64,
    SUPERBLOCK_OFFSETS[1] + SUPERBLOCK_BYTES as u64 + VOLUME_TABLE_COPY_BYTES as u64,
];

const HEADER_BYTES: usize = 64;
const CRC_OFFSET: usize = VOLUME_TABLE_COPY_BYTES - 4;
const _: () = assert!(HEADER_BYTES + VOLUMES_MAX * VOLUME_ENTRY_BYTES <= CRC_OFFSET);
const _: () =
    assert!(VOLUME_TABLE_OFFSETS[1] + VOLUME_TABLE_COPY_BYTES as u64 == METADATA_AREA_OFFSET);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeTable {
    pub sequence: u64,
    pub uuid: [u8; 16],
    /// Tag pages per copy of a tag area shared out in extents (zero when
    /// the cache has none: its tag area, if any, is the first volume's).
    pub tag_area_pages: u64,
    volumes: Vec<VolumeEntry>,
}

/// What the superblock says the table must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VolumeTableExpected {
    pub uuid: [u8; 16],
    pub sequence: u64,
}

impl VolumeTable {
    /// A table of `volumes`, checked: each entry valid, at most
    /// [`VOLUMES_MAX`], ids and names unique.
    pub fn new(
        sequence: u64,
        uuid: [u8; 16],
        volumes: Vec<VolumeEntry>,
    ) -> Result<VolumeTable, DecodeError> {
        Self::new_with_tag_area(sequence, uuid, 0, volumes)
    }

    /// This table with other volumes (same sequence, cache and tag area),
    /// checked as [`VolumeTable::new`] checks.
    pub fn with_volumes(&self, volumes: Vec<VolumeEntry>) -> Result<VolumeTable, DecodeError> {
        Self::new_with_tag_area(self.sequence, self.uuid, self.tag_area_pages, volumes)
    }

    /// A table whose volumes share a tag area of `tag_area_pages` pages.
    pub fn new_with_tag_area(
        sequence: u64,
        uuid: [u8; 16],
        tag_area_pages: u64,
        volumes: Vec<VolumeEntry>,
    ) -> Result<VolumeTable, DecodeError> {
        if volumes.len() > VOLUMES_MAX {
            return Err(DecodeError::OutOfRange {
                field: "volume_count",
                value: volumes.len() as u64,
            });
        }
        for (i, v) in volumes.iter().enumerate() {
            v.check()?;
            for earlier in &volumes[..i] {
                if earlier.id == v.id {
                    return Err(DecodeError::OutOfRange {
                        field: "volume_id_repeated",
                        value: v.id as u64,
                    });
                }
                if earlier.name == v.name {
                    return Err(DecodeError::OutOfRange {
                        field: "volume_name_repeated",
                        value: i as u64,
                    });
                }
            }
        }
        Ok(VolumeTable {
            sequence,
            uuid,
            tag_area_pages,
            volumes,
        })
    }

    pub fn volumes(&self) -> &[VolumeEntry] {
        &self.volumes
    }

    pub fn by_name(&self, name: &str) -> Option<&VolumeEntry> {
        self.volumes.iter().find(|v| v.name == name)
    }

    pub fn by_id(&self, id: u16) -> Option<&VolumeEntry> {
        self.volumes.iter().find(|v| v.id == id)
    }

    /// The lowest id no entry holds. An entry in `Removing` keeps its id, so
    /// an id is given again only once no block of its old volume is left.
    pub fn free_id(&self) -> Option<u16> {
        (0..VOLUMES_MAX as u16).find(|id| self.by_id(*id).is_none())
    }

    /// Which copy (0 or 1) the table with `sequence` is written to.
    pub fn copy_for(sequence: u64) -> usize {
        (sequence % 2) as usize
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut buf = vec![0u8; VOLUME_TABLE_COPY_BYTES];
        let mut w = Writer::new(&mut buf);
        w.u64(VOLUME_TABLE_MAGIC);
        w.u32(VOLUME_TABLE_VERSION);
        w.u32(self.volumes.len() as u32);
        w.u64(self.sequence);
        w.bytes(&self.uuid);
        w.u64(self.tag_area_pages);
        for (i, v) in self.volumes.iter().enumerate() {
            let at = HEADER_BYTES + i * VOLUME_ENTRY_BYTES;
            v.encode(&mut buf[at..at + VOLUME_ENTRY_BYTES]);
        }
        let crc = crc_with_hole(&buf, CRC_OFFSET);
        buf[CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
        buf
    }

    /// Read a copy and check it against what the superblock expects.
    pub fn decode(buf: &[u8], expected: VolumeTableExpected) -> Result<VolumeTable, DecodeError> {
        let buf = crate::codec::prefix(buf, VOLUME_TABLE_COPY_BYTES)?;
        let mut r = Reader::new(buf);
        check_magic(r.u64()?, VOLUME_TABLE_MAGIC)?;
        let version = r.u32()?;
        if version != VOLUME_TABLE_VERSION {
            return Err(DecodeError::BadVersion {
                found: version,
                supported: VOLUME_TABLE_VERSION,
            });
        }
        crate::codec::check_crc(buf, CRC_OFFSET)?;
        let count = r.u32()? as usize;
        if count > VOLUMES_MAX {
            return Err(DecodeError::OutOfRange {
                field: "volume_count",
                value: count as u64,
            });
        }
        let sequence = r.u64()?;
        if sequence != expected.sequence {
            return Err(DecodeError::OutOfRange {
                field: "volume_table_sequence",
                value: sequence,
            });
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(r.bytes(16)?);
        if uuid != expected.uuid {
            return Err(DecodeError::OutOfRange {
                field: "volume_table_uuid",
                value: 0,
            });
        }
        let tag_area_pages = r.u64()?;
        let entries_end = HEADER_BYTES + count * VOLUME_ENTRY_BYTES;
        let zero_outside = buf[r.position()..HEADER_BYTES]
            .iter()
            .chain(&buf[entries_end..CRC_OFFSET])
            .all(|&b| b == 0);
        if !zero_outside {
            return Err(DecodeError::OutOfRange {
                field: "volume_table_reserved",
                value: 0,
            });
        }
        let volumes = buf[HEADER_BYTES..entries_end]
            .chunks_exact(VOLUME_ENTRY_BYTES)
            .map(VolumeEntry::decode)
            .collect::<Result<Vec<_>, _>>()?;
        VolumeTable::new_with_tag_area(sequence, uuid, tag_area_pages, volumes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volume_entry::tests::sample;
    use proptest::prelude::*;

    const UUID: [u8; 16] = [9; 16];

    fn expect(sequence: u64) -> VolumeTableExpected {
        VolumeTableExpected {
            uuid: UUID,
            sequence,
        }
    }

    /// Volume `id`, named as the first volume (`""`) or `vol-ID`.
    fn entry(id: u16) -> VolumeEntry {
        let name = if id == 0 {
            String::new()
        } else {
            format!("vol-{id}")
        };
        sample(id, &name)
    }

    fn table(count: u16) -> VolumeTable {
        VolumeTable::new(5, UUID, (0..count).map(entry).collect()).expect("valid table")
    }

    #[test]
    fn the_table_fills_exactly_the_gap_v1_leaves() {
        assert_eq!(VOLUME_TABLE_OFFSETS, [8192, 36864]);
        assert_eq!(table(VOLUMES_MAX as u16).encode().len(), 28672);
    }

    #[test]
    fn tables_round_trip_from_empty_to_full() {
        for count in [0, 1, 3, VOLUMES_MAX as u16] {
            let t = table(count);
            assert_eq!(VolumeTable::decode(&t.encode(), expect(5)), Ok(t));
        }
        let shared = VolumeTable::new_with_tag_area(5, UUID, 777, vec![entry(0), entry(1)])
            .expect("valid table");
        let decoded = VolumeTable::decode(&shared.encode(), expect(5)).expect("decodes");
        assert_eq!(decoded.tag_area_pages, 777);
        // A table made from it keeps its tag area.
        let next = decoded.with_volumes(vec![entry(0)]).expect("valid table");
        assert_eq!((next.tag_area_pages, next.sequence), (777, 5));
    }

    #[test]
    fn a_table_for_another_sequence_or_cache_is_refused() {
        let bytes = table(2).encode();
        assert!(VolumeTable::decode(&bytes, expect(4)).is_err());
        let other = VolumeTableExpected {
            uuid: [8; 16],
            sequence: 5,
        };
        assert!(VolumeTable::decode(&bytes, other).is_err());
        assert!(VolumeTable::decode(&bytes, expect(5)).is_ok());
    }

    #[test]
    fn repeated_ids_names_and_too_many_volumes_are_refused() {
        let twice_id = vec![sample(1, "a"), sample(1, "b")];
        assert!(VolumeTable::new(1, UUID, twice_id).is_err());
        let twice_name = vec![sample(1, "a"), sample(2, "a")];
        assert!(VolumeTable::new(1, UUID, twice_name).is_err());
        let too_many = (0..=VOLUMES_MAX as u16).map(entry).collect();
        assert!(VolumeTable::new(1, UUID, too_many).is_err());
        // A count over the limit with a valid crc is refused too.
        let mut bytes = table(1).encode();
        bytes[12..16].copy_from_slice(&(VOLUMES_MAX as u32 + 1).to_le_bytes());
        let crc = crc_with_hole(&bytes, CRC_OFFSET);
        bytes[CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
        assert!(VolumeTable::decode(&bytes, expect(5)).is_err());
    }

    #[test]
    fn a_nonzero_byte_outside_the_entries_is_damage_even_with_a_good_crc() {
        for at in [48, HEADER_BYTES + 2 * VOLUME_ENTRY_BYTES, CRC_OFFSET - 1] {
            let mut bytes = table(2).encode();
            bytes[at] = 1;
            let crc = crc_with_hole(&bytes, CRC_OFFSET);
            bytes[CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
            assert!(VolumeTable::decode(&bytes, expect(5)).is_err(), "{at}");
        }
    }

    #[test]
    fn free_id_skips_the_ids_in_use() {
        let mut t = table(3);
        assert_eq!(t.free_id(), Some(3));
        t.volumes.remove(1);
        assert_eq!(t.free_id(), Some(1));
        assert_eq!(VolumeTable::copy_for(5), 1);
        assert_eq!(VolumeTable::copy_for(6), 0);
    }

    proptest! {
        /// Any single flipped bit anywhere in the copy is refused.
        #[test]
        fn every_flipped_bit_is_refused(count in 0u16..=4, bit in 0usize..VOLUME_TABLE_COPY_BYTES * 8) {
            let mut bytes = table(count).encode();
            bytes[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(VolumeTable::decode(&bytes, expect(5)).is_err());
        }

        /// A copy cut short is refused, never read past its end.
        #[test]
        fn a_short_copy_is_refused(len in 0usize..VOLUME_TABLE_COPY_BYTES) {
            let bytes = table(2).encode();
            prop_assert!(VolumeTable::decode(&bytes[..len], expect(5)).is_err());
        }
    }
}
