//! The superblock: static configuration plus the few numbers recovery starts
//! from. Two copies alternate; the valid copy with the highest `sequence`
//! wins, so a torn superblock write leaves the older copy in charge.

use crate::codec::{check_magic, check_version, Reader, Writer};
use crate::settings::StoredSettings;
use crate::{block_size_valid, DecodeError, FORMAT_VERSION, SUPERBLOCK_BYTES, SUPERBLOCK_MAGIC};

pub const ORIGIN_IDENTITY_MAX_BYTES: usize = 512;
const CRC_OFFSET: usize = SUPERBLOCK_BYTES - 4;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// Higher wins between the two copies.
    pub sequence: u64,
    pub uuid: [u8; 16],
    pub block_size_bytes: u32,
    pub cache_size_bytes: u64,
    pub origin_size_bytes: u64,
    /// Opaque text naming the origin (path, device id or URI).
    pub origin_identity: String,
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
    /// origin flushed. The log tail never passes it.
    pub writeback_offset: u64,
    /// Persisted cache mode (engine-defined code).
    pub mode: u8,
    /// Feature flags (`FEATURE_*`); unknown bits are refused.
    pub features: u32,
    /// Origin integrity: every origin block below this address has had its
    /// tag computed (recalculation resumes here after a restart). Equal to
    /// the origin's block count once recalculation is complete.
    pub recalc_position_blocks: u64,
    /// Policy settings stored with `cairn set` (none in a superblock
    /// written before they existed).
    pub settings: StoredSettings,
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
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.origin_identity.len() <= ORIGIN_IDENTITY_MAX_BYTES);
        assert!(self.active_checkpoint <= 1);
        let mut buf = vec![0u8; SUPERBLOCK_BYTES];
        let mut w = Writer::new(&mut buf);
        w.u64(SUPERBLOCK_MAGIC);
        w.u32(FORMAT_VERSION);
        w.u32(self.features);
        w.u64(self.sequence);
        w.bytes(&self.uuid);
        w.u32(self.block_size_bytes);
        w.u64(self.cache_size_bytes);
        w.u64(self.origin_size_bytes);
        w.u64(self.log_blocks);
        w.u64(self.checkpoint_slot_bytes);
        w.u64(self.generation);
        w.u8(self.active_checkpoint);
        w.u8(self.mode);
        w.u64(self.checkpoint_sequence);
        w.u64(self.writeback_offset);
        w.u16(self.origin_identity.len() as u16);
        w.bytes(self.origin_identity.as_bytes());
        // Fields added after the first release go after the identity: a
        // superblock written before them decodes them as zero.
        w.u64(self.recalc_position_blocks);
        self.settings.encode(&mut w);
        let crc = crate::codec::crc_with_hole(&buf, CRC_OFFSET);
        buf[CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
        buf
    }

    pub fn decode(buf: &[u8]) -> Result<Superblock, DecodeError> {
        let buf = crate::codec::prefix(buf, SUPERBLOCK_BYTES)?;
        let mut r = Reader::new(buf);
        check_magic(r.u64()?, SUPERBLOCK_MAGIC)?;
        check_version(r.u32()?)?;
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
        let origin_identity = String::from_utf8(r.bytes(identity_len)?.to_vec()).map_err(|_| {
            DecodeError::OutOfRange {
                field: "origin_identity_utf8",
                value: identity_len as u64,
            }
        })?;
        let recalc_position_blocks = r.u64()?;
        let settings = StoredSettings::decode(&mut r)?;
        Ok(Superblock {
            sequence,
            uuid,
            block_size_bytes,
            cache_size_bytes,
            origin_size_bytes,
            origin_identity,
            log_blocks,
            checkpoint_slot_bytes,
            generation,
            active_checkpoint,
            checkpoint_sequence,
            writeback_offset,
            mode,
            features,
            recalc_position_blocks,
            settings,
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

    /// Which copy (0 or 1) the superblock with this sequence is written to.
    pub fn copy_index(sequence: u64) -> usize {
        (sequence % 2) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Superblock {
        Superblock {
            sequence: 9,
            uuid: [3; 16],
            block_size_bytes: 4096,
            cache_size_bytes: 1 << 30,
            origin_size_bytes: 1 << 40,
            origin_identity: "file:/dev/sdb".into(),
            log_blocks: 1000,
            checkpoint_slot_bytes: 65536,
            generation: 4,
            active_checkpoint: 1,
            checkpoint_sequence: 77,
            writeback_offset: 123,
            mode: 0,
            features: crate::FEATURE_INTEGRITY,
            recalc_position_blocks: 4242,
            settings: StoredSettings {
                sequential_cutoff_bytes: Some(1 << 20),
                page_cache_reads: Some(true),
                ..Default::default()
            },
        }
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
        let sb = sample();
        let buf = sb.encode();
        assert_eq!(Superblock::decode(&buf).unwrap(), sb);
    }

    #[test]
    fn every_flipped_byte_is_detected() {
        let buf = sample().encode();
        for i in 0..buf.len() {
            let mut bad = buf.clone();
            bad[i] ^= 0x40;
            assert!(
                Superblock::decode(&bad).is_err(),
                "flip at {i} not detected"
            );
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
        // Bits 0 (integrity) and 1 (degraded) are known.
        for bit in 2..32 {
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
        let mut sb = sample();
        sb.origin_identity = cut.to_string();
        assert_eq!(Superblock::decode(&sb.encode()).unwrap(), sb);
    }

    #[test]
    fn identity_that_is_not_utf8_is_refused() {
        // Written with a valid checksum: the bytes themselves are refused.
        let mut sb = sample();
        sb.origin_identity = "a".repeat(ORIGIN_IDENTITY_MAX_BYTES);
        let mut buf = sb.encode();
        let start = buf
            .windows(ORIGIN_IDENTITY_MAX_BYTES)
            .position(|w| w.iter().all(|&b| b == b'a'))
            .unwrap();
        buf[start..start + ORIGIN_IDENTITY_MAX_BYTES].fill(0xff);
        let crc = crate::codec::crc_with_hole(&buf, CRC_OFFSET);
        buf[CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(
            Superblock::decode(&buf),
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
