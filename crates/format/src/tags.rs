//! Origin integrity tags (the `FEATURE_INTEGRITY` feature).
//!
//! One 32-bit tag per origin block, kept on the cache device in 4 KiB tag
//! pages. Every page exists twice (copy 0 and copy 1); a page is rewritten
//! into the copy that does not hold its newest valid version, so a torn page
//! write leaves the previous version in charge. Each page carries a magic,
//! the format version, the format tag of the cache it belongs to (so pages
//! of an earlier format never count), its index, a sequence number (higher
//! wins between the two copies) and a crc32c.
//!
//! Tag values: three are reserved for block states, every other value is
//! `origin_tag(lba, data)`, the block checksum folded out of the reserved
//! range.

use crate::codec::{check_magic, check_version, crc_with_hole, Reader, Writer};
use crate::{block_checksum, DecodeError, TAG_PAGE_MAGIC};

/// Bytes of one tag page on the cache device (whatever the block size).
pub const TAG_PAGE_BYTES: usize = 4096;
pub const TAG_PAGE_HEADER_BYTES: usize = 64;
/// Tags held by one page.
pub const TAGS_PER_PAGE: usize = (TAG_PAGE_BYTES - TAG_PAGE_HEADER_BYTES) / 4;
const TAG_PAGE_CRC_OFFSET: usize = 36;

/// Not yet computed (the block has not been recalculated since format):
/// reads of it are served unverified and counted.
pub const TAG_UNSET: u32 = 0;
/// The block was discarded: cairn reads it as zeroes without asking the
/// origin, whose contents after a discard are unspecified.
pub const TAG_DISCARDED: u32 = 1;
/// The block was zeroed on the origin (write-zeroes): it must read back as
/// all zero bytes.
pub const TAG_ZERO: u32 = 2;
/// Values below this are states, not checksums.
pub const TAG_RESERVED_MAX: u32 = 3;

/// The tag of an origin block holding `data` at block address `lba`: the
/// block checksum (covering the address, so misdirected writes are caught),
/// moved out of the reserved values. Folding costs one bit of strength for
/// six checksum values out of four billion.
pub fn origin_tag(lba: u64, data: &[u8]) -> u32 {
    fold_tag(block_checksum(lba, data))
}

/// Move a block checksum out of the reserved tag values.
pub fn fold_tag(checksum: u32) -> u32 {
    if checksum < TAG_RESERVED_MAX {
        checksum + TAG_RESERVED_MAX
    } else {
        checksum
    }
}

/// Does `data` (the origin's copy of block `lba`) agree with `tag`?
/// `None` if the tag cannot tell (unset or discarded).
pub fn tag_matches(tag: u32, lba: u64, data: &[u8]) -> Option<bool> {
    match tag {
        TAG_UNSET | TAG_DISCARDED => None,
        TAG_ZERO => Some(data.iter().all(|&b| b == 0)),
        _ => Some(origin_tag(lba, data) == tag),
    }
}

/// How many tag pages cover an origin of `origin_blocks` blocks.
pub fn tag_pages_for(origin_blocks: u64) -> u64 {
    origin_blocks.div_ceil(TAGS_PER_PAGE as u64)
}

/// Bytes of the tag area (both copies) for an origin of `origin_blocks`.
pub fn tag_area_bytes_for(origin_blocks: u64) -> u64 {
    2 * tag_pages_for(origin_blocks) * TAG_PAGE_BYTES as u64
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagPage {
    pub page_index: u64,
    /// Higher wins between the two copies of a page.
    pub sequence: u64,
    /// `crc32c(uuid)` of the cache this page belongs to.
    pub format_tag: u32,
    pub tags: Vec<u32>,
}

impl TagPage {
    /// Encode into `buf` (exactly `TAG_PAGE_BYTES`).
    pub fn encode_into(&self, buf: &mut [u8]) {
        assert_eq!(buf.len(), TAG_PAGE_BYTES);
        assert_eq!(self.tags.len(), TAGS_PER_PAGE);
        buf.fill(0);
        {
            let mut w = Writer::new(buf);
            w.u64(TAG_PAGE_MAGIC);
            w.u32(crate::STRUCTURE_VERSION);
            w.u32(self.format_tag);
            w.u64(self.page_index);
            w.u64(self.sequence);
            w.u32(TAGS_PER_PAGE as u32);
            assert_eq!(w.position(), TAG_PAGE_CRC_OFFSET);
            w.u32(0);
            w.skip(TAG_PAGE_HEADER_BYTES - TAG_PAGE_CRC_OFFSET - 4);
            for &t in &self.tags {
                w.u32(t);
            }
        }
        let crc = crc_with_hole(buf, TAG_PAGE_CRC_OFFSET);
        buf[TAG_PAGE_CRC_OFFSET..TAG_PAGE_CRC_OFFSET + 4].copy_from_slice(&crc.to_le_bytes());
    }

    /// Decode and validate one page copy. The caller checks `page_index` and
    /// `format_tag` against where it read the page from.
    pub fn decode(buf: &[u8]) -> Result<TagPage, DecodeError> {
        let buf = crate::codec::prefix(buf, TAG_PAGE_BYTES)?;
        let mut r = Reader::new(buf);
        check_magic(r.u64()?, TAG_PAGE_MAGIC)?;
        check_version(r.u32()?)?;
        let format_tag = r.u32()?;
        let page_index = r.u64()?;
        let sequence = r.u64()?;
        let count = r.u32()?;
        let stored = r.u32()?;
        let computed = crc_with_hole(buf, TAG_PAGE_CRC_OFFSET);
        if stored != computed {
            return Err(DecodeError::BadChecksum { stored, computed });
        }
        if count as usize != TAGS_PER_PAGE {
            return Err(DecodeError::OutOfRange {
                field: "tags_per_page",
                value: count as u64,
            });
        }
        r.bytes(TAG_PAGE_HEADER_BYTES - TAG_PAGE_CRC_OFFSET - 4)?;
        let mut tags = Vec::with_capacity(TAGS_PER_PAGE);
        for _ in 0..TAGS_PER_PAGE {
            tags.push(r.u32()?);
        }
        Ok(TagPage {
            page_index,
            sequence,
            format_tag,
            tags,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> TagPage {
        TagPage {
            page_index: 7,
            sequence: 42,
            format_tag: 0xdead_beef,
            tags: (0..TAGS_PER_PAGE as u32).map(|i| i * 3 + 1).collect(),
        }
    }

    #[test]
    fn roundtrip_and_every_flip_detected() {
        let page = sample();
        let mut buf = vec![0u8; TAG_PAGE_BYTES];
        page.encode_into(&mut buf);
        assert_eq!(TagPage::decode(&buf).unwrap(), page);
        for i in (0..buf.len()).step_by(7) {
            let mut bad = buf.clone();
            bad[i] ^= 0x10;
            assert!(TagPage::decode(&bad).is_err(), "flip at {i} not detected");
        }
    }

    #[test]
    fn reserved_values_are_never_checksums() {
        for c in 0..TAG_RESERVED_MAX {
            assert!(fold_tag(c) >= TAG_RESERVED_MAX);
        }
        assert_eq!(fold_tag(12345), 12345);
        let zeroes = vec![0u8; 4096];
        assert_eq!(tag_matches(TAG_ZERO, 5, &zeroes), Some(true));
        let mut one = zeroes.clone();
        one[100] = 1;
        assert_eq!(tag_matches(TAG_ZERO, 5, &one), Some(false));
        assert_eq!(tag_matches(TAG_UNSET, 5, &one), None);
        assert_eq!(tag_matches(TAG_DISCARDED, 5, &one), None);
        let t = origin_tag(5, &one);
        assert_eq!(tag_matches(t, 5, &one), Some(true));
        // The address is covered: the same bytes at another block fail.
        assert_eq!(tag_matches(t, 6, &one), Some(false));
    }

    #[test]
    fn area_size() {
        assert_eq!(tag_pages_for(0), 0);
        assert_eq!(tag_pages_for(1), 1);
        assert_eq!(tag_pages_for(TAGS_PER_PAGE as u64), 1);
        assert_eq!(tag_pages_for(TAGS_PER_PAGE as u64 + 1), 2);
        assert_eq!(tag_area_bytes_for(1), 2 * 4096);
    }
}
