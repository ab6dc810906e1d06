//! Log records and checkpoints.
//!
//! A *record* is one header block followed by `data_count` data blocks,
//! contiguous in the circular log. The header lists, for each entry, the
//! origin address and either the crc32c of its data block (data entries) or a
//! block count (zero/discard ranges). Records chain: each header carries the
//! crc of the previous header, its own logical log offset and the open
//! generation, so recovery can never splice in a stale record.
//!
//! A *checkpoint* is a snapshot of the index: every live cache slot with its
//! address and checksum, the pending zero/discard ranges, and the log
//! positions replay continues from.

use crate::codec::{check_magic, check_version, crc_with_hole, Reader, Writer};
use crate::{
    keys_in_one_volume, DecodeError, CHECKPOINT_MAGIC, KEY_MAX, RECORD_MAGIC, STRUCTURE_VERSION,
};

pub const RECORD_HEADER_FIXED_BYTES: usize = 64;
pub const RECORD_ENTRY_BYTES: usize = 16;
const RECORD_CRC_OFFSET: usize = 60;

/// Record flag: the record was sealed by a flush (client FLUSH, FUA, or an
/// internal one) and ends an epoch. Write-back flushes the origin after it.
pub const RECORD_FLAG_EPOCH_END: u32 = 1;

const ENTRY_KIND_DATA: u8 = 1;
const ENTRY_KIND_ZERO: u8 = 2;
const ENTRY_KIND_DISCARD: u8 = 3;
/// Entry flag: the block was inserted clean (a read-cache fill or repair)
/// and needs no write-back.
const ENTRY_FLAG_CLEAN: u8 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeKind {
    /// Reads as zeroes; written back as write-zeroes.
    Zero,
    /// Reads as zeroes in cairn; written back as a discard to the origin.
    Discard,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordEntry {
    /// One data block follows in the record, in entry order.
    Data { lba: u64, crc: u32, clean: bool },
    /// A range of blocks set to zero (no data block follows).
    Range {
        kind: RangeKind,
        lba: u64,
        block_count: u32,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordHeader {
    pub sequence: u64,
    /// Logical (monotonic, never wrapping) log offset of this header block.
    pub log_offset: u64,
    pub generation: u64,
    /// Highest record sequence known durable (covered by a completed device
    /// flush) when this record was built. Lets recovery tell a torn tail from
    /// a corrupted, already-acknowledged record.
    pub durable_sequence: u64,
    /// crc of the previous record's header block.
    pub prev_crc: u32,
    /// Identifies the format (crc32c of the superblock uuid): records left
    /// on the device by an earlier format never count.
    pub format_tag: u32,
    pub flags: u32,
    pub entries: Vec<RecordEntry>,
}

impl RecordHeader {
    /// Entries that fit in one header block of this size.
    pub fn entries_max(block_size_bytes: u32) -> usize {
        (block_size_bytes as usize - RECORD_HEADER_FIXED_BYTES) / RECORD_ENTRY_BYTES
    }

    pub fn data_count(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| matches!(e, RecordEntry::Data { .. }))
            .count()
    }

    /// Blocks this record occupies in the log (header + data).
    pub fn length_blocks(&self) -> u64 {
        1 + self.data_count() as u64
    }

    pub fn epoch_end(&self) -> bool {
        self.flags & RECORD_FLAG_EPOCH_END != 0
    }

    /// Encode into a full header block; returns the block and its crc (the
    /// value the next record stores as `prev_crc`).
    pub fn encode(&self, block_size_bytes: u32) -> (Vec<u8>, u32) {
        assert!(self.entries.len() <= Self::entries_max(block_size_bytes));
        let mut buf = vec![0u8; block_size_bytes as usize];
        let data_count = self.data_count();
        let used = RECORD_HEADER_FIXED_BYTES + self.entries.len() * RECORD_ENTRY_BYTES;
        {
            let mut w = Writer::new(&mut buf);
            w.u64(RECORD_MAGIC);
            w.u32(STRUCTURE_VERSION);
            w.u32(self.flags);
            w.u64(self.sequence);
            w.u64(self.log_offset);
            w.u64(self.generation);
            w.u64(self.durable_sequence);
            w.u32(self.prev_crc);
            w.u16(self.entries.len() as u16);
            w.u16(data_count as u16);
            w.u32(self.format_tag);
            w.u32(0); // crc, filled below
            debug_assert_eq!(w.position(), RECORD_HEADER_FIXED_BYTES);
            for entry in &self.entries {
                match *entry {
                    RecordEntry::Data { lba, crc, clean } => {
                        assert!(lba <= KEY_MAX);
                        w.u8(ENTRY_KIND_DATA);
                        w.u8(if clean { ENTRY_FLAG_CLEAN } else { 0 });
                        w.u16(0);
                        w.u32(crc);
                        w.u64(lba);
                    }
                    RecordEntry::Range {
                        kind,
                        lba,
                        block_count,
                    } => {
                        assert!(keys_in_one_volume(lba, block_count as u64));
                        w.u8(match kind {
                            RangeKind::Zero => ENTRY_KIND_ZERO,
                            RangeKind::Discard => ENTRY_KIND_DISCARD,
                        });
                        w.u8(0);
                        w.u16(0);
                        w.u32(block_count);
                        w.u64(lba);
                    }
                }
            }
        }
        let crc = crc_with_hole(&buf[..used], RECORD_CRC_OFFSET);
        buf[RECORD_CRC_OFFSET..RECORD_CRC_OFFSET + 4].copy_from_slice(&crc.to_le_bytes());
        (buf, crc)
    }

    /// Decode and validate a header block. Returns the header and its crc.
    pub fn decode(buf: &[u8], block_size_bytes: u32) -> Result<(RecordHeader, u32), DecodeError> {
        let mut r = Reader::new(buf);
        check_magic(r.u64()?, RECORD_MAGIC)?;
        check_version(r.u32()?)?;
        let flags = r.u32()?;
        let sequence = r.u64()?;
        let log_offset = r.u64()?;
        let generation = r.u64()?;
        let durable_sequence = r.u64()?;
        let prev_crc = r.u32()?;
        let entry_count = r.u16()? as usize;
        let data_count = r.u16()? as usize;
        let format_tag = r.u32()?;
        let stored = r.u32()?;
        if entry_count > Self::entries_max(block_size_bytes) {
            return Err(DecodeError::OutOfRange {
                field: "entry_count",
                value: entry_count as u64,
            });
        }
        let used = RECORD_HEADER_FIXED_BYTES + entry_count * RECORD_ENTRY_BYTES;
        if buf.len() < used {
            return Err(DecodeError::Short {
                need: used,
                have: buf.len(),
            });
        }
        let computed = crc_with_hole(&buf[..used], RECORD_CRC_OFFSET);
        if stored != computed {
            return Err(DecodeError::BadChecksum { stored, computed });
        }
        if flags & !RECORD_FLAG_EPOCH_END != 0 {
            return Err(DecodeError::OutOfRange {
                field: "record_flags",
                value: flags as u64,
            });
        }
        let entries = (0..entry_count)
            .map(|_| decode_entry(&mut r))
            .collect::<Result<Vec<_>, _>>()?;
        let header = RecordHeader {
            sequence,
            log_offset,
            generation,
            durable_sequence,
            prev_crc,
            format_tag,
            flags,
            entries,
        };
        if header.data_count() != data_count {
            return Err(DecodeError::OutOfRange {
                field: "data_count",
                value: data_count as u64,
            });
        }
        Ok((header, stored))
    }
}

pub const CHECKPOINT_HEADER_BYTES: usize = 4096;
pub const CHECKPOINT_ENTRY_BYTES: usize = 16;
pub const PENDING_RANGE_BYTES: usize = 32;
/// A block lost to corruption, in a checkpoint's payload: its address.
pub const LOST_BLOCK_BYTES: usize = 8;
const CHECKPOINT_CRC_OFFSET: usize = 124;
/// Where the lifetime counters start in the checkpoint header's block
/// (after the header's crc; see `lifetime`).
pub const CHECKPOINT_LIFETIME_OFFSET: usize = 128;

/// One live cache slot in a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointEntry {
    pub slot: u32,
    pub lba: u64,
    pub crc: u32,
    /// Engine-defined slot state bits.
    pub state: u8,
}

/// A zero/discard range not yet written back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingRange {
    pub start_lba: u64,
    pub block_count: u64,
    /// Logical offset of the record that holds it.
    pub record_offset: u64,
    pub kind: RangeKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointHeader {
    pub sequence: u64,
    pub generation: u64,
    /// Replay continues at this logical offset, expecting `next_record_sequence`
    /// whose `prev_crc` is `prev_crc`.
    pub head_offset: u64,
    pub next_record_sequence: u64,
    pub prev_crc: u32,
    pub tail_offset: u64,
    pub writeback_offset: u64,
    pub durable_sequence: u64,
    pub entry_count: u64,
    pub range_count: u32,
    pub payload_crc: u32,
    /// Blocks whose newest data was lost to corruption (they read as EIO
    /// until rewritten); listed after the ranges. Zero in checkpoints
    /// written before it existed (the field was padding).
    pub lost_count: u32,
}

impl CheckpointHeader {
    pub fn payload_bytes(entry_count: u64, range_count: u32, lost_count: u32) -> u64 {
        entry_count * CHECKPOINT_ENTRY_BYTES as u64
            + range_count as u64 * PENDING_RANGE_BYTES as u64
            + lost_count as u64 * LOST_BLOCK_BYTES as u64
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut buf = vec![0u8; CHECKPOINT_HEADER_BYTES];
        {
            let mut w = Writer::new(&mut buf);
            w.u64(CHECKPOINT_MAGIC);
            w.u32(STRUCTURE_VERSION);
            w.u32(0);
            w.u64(self.sequence);
            w.u64(self.generation);
            w.u64(self.head_offset);
            w.u64(self.next_record_sequence);
            w.u32(self.prev_crc);
            w.u32(0);
            w.u64(self.tail_offset);
            w.u64(self.writeback_offset);
            w.u64(self.durable_sequence);
            w.u64(self.entry_count);
            w.u32(self.range_count);
            w.u32(self.payload_crc);
            w.u32(self.lost_count);
            debug_assert!(w.position() <= CHECKPOINT_CRC_OFFSET);
        }
        let crc = crc_with_hole(&buf[..CHECKPOINT_CRC_OFFSET + 4], CHECKPOINT_CRC_OFFSET);
        buf[CHECKPOINT_CRC_OFFSET..CHECKPOINT_CRC_OFFSET + 4].copy_from_slice(&crc.to_le_bytes());
        buf
    }

    pub fn decode(buf: &[u8]) -> Result<CheckpointHeader, DecodeError> {
        if buf.len() < CHECKPOINT_CRC_OFFSET + 4 {
            return Err(DecodeError::Short {
                need: CHECKPOINT_CRC_OFFSET + 4,
                have: buf.len(),
            });
        }
        let mut r = Reader::new(buf);
        check_magic(r.u64()?, CHECKPOINT_MAGIC)?;
        check_version(r.u32()?)?;
        let stored = u32::from_le_bytes([
            buf[CHECKPOINT_CRC_OFFSET],
            buf[CHECKPOINT_CRC_OFFSET + 1],
            buf[CHECKPOINT_CRC_OFFSET + 2],
            buf[CHECKPOINT_CRC_OFFSET + 3],
        ]);
        let computed = crc_with_hole(&buf[..CHECKPOINT_CRC_OFFSET + 4], CHECKPOINT_CRC_OFFSET);
        if stored != computed {
            return Err(DecodeError::BadChecksum { stored, computed });
        }
        let _flags = r.u32()?;
        let sequence = r.u64()?;
        let generation = r.u64()?;
        let head_offset = r.u64()?;
        let next_record_sequence = r.u64()?;
        let prev_crc = r.u32()?;
        let _pad = r.u32()?;
        Ok(CheckpointHeader {
            sequence,
            generation,
            head_offset,
            next_record_sequence,
            prev_crc,
            tail_offset: r.u64()?,
            writeback_offset: r.u64()?,
            durable_sequence: r.u64()?,
            entry_count: r.u64()?,
            range_count: r.u32()?,
            payload_crc: r.u32()?,
            lost_count: r.u32()?,
        })
    }
}

/// One entry of a record header: a data block or a zero/discard range,
/// named by keys of one volume.
fn decode_entry(r: &mut Reader<'_>) -> Result<RecordEntry, DecodeError> {
    let kind = r.u8()?;
    let eflags = r.u8()?;
    let _pad = r.u16()?;
    let crc_or_count = r.u32()?;
    let lba = r.u64()?;
    if lba > KEY_MAX {
        return Err(DecodeError::OutOfRange {
            field: "entry_lba",
            value: lba,
        });
    }
    match kind {
        ENTRY_KIND_DATA => Ok(RecordEntry::Data {
            lba,
            crc: crc_or_count,
            clean: eflags & ENTRY_FLAG_CLEAN != 0,
        }),
        ENTRY_KIND_ZERO | ENTRY_KIND_DISCARD => {
            if crc_or_count == 0 {
                return Err(DecodeError::OutOfRange {
                    field: "range_block_count",
                    value: 0,
                });
            }
            if !keys_in_one_volume(lba, crc_or_count as u64) {
                return Err(DecodeError::OutOfRange {
                    field: "range_crosses_volumes",
                    value: lba,
                });
            }
            Ok(RecordEntry::Range {
                kind: if kind == ENTRY_KIND_ZERO {
                    RangeKind::Zero
                } else {
                    RangeKind::Discard
                },
                lba,
                block_count: crc_or_count,
            })
        }
        other => Err(DecodeError::OutOfRange {
            field: "entry_kind",
            value: other as u64,
        }),
    }
}

impl CheckpointEntry {
    pub fn encode(&self, w: &mut Writer<'_>) {
        assert!(self.lba <= KEY_MAX);
        w.u32(self.slot);
        w.u32(self.crc);
        w.u64(self.lba | (self.state as u64) << 56);
    }

    pub fn decode(r: &mut Reader<'_>) -> Result<CheckpointEntry, DecodeError> {
        let slot = r.u32()?;
        let crc = r.u32()?;
        let packed = r.u64()?;
        let lba = packed & ((1 << 56) - 1);
        if lba > KEY_MAX {
            return Err(DecodeError::OutOfRange {
                field: "checkpoint_lba",
                value: lba,
            });
        }
        Ok(CheckpointEntry {
            slot,
            lba,
            crc,
            state: (packed >> 56) as u8,
        })
    }
}

impl PendingRange {
    pub fn encode(&self, w: &mut Writer<'_>) {
        w.u64(self.start_lba);
        w.u64(self.block_count);
        w.u64(self.record_offset);
        w.u8(match self.kind {
            RangeKind::Zero => ENTRY_KIND_ZERO,
            RangeKind::Discard => ENTRY_KIND_DISCARD,
        });
        w.skip(7);
    }

    pub fn decode(r: &mut Reader<'_>) -> Result<PendingRange, DecodeError> {
        let start_lba = r.u64()?;
        let block_count = r.u64()?;
        let record_offset = r.u64()?;
        let kind = match r.u8()? {
            ENTRY_KIND_ZERO => RangeKind::Zero,
            ENTRY_KIND_DISCARD => RangeKind::Discard,
            other => {
                return Err(DecodeError::OutOfRange {
                    field: "range_kind",
                    value: other as u64,
                })
            }
        };
        r.bytes(7)?;
        if !keys_in_one_volume(start_lba, block_count) {
            return Err(DecodeError::OutOfRange {
                field: "range",
                value: start_lba,
            });
        }
        Ok(PendingRange {
            start_lba,
            block_count,
            record_offset,
            kind,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header(entries: Vec<RecordEntry>) -> RecordHeader {
        RecordHeader {
            sequence: 42,
            log_offset: 1000,
            generation: 3,
            durable_sequence: 40,
            prev_crc: 0xdead_beef,
            format_tag: 0x1234_5678,
            flags: RECORD_FLAG_EPOCH_END,
            entries,
        }
    }

    #[test]
    fn record_roundtrip_and_flip_detection() {
        let h = header(vec![
            RecordEntry::Data {
                lba: 5,
                crc: 9,
                clean: false,
            },
            RecordEntry::Range {
                kind: RangeKind::Zero,
                lba: 100,
                block_count: 7,
            },
            RecordEntry::Data {
                lba: 6,
                crc: 10,
                clean: true,
            },
        ]);
        let (buf, crc) = h.encode(4096);
        let (back, crc2) = RecordHeader::decode(&buf, 4096).unwrap();
        assert_eq!(back, h);
        assert_eq!(crc, crc2);
        assert_eq!(back.length_blocks(), 3);
        let used = RECORD_HEADER_FIXED_BYTES + 3 * RECORD_ENTRY_BYTES;
        for i in 0..used {
            let mut bad = buf.clone();
            bad[i] ^= 1;
            assert!(RecordHeader::decode(&bad, 4096).is_err(), "flip at {i}");
        }
    }

    #[test]
    fn keys_of_every_volume_round_trip_and_ranges_never_cross_volumes() {
        let last_volume = crate::VOLUMES_MAX as u16 - 1;
        let top = crate::block_key(last_volume, crate::ORIGIN_BLOCKS_MAX);
        assert_eq!(top, KEY_MAX);
        let h = header(vec![
            RecordEntry::Data {
                lba: crate::block_key(3, 77),
                crc: 1,
                clean: false,
            },
            RecordEntry::Range {
                kind: RangeKind::Discard,
                lba: top - 9,
                block_count: 10,
            },
        ]);
        let (buf, _) = h.encode(4096);
        assert_eq!(RecordHeader::decode(&buf, 4096).unwrap().0, h);
        // Bytes a bug or a forger could write (with a good crc): a key past
        // the last volume, and a range running from one volume into the next.
        let forged = |lba: u64, count: u32| {
            let entry = if count == 0 {
                RecordEntry::Data {
                    lba: 0,
                    crc: 0,
                    clean: false,
                }
            } else {
                RecordEntry::Range {
                    kind: RangeKind::Zero,
                    lba: 0,
                    block_count: count,
                }
            };
            let mut buf = header(vec![entry]).encode(4096).0;
            let at = RECORD_HEADER_FIXED_BYTES;
            buf[at + 8..at + 16].copy_from_slice(&lba.to_le_bytes());
            let used = RECORD_HEADER_FIXED_BYTES + RECORD_ENTRY_BYTES;
            let crc = crc_with_hole(&buf[..used], RECORD_CRC_OFFSET);
            buf[RECORD_CRC_OFFSET..RECORD_CRC_OFFSET + 4].copy_from_slice(&crc.to_le_bytes());
            RecordHeader::decode(&buf, 4096)
        };
        assert!(forged(KEY_MAX, 0).is_ok());
        assert!(forged(KEY_MAX + 1, 0).is_err());
        assert!(forged(crate::block_key(1, 0) - 2, 2).is_ok());
        assert_eq!(
            forged(crate::block_key(1, 0) - 2, 3),
            Err(DecodeError::OutOfRange {
                field: "range_crosses_volumes",
                value: crate::block_key(1, 0) - 2
            })
        );
        let range = |start_lba, block_count| PendingRange {
            start_lba,
            block_count,
            record_offset: 0,
            kind: RangeKind::Zero,
        };
        for (r, ok) in [
            (range(top - 1, 2), true),
            (range(top, 2), false),
            (range(crate::block_key(2, 0) - 1, 2), false),
        ] {
            let mut buf = vec![0u8; PENDING_RANGE_BYTES];
            r.encode(&mut Writer::new(&mut buf));
            assert_eq!(
                PendingRange::decode(&mut Reader::new(&buf)).is_ok(),
                ok,
                "{r:?}"
            );
        }
    }

    #[test]
    fn checkpoint_header_roundtrip() {
        let h = CheckpointHeader {
            sequence: 1,
            generation: 2,
            head_offset: 3,
            next_record_sequence: 4,
            prev_crc: 5,
            tail_offset: 6,
            writeback_offset: 7,
            durable_sequence: 8,
            entry_count: 9,
            range_count: 10,
            payload_crc: 11,
            lost_count: 12,
        };
        let buf = h.encode();
        assert_eq!(CheckpointHeader::decode(&buf).unwrap(), h);
        for i in 0..CHECKPOINT_CRC_OFFSET + 4 {
            let mut bad = buf.clone();
            bad[i] ^= 0x10;
            assert!(CheckpointHeader::decode(&bad).is_err(), "flip at {i}");
        }
    }

    proptest! {
        #[test]
        fn record_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..5000)) {
            let _ = RecordHeader::decode(&bytes, 4096);
            let _ = CheckpointHeader::decode(&bytes);
            let _ = crate::Superblock::decode(&bytes);
        }
    }
}
