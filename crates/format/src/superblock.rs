//! The superblock: static configuration plus the few numbers recovery starts
//! from. Two copies alternate; the valid copy with the highest `sequence`
//! wins, so a torn superblock write leaves the older copy in charge.

use crate::codec::{check_magic, Reader, Writer};
use crate::origin_v1::OriginV1;
use crate::settings::StoredSettings;
use crate::superblock_volumes::SuperblockVolumes;
use crate::volume_position::VolumePosition;
use crate::{
    block_size_valid, DecodeError, FORMAT_VERSION, FORMAT_VERSION_V1, SUPERBLOCK_BYTES,
    SUPERBLOCK_MAGIC, VOLUMES_MAX,
};

pub const ORIGIN_IDENTITY_MAX_BYTES: usize = 512;
const CRC_OFFSET: usize = SUPERBLOCK_BYTES - 4;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// Higher wins between the two copies.
    pub sequence: u64,
    pub uuid: [u8; 16],
    pub block_size_bytes: u32,
    pub cache_size_bytes: u64,
    pub log_blocks: u64,
    pub checkpoint_slot_bytes: u64,
    /// Bumped on every open; record headers carry it, so records left over
    /// from before a crash can never be mistaken for new ones.
    pub generation: u64,
    /// Which checkpoint slot (0 or 1) holds the newest checkpoint.
    pub active_checkpoint: u8,
    /// Sequence number the active checkpoint must carry.
    pub checkpoint_sequence: u64,
    /// Logical log offset before which everything is written back and the
    /// origin flushed (every volume's origin, in format 2: the least of
    /// their positions). The log tail never passes it.
    pub writeback_offset: u64,
    /// Feature flags (`FEATURE_*`); unknown bits are refused.
    pub features: u32,
    /// The origin (format 1) or the volume table and each volume's
    /// positions (format 2). The variant is the format version.
    pub volumes: SuperblockVolumes,
}

/// `identity` as the superblock stores it: at most
/// [`ORIGIN_IDENTITY_MAX_BYTES`], cut at a character boundary (identities
/// are paths and URIs a user chose: any characters, any length).
pub fn origin_identity_for_superblock(identity: &str) -> &str {
    if identity.len() <= ORIGIN_IDENTITY_MAX_BYTES {
        return identity;
    }
    let mut end = ORIGIN_IDENTITY_MAX_BYTES;
    while !identity.is_char_boundary(end) {
        end -= 1;
    }
    &identity[..end]
}

impl Superblock {
    /// The format version this superblock is written in.
    pub fn version(&self) -> u32 {
        match self.volumes {
            SuperblockVolumes::V1(_) => FORMAT_VERSION_V1,
            SuperblockVolumes::V2 { .. } => FORMAT_VERSION,
        }
    }

    /// Format 1's origin, whose fields format 2 leaves zero (its volumes
    /// are described by the volume table).
    fn origin_v1(&self) -> OriginV1 {
        match &self.volumes {
            SuperblockVolumes::V1(origin) => origin.clone(),
            SuperblockVolumes::V2 { .. } => OriginV1 {
                origin_identity: String::new(),
                origin_size_bytes: 0,
                mode: 0,
                recalc_position_blocks: 0,
                settings: StoredSettings::default(),
            },
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let origin = self.origin_v1();
        assert!(origin.origin_identity.len() <= ORIGIN_IDENTITY_MAX_BYTES);
        assert!(self.active_checkpoint <= 1);
        let mut buf = vec![0u8; SUPERBLOCK_BYTES];
        let mut w = Writer::new(&mut buf);
        w.u64(SUPERBLOCK_MAGIC);
        w.u32(self.version());
        w.u32(self.features);
        w.u64(self.sequence);
        w.bytes(&self.uuid);
        w.u32(self.block_size_bytes);
        w.u64(self.cache_size_bytes);
        w.u64(origin.origin_size_bytes);
        w.u64(self.log_blocks);
        w.u64(self.checkpoint_slot_bytes);
        w.u64(self.generation);
        w.u8(self.active_checkpoint);
        w.u8(origin.mode);
        w.u64(self.checkpoint_sequence);
        w.u64(self.writeback_offset);
        w.u16(origin.origin_identity.len() as u16);
        w.bytes(origin.origin_identity.as_bytes());
        // Fields added after the first release go after the identity: a
        // superblock written before them decodes them as zero.
        w.u64(origin.recalc_position_blocks);
        origin.settings.encode(&mut w);
        if let SuperblockVolumes::V2 {
            table_sequence,
            positions,
        } = &self.volumes
        {
            assert!(positions.len() <= VOLUMES_MAX);
            w.u64(*table_sequence);
            w.u16(positions.len() as u16);
            for p in positions {
                p.encode(&mut w);
            }
        }
        let crc = crate::codec::crc_with_hole(&buf, CRC_OFFSET);
        buf[CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
        buf
    }

    pub fn decode(buf: &[u8]) -> Result<Superblock, DecodeError> {
        let buf = crate::codec::prefix(buf, SUPERBLOCK_BYTES)?;
        let mut r = Reader::new(buf);
        check_magic(r.u64()?, SUPERBLOCK_MAGIC)?;
        let version = r.u32()?;
        if version != FORMAT_VERSION && version != FORMAT_VERSION_V1 {
            return Err(DecodeError::BadVersion {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        crate::codec::check_crc(buf, CRC_OFFSET)?;
        let features = r.u32()?;
        if features & !crate::FEATURES_KNOWN != 0 {
            return Err(DecodeError::OutOfRange {
                field: "features",
                value: features as u64,
            });
        }
        let sequence = r.u64()?;
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(r.bytes(16)?);
        let block_size_bytes = r.u32()?;
        if !block_size_valid(block_size_bytes) {
            return Err(DecodeError::OutOfRange {
                field: "block_size_bytes",
                value: block_size_bytes as u64,
            });
        }
        let cache_size_bytes = r.u64()?;
        let origin_size_bytes = r.u64()?;
        let log_blocks = r.u64()?;
        let checkpoint_slot_bytes = r.u64()?;
        let generation = r.u64()?;
        let active_checkpoint = r.u8()?;
        if active_checkpoint > 1 {
            return Err(DecodeError::OutOfRange {
                field: "active_checkpoint",
                value: active_checkpoint as u64,
            });
        }
        let mode = r.u8()?;
        let checkpoint_sequence = r.u64()?;
        let writeback_offset = r.u64()?;
        let origin_identity = decode_identity(&mut r)?;
        let recalc_position_blocks = r.u64()?;
        let settings = StoredSettings::decode(&mut r)?;
        let origin = OriginV1 {
            origin_identity,
            origin_size_bytes,
            mode,
            recalc_position_blocks,
            settings,
        };
        let volumes = if version == FORMAT_VERSION_V1 {
            SuperblockVolumes::V1(origin)
        } else {
            decode_volumes_v2(&mut r, origin, writeback_offset)?
        };
        Ok(Superblock {
            sequence,
            uuid,
            block_size_bytes,
            cache_size_bytes,
            log_blocks,
            checkpoint_slot_bytes,
            generation,
            active_checkpoint,
            checkpoint_sequence,
            writeback_offset,
            features,
            volumes,
        })
    }

    /// Pick the superblock to trust from the two copies.
    pub fn newest(
        a: Result<Superblock, DecodeError>,
        b: Result<Superblock, DecodeError>,
    ) -> Result<Superblock, (DecodeError, DecodeError)> {
        match (a, b) {
            (Ok(a), Ok(b)) => Ok(if b.sequence > a.sequence { b } else { a }),
            (Ok(a), Err(_)) => Ok(a),
            (Err(_), Ok(b)) => Ok(b),
            (Err(ea), Err(eb)) => Err((ea, eb)),
        }
    }

    /// Is the DEGRADED flag set (see [`crate::FEATURE_DEGRADED`])?
    pub fn degraded(&self) -> bool {
        self.features & crate::FEATURE_DEGRADED != 0
    }

    /// The format 2 volume table this superblock names, and each volume's
    /// positions (`None` in format 1).
    pub fn volume_table(&self) -> Option<(u64, &[VolumePosition])> {
        match &self.volumes {
            SuperblockVolumes::V1(_) => None,
            SuperblockVolumes::V2 {
                table_sequence,
                positions,
            } => Some((*table_sequence, positions)),
        }
    }

    /// Which copy (0 or 1) the superblock with this sequence is written to.
    pub fn copy_index(sequence: u64) -> usize {
        (sequence % 2) as usize
    }
}

fn decode_identity(r: &mut Reader<'_>) -> Result<String, DecodeError> {
    let identity_len = r.u16()? as usize;
    if identity_len > ORIGIN_IDENTITY_MAX_BYTES {
        return Err(DecodeError::OutOfRange {
            field: "origin_identity_len",
            value: identity_len as u64,
        });
    }
    // Identities are written from a `String` cut at a character
    // boundary: bytes that are not UTF-8 are damage. (Decoding them
    // lossily could also make the identity longer than the limit.)
    String::from_utf8(r.bytes(identity_len)?.to_vec()).map_err(|_| DecodeError::OutOfRange {
        field: "origin_identity_utf8",
        value: identity_len as u64,
    })
}

/// Format 2's tail: the volume table's sequence and each volume's
/// positions. Format 1's origin fields must be empty (the table describes
/// the volumes), and no volume's write-back may stand behind the
/// superblock's, which is their least.
fn decode_volumes_v2(
    r: &mut Reader<'_>,
    origin: OriginV1,
    writeback_offset: u64,
) -> Result<SuperblockVolumes, DecodeError> {
    let empty = OriginV1 {
        origin_identity: String::new(),
        origin_size_bytes: 0,
        mode: 0,
        recalc_position_blocks: 0,
        settings: StoredSettings::default(),
    };
    if origin != empty {
        return Err(DecodeError::OutOfRange {
            field: "v2_origin_fields",
            value: 0,
        });
    }
    let table_sequence = r.u64()?;
    if table_sequence == 0 {
        return Err(DecodeError::OutOfRange {
            field: "volume_table_sequence",
            value: 0,
        });
    }
    let count = r.u16()? as usize;
    if count > VOLUMES_MAX {
        return Err(DecodeError::OutOfRange {
            field: "volume_position_count",
            value: count as u64,
        });
    }
    let mut positions: Vec<VolumePosition> = Vec::with_capacity(count);
    for _ in 0..count {
        let p = VolumePosition::decode(r)?;
        if positions.iter().any(|q| q.id == p.id) {
            return Err(DecodeError::OutOfRange {
                field: "volume_position_id_repeated",
                value: p.id as u64,
            });
        }
        if p.writeback_offset < writeback_offset {
            return Err(DecodeError::OutOfRange {
                field: "volume_writeback_offset",
                value: p.writeback_offset,
            });
        }
        positions.push(p);
    }
    // Everything after the positions up to the crc is zero.
    let padding = r.bytes(CRC_OFFSET.saturating_sub(r.position()))?;
    if padding.iter().any(|&b| b != 0) {
        return Err(DecodeError::OutOfRange {
            field: "superblock_padding",
            value: 0,
        });
    }
    Ok(SuperblockVolumes::V2 {
        table_sequence,
        positions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A format 1 superblock.
    fn sample_v1() -> Superblock {
        Superblock {
            volumes: SuperblockVolumes::V1(OriginV1 {
                origin_identity: "file:/dev/sdb".into(),
                origin_size_bytes: 1 << 40,
                mode: 0,
                recalc_position_blocks: 4242,
                settings: StoredSettings {
                    sequential_cutoff_bytes: Some(1 << 20),
                    page_cache_reads: Some(true),
                    ..Default::default()
                },
            }),
            ..sample()
        }
    }

    /// A format 2 superblock of three volumes.
    fn sample() -> Superblock {
        let position = |id, writeback_offset| VolumePosition {
            id,
            writeback_offset,
            recalc_position_blocks: 40 * id as u64,
        };
        Superblock {
            sequence: 9,
            uuid: [3; 16],
            block_size_bytes: 4096,
            cache_size_bytes: 1 << 30,
            log_blocks: 1000,
            checkpoint_slot_bytes: 65536,
            generation: 4,
            active_checkpoint: 1,
            checkpoint_sequence: 77,
            writeback_offset: 123,
            features: crate::FEATURE_INTEGRITY,
            volumes: SuperblockVolumes::V2 {
                table_sequence: 6,
                positions: vec![position(0, 123), position(3, 200), position(7, 124)],
            },
        }
    }

    fn v1_origin(sb: &mut Superblock) -> &mut OriginV1 {
        match &mut sb.volumes {
            SuperblockVolumes::V1(origin) => origin,
            SuperblockVolumes::V2 { .. } => panic!("a v1 sample"),
        }
    }

    fn v2_positions(sb: &mut Superblock) -> &mut Vec<VolumePosition> {
        match &mut sb.volumes {
            SuperblockVolumes::V2 { positions, .. } => positions,
            SuperblockVolumes::V1(_) => panic!("a v2 sample"),
        }
    }

    /// `buf` with its crc made right again: what a bug or a forger would
    /// write, so only the field checks can refuse it.
    fn with_good_crc(mut buf: Vec<u8>) -> Vec<u8> {
        let crc = crate::codec::crc_with_hole(&buf, CRC_OFFSET);
        buf[CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
        buf
    }

    #[test]
    fn unknown_features_are_refused() {
        let mut sb = sample();
        sb.features = 0x80;
        assert!(matches!(
            Superblock::decode(&sb.encode()),
            Err(DecodeError::OutOfRange {
                field: "features",
                ..
            })
        ));
    }

    #[test]
    fn roundtrip() {
        for sb in [sample(), sample_v1()] {
            let buf = sb.encode();
            assert_eq!(Superblock::decode(&buf).unwrap(), sb);
        }
        assert_eq!(sample().version(), crate::FORMAT_VERSION);
        assert_eq!(sample_v1().version(), crate::FORMAT_VERSION_V1);
        let mut empty = sample();
        v2_positions(&mut empty).clear();
        assert_eq!(Superblock::decode(&empty.encode()).unwrap(), empty);
        let mut full = sample();
        *v2_positions(&mut full) = (0..VOLUMES_MAX as u16)
            .map(|id| VolumePosition {
                id,
                writeback_offset: 123 + id as u64,
                recalc_position_blocks: u64::MAX - id as u64,
            })
            .collect();
        assert_eq!(Superblock::decode(&full.encode()).unwrap(), full);
    }

    #[test]
    fn every_flipped_byte_is_detected() {
        for buf in [sample().encode(), sample_v1().encode()] {
            for i in 0..buf.len() {
                let mut bad = buf.clone();
                bad[i] ^= 0x40;
                assert!(
                    Superblock::decode(&bad).is_err(),
                    "flip at {i} not detected"
                );
            }
        }
    }

    #[test]
    fn a_v2_superblock_with_v1_origin_fields_is_refused() {
        // Each of format 1's origin fields set in a format 2 superblock,
        // with a good crc: the volume table describes the volumes, so any
        // of them is damage.
        let v2 = sample().encode();
        // origin_size_bytes at 52, mode at 85, recalc_position_blocks and
        // the settings mask after the (empty) identity at 104 and 112.
        for (at, value) in [(53usize, 0x10u8), (85, 1), (104, 1), (112, 1)] {
            let mut mixed = v2.clone();
            mixed[at] = value;
            assert_eq!(
                Superblock::decode(&with_good_crc(mixed)),
                Err(DecodeError::OutOfRange {
                    field: "v2_origin_fields",
                    value: 0
                }),
                "byte {at}"
            );
        }
    }

    #[test]
    fn v2_positions_are_checked() {
        let mut repeated = sample();
        v2_positions(&mut repeated)[2].id = 0;
        assert!(matches!(
            Superblock::decode(&repeated.encode()),
            Err(DecodeError::OutOfRange {
                field: "volume_position_id_repeated",
                ..
            })
        ));
        // No volume's write-back stands behind the cache's.
        let mut behind = sample();
        v2_positions(&mut behind)[1].writeback_offset = 122;
        assert!(matches!(
            Superblock::decode(&behind.encode()),
            Err(DecodeError::OutOfRange {
                field: "volume_writeback_offset",
                ..
            })
        ));
        let mut unnamed = sample();
        unnamed.volumes = SuperblockVolumes::V2 {
            table_sequence: 0,
            positions: vec![],
        };
        assert!(Superblock::decode(&unnamed.encode()).is_err());
        // A count over the limit, and bytes after the positions, each with
        // a good crc.
        let buf = sample().encode();
        // After the fixed fields, the empty identity, the recalculation
        // position, the settings and the table's sequence.
        let count_at = 104 + 8 + crate::STORED_SETTINGS_BYTES + 8;
        assert_eq!(&buf[count_at..count_at + 2], &3u16.to_le_bytes());
        let mut over = buf.clone();
        over[count_at..count_at + 2].copy_from_slice(&(VOLUMES_MAX as u16 + 1).to_le_bytes());
        assert!(Superblock::decode(&with_good_crc(over)).is_err());
        let mut trailing = buf.clone();
        trailing[CRC_OFFSET - 1] = 1;
        assert_eq!(
            Superblock::decode(&with_good_crc(trailing)),
            Err(DecodeError::OutOfRange {
                field: "superblock_padding",
                value: 0
            })
        );
    }

    #[test]
    fn other_versions_are_refused() {
        for version in [0u32, 3, 0x100] {
            let mut buf = sample().encode();
            buf[8..12].copy_from_slice(&version.to_le_bytes());
            assert!(matches!(
                Superblock::decode(&with_good_crc(buf)),
                Err(DecodeError::BadVersion { found, .. }) if found == version
            ));
        }
    }

    #[test]
    fn degraded_flag_roundtrips_and_is_covered_by_the_crc() {
        let mut sb = sample();
        assert!(!sb.degraded());
        sb.features |= crate::FEATURE_DEGRADED;
        let buf = sb.encode();
        let back = Superblock::decode(&buf).unwrap();
        assert!(back.degraded());
        assert_eq!(back, sb);
        // Clearing the flag in place (without fixing the crc) is detected:
        // a damaged flag never silently turns a degraded cache into a
        // normal one.
        let mut cleared = buf.clone();
        cleared[12] &= !(crate::FEATURE_DEGRADED as u8);
        assert!(matches!(
            Superblock::decode(&cleared),
            Err(DecodeError::BadChecksum { .. })
        ));
    }

    #[test]
    fn unknown_feature_bits_are_refused() {
        // Bits 0 (integrity), 1 (degraded), 2 (tag extents) and 3 (large
        // records) are known.
        let mut large = sample();
        large.features = crate::FEATURE_LARGE_RECORDS;
        assert_eq!(Superblock::decode(&large.encode()), Ok(large));
        for bit in 4..32 {
            let mut sb = sample();
            sb.features = 1 << bit;
            assert_eq!(
                Superblock::decode(&sb.encode()),
                Err(DecodeError::OutOfRange {
                    field: "features",
                    value: 1 << bit
                }),
                "bit {bit}"
            );
        }
    }

    #[test]
    fn long_identities_are_cut_at_a_character_boundary() {
        let ascii = "a".repeat(600);
        assert_eq!(origin_identity_for_superblock(&ascii).len(), 512);
        // 'é' is two bytes: after one ASCII byte, byte 512 is inside one.
        let odd = format!("x{}", "é".repeat(300));
        let cut = origin_identity_for_superblock(&odd);
        assert_eq!(cut.len(), 511);
        assert!(odd.starts_with(cut));
        assert_eq!(
            origin_identity_for_superblock("file:/dev/sdb"),
            "file:/dev/sdb"
        );
        let mut sb = sample_v1();
        v1_origin(&mut sb).origin_identity = cut.to_string();
        assert_eq!(Superblock::decode(&sb.encode()).unwrap(), sb);
    }

    #[test]
    fn identity_that_is_not_utf8_is_refused() {
        // Written with a valid checksum: the bytes themselves are refused.
        let mut sb = sample_v1();
        v1_origin(&mut sb).origin_identity = "a".repeat(ORIGIN_IDENTITY_MAX_BYTES);
        let mut buf = sb.encode();
        let start = buf
            .windows(ORIGIN_IDENTITY_MAX_BYTES)
            .position(|w| w.iter().all(|&b| b == b'a'))
            .unwrap();
        buf[start..start + ORIGIN_IDENTITY_MAX_BYTES].fill(0xff);
        assert_eq!(
            Superblock::decode(&with_good_crc(buf)),
            Err(DecodeError::OutOfRange {
                field: "origin_identity_utf8",
                value: ORIGIN_IDENTITY_MAX_BYTES as u64
            })
        );
    }

    #[test]
    fn newest_wins() {
        let mut a = sample();
        let mut b = sample();
        a.sequence = 4;
        b.sequence = 5;
        let n = Superblock::newest(Ok(a.clone()), Ok(b.clone())).unwrap();
        assert_eq!(n.sequence, 5);
        let n = Superblock::newest(Ok(a), Err(DecodeError::Short { need: 1, have: 0 })).unwrap();
        assert_eq!(n.sequence, 4);
    }
}
