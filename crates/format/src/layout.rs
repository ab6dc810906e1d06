//! Where things live on the cache device, derived from its size and the
//! block size. Deterministic, so the superblock only has to store the
//! results for cross-checking.

use crate::{
    align_up, block_size_valid, record_data_blocks_max, tag_pages_for, CHECKPOINT_ENTRY_BYTES,
    CHECKPOINT_HEADER_BYTES, FEATURE_LARGE_RECORDS, LOG_RECORDS_MIN, METADATA_AREA_OFFSET,
    PENDING_RANGES_MAX, PENDING_RANGE_BYTES, TAG_PAGE_BYTES,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub block_size_bytes: u32,
    pub checkpoint_slot_bytes: u64,
    pub log_blocks: u64,
    /// Tag pages per copy (0 without origin integrity).
    pub tag_pages: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("block size {0} is not a power of two between 4096 and 65536 bytes")]
    BadBlockSize(u32),
    #[error(
        "cache device is too small: {size_bytes} bytes, but block size {block_size_bytes} needs at least {min_bytes} bytes"
    )]
    CacheTooSmall {
        size_bytes: u64,
        min_bytes: u64,
        block_size_bytes: u32,
    },
    #[error(
        "cache device is too small for origin integrity: {size_bytes} bytes, but the integrity tag area takes {tag_area_bytes} bytes and the cache needs at least {min_bytes} bytes in all. Use a larger cache, a larger block size, or tags for fewer origin bytes"
    )]
    CacheTooSmallForTags {
        size_bytes: u64,
        min_bytes: u64,
        tag_area_bytes: u64,
    },
    #[error(
        "cache device is too large: {size_bytes} bytes would make a log of {log_blocks} blocks of {block_size_bytes} bytes, but slot indices are 32-bit (at most {log_blocks_max} blocks). Use a larger block size or a smaller cache"
    )]
    CacheTooLarge {
        size_bytes: u64,
        log_blocks: u64,
        log_blocks_max: u64,
        block_size_bytes: u32,
    },
}

impl Layout {
    /// Log slots are indexed by `u32`: a log has fewer blocks than this.
    pub const LOG_BLOCKS_LIMIT: u64 = u32::MAX as u64;

    pub fn checkpoint_slot_bytes_for(log_blocks: u64, block_size_bytes: u32) -> u64 {
        let raw = CHECKPOINT_HEADER_BYTES as u64
            + log_blocks * CHECKPOINT_ENTRY_BYTES as u64
            + (PENDING_RANGES_MAX * PENDING_RANGE_BYTES) as u64;
        align_up(raw, block_size_bytes as u64)
    }

    /// Bytes of the tag area (both copies), padded to a whole block so the
    /// checkpoint slots and the log stay block aligned.
    /// Saturates: a page count from a user or a device too large for any
    /// cache gives `u64::MAX` bytes, which no cache has room for.
    pub fn tag_area_bytes_for_pages(tag_pages: u64, block_size_bytes: u32) -> u64 {
        let bytes = tag_pages.saturating_mul(2 * TAG_PAGE_BYTES as u64);
        if bytes > u64::MAX - block_size_bytes as u64 {
            return u64::MAX;
        }
        align_up(bytes, block_size_bytes as u64)
    }

    fn bytes_needed(log_blocks: u64, block_size_bytes: u32, tag_pages: u64) -> u64 {
        METADATA_AREA_OFFSET
            .saturating_add(Self::tag_area_bytes_for_pages(tag_pages, block_size_bytes))
            .saturating_add(2 * Self::checkpoint_slot_bytes_for(log_blocks, block_size_bytes))
            .saturating_add(log_blocks * block_size_bytes as u64)
    }

    /// The smallest log: [`LOG_RECORDS_MIN`] of the records a cache without
    /// `FEATURE_LARGE_RECORDS` writes.
    pub fn log_blocks_min(block_size_bytes: u32) -> u64 {
        Self::log_blocks_min_for(block_size_bytes, 0)
    }

    /// The smallest log for a cache with superblock `features`: it holds
    /// [`LOG_RECORDS_MIN`] of its largest records.
    pub fn log_blocks_min_for(block_size_bytes: u32, features: u32) -> u64 {
        LOG_RECORDS_MIN * (record_data_blocks_max(block_size_bytes, features) as u64 + 1)
    }

    /// Is this log large enough for records of `FEATURE_LARGE_RECORDS`?
    pub fn holds_large_records(&self) -> bool {
        self.log_blocks >= Self::log_blocks_min_for(self.block_size_bytes, FEATURE_LARGE_RECORDS)
    }

    pub fn cache_bytes_min(block_size_bytes: u32) -> u64 {
        Self::cache_bytes_min_for(block_size_bytes, 0)
    }

    /// The smallest cache (no tags) whose log holds [`LOG_RECORDS_MIN`] of
    /// the records of a cache with `features`.
    pub fn cache_bytes_min_for(block_size_bytes: u32, features: u32) -> u64 {
        Self::bytes_needed(
            Self::log_blocks_min_for(block_size_bytes, features),
            block_size_bytes,
            0,
        )
    }

    /// The largest log that fits a cache of `cache_size_bytes` (no tags).
    pub fn compute(cache_size_bytes: u64, block_size_bytes: u32) -> Result<Layout, LayoutError> {
        Self::compute_with_tags(cache_size_bytes, block_size_bytes, None)
    }

    /// The largest log that fits a cache of `cache_size_bytes`, after a tag
    /// area for `integrity_origin_blocks` origin blocks if given.
    pub fn compute_with_tags(
        cache_size_bytes: u64,
        block_size_bytes: u32,
        integrity_origin_blocks: Option<u64>,
    ) -> Result<Layout, LayoutError> {
        let tag_pages = integrity_origin_blocks.map_or(0, tag_pages_for);
        Self::compute_with_tag_pages(cache_size_bytes, block_size_bytes, tag_pages)
    }

    /// The largest log that fits a cache of `cache_size_bytes`, after a tag
    /// area of `tag_pages` pages per copy.
    pub fn compute_with_tag_pages(
        cache_size_bytes: u64,
        block_size_bytes: u32,
        tag_pages: u64,
    ) -> Result<Layout, LayoutError> {
        if !block_size_valid(block_size_bytes) {
            return Err(LayoutError::BadBlockSize(block_size_bytes));
        }
        let tag_area_bytes = Self::tag_area_bytes_for_pages(tag_pages, block_size_bytes);
        let min_bytes = Self::bytes_needed(
            Self::log_blocks_min(block_size_bytes),
            block_size_bytes,
            tag_pages,
        );
        if cache_size_bytes < min_bytes {
            if tag_pages > 0 {
                return Err(LayoutError::CacheTooSmallForTags {
                    size_bytes: cache_size_bytes,
                    min_bytes,
                    tag_area_bytes,
                });
            }
            return Err(LayoutError::CacheTooSmall {
                size_bytes: cache_size_bytes,
                min_bytes,
                block_size_bytes,
            });
        }
        // Each log block costs its own bytes plus two checkpoint entries.
        let per_block = block_size_bytes as u64 + 2 * CHECKPOINT_ENTRY_BYTES as u64;
        let mut log_blocks = (cache_size_bytes - METADATA_AREA_OFFSET - tag_area_bytes) / per_block;
        // Alignment of the checkpoint slots may cost a few blocks; bounded.
        for _ in 0..64 {
            if Self::bytes_needed(log_blocks, block_size_bytes, tag_pages) <= cache_size_bytes {
                break;
            }
            log_blocks -= 1;
        }
        assert!(Self::bytes_needed(log_blocks, block_size_bytes, tag_pages) <= cache_size_bytes);
        assert!(log_blocks >= Self::log_blocks_min(block_size_bytes));
        // The size comes from the device (format) or the superblock (open):
        // a cache too large for 32-bit slot indices is an error, not a panic.
        if log_blocks >= Self::LOG_BLOCKS_LIMIT {
            return Err(LayoutError::CacheTooLarge {
                size_bytes: cache_size_bytes,
                log_blocks,
                log_blocks_max: Self::LOG_BLOCKS_LIMIT - 1,
                block_size_bytes,
            });
        }
        Ok(Layout {
            block_size_bytes,
            checkpoint_slot_bytes: Self::checkpoint_slot_bytes_for(log_blocks, block_size_bytes),
            log_blocks,
            tag_pages,
        })
    }

    pub fn tag_area_bytes(&self) -> u64 {
        Self::tag_area_bytes_for_pages(self.tag_pages, self.block_size_bytes)
    }

    /// Byte offset of copy `copy` (0 or 1) of tag page `page`.
    pub fn tag_page_offset_bytes(&self, page: u64, copy: u8) -> u64 {
        assert!(copy <= 1);
        assert!(page < self.tag_pages);
        METADATA_AREA_OFFSET + (copy as u64 * self.tag_pages + page) * TAG_PAGE_BYTES as u64
    }

    pub fn checkpoint_offset_bytes(&self, slot: u8) -> u64 {
        assert!(slot <= 1);
        METADATA_AREA_OFFSET + self.tag_area_bytes() + slot as u64 * self.checkpoint_slot_bytes
    }

    pub fn log_offset_bytes(&self) -> u64 {
        METADATA_AREA_OFFSET + self.tag_area_bytes() + 2 * self.checkpoint_slot_bytes
    }

    /// Byte offset on the cache device of physical log slot `slot`.
    pub fn slot_offset_bytes(&self, slot: u64) -> u64 {
        assert!(slot < self.log_blocks);
        self.log_offset_bytes() + slot * self.block_size_bytes as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fits_and_is_tight() {
        for &bs in &[4096u32, 8192, 65536] {
            for &size in &[64u64 << 20, 1 << 30, (1 << 30) + 12345, 100 << 30] {
                let l = Layout::compute(size, bs).unwrap();
                let end = l.log_offset_bytes() + l.log_blocks * bs as u64;
                assert!(end <= size);
                // Wastes less than a few blocks plus alignment.
                assert!(
                    size - end < 4 * bs as u64 + 2 * bs as u64 + 64 * 32,
                    "{bs} {size}"
                );
            }
        }
    }

    #[test]
    fn tag_area_sits_before_the_checkpoints() {
        let origin_blocks = 1u64 << 20; // 4 GiB of origin at 4 KiB
        let plain = Layout::compute(256 << 20, 4096).unwrap();
        let tagged = Layout::compute_with_tags(256 << 20, 4096, Some(origin_blocks)).unwrap();
        assert_eq!(tagged.tag_pages, crate::tag_pages_for(origin_blocks));
        assert!(tagged.log_blocks < plain.log_blocks);
        let last_page_end = tagged.tag_page_offset_bytes(tagged.tag_pages - 1, 1) + 4096;
        assert!(last_page_end <= tagged.checkpoint_offset_bytes(0));
        assert_eq!(tagged.checkpoint_offset_bytes(0) % 4096, 0);
        let end = tagged.log_offset_bytes() + tagged.log_blocks * 4096;
        assert!(end <= 256 << 20);
        // 64 KiB blocks: the checkpoint slots stay block aligned.
        let big = Layout::compute_with_tags(1 << 30, 65536, Some(12345)).unwrap();
        assert_eq!(big.checkpoint_offset_bytes(0) % 65536, 0);
    }

    #[test]
    fn a_tag_area_too_large_for_any_cache_is_an_error_not_an_overflow() {
        for pages in [u64::MAX, u64::MAX / 8192 + 1, 1 << 52] {
            assert!(matches!(
                Layout::compute_with_tag_pages(1 << 40, 4096, pages),
                Err(LayoutError::CacheTooSmallForTags { .. })
            ));
        }
    }

    #[test]
    fn too_small_for_tags_names_the_tag_area() {
        let err = Layout::compute_with_tags(8 << 20, 4096, Some(1 << 30)).unwrap_err();
        match err {
            LayoutError::CacheTooSmallForTags {
                tag_area_bytes,
                min_bytes,
                ..
            } => {
                assert!(tag_area_bytes > 8 << 20);
                assert!(min_bytes > tag_area_bytes);
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    /// A cache of 20 TiB at 4 KiB blocks needs more than 2^32 log slots: it
    /// used to trip an assert (a panic reachable from `cairn format` on a
    /// large device, or from a superblock's cache size at open).
    #[test]
    fn too_large_for_u32_slots_is_an_error() {
        let size = 20u64 << 40;
        match Layout::compute(size, 4096) {
            Err(LayoutError::CacheTooLarge {
                size_bytes,
                log_blocks,
                log_blocks_max,
                block_size_bytes: 4096,
            }) => {
                assert_eq!(size_bytes, size);
                assert!(log_blocks > log_blocks_max);
                assert_eq!(log_blocks_max, u32::MAX as u64 - 1);
            }
            other => panic!("unexpected {other:?}"),
        }
        // The same size fits with 64 KiB blocks.
        let big = Layout::compute(size, 65536).unwrap();
        assert!(big.log_blocks < Layout::LOG_BLOCKS_LIMIT);
        // Just below the limit is still accepted.
        let per_block = 4096 + 2 * crate::CHECKPOINT_ENTRY_BYTES as u64;
        let near = METADATA_AREA_OFFSET + (u32::MAX as u64 - 200) * per_block;
        assert!(Layout::compute(near, 4096).unwrap().log_blocks < Layout::LOG_BLOCKS_LIMIT);
    }

    #[test]
    fn too_small_is_an_error() {
        let min = Layout::cache_bytes_min(4096);
        assert!(Layout::compute(min, 4096).is_ok());
        assert!(matches!(
            Layout::compute(min - 1, 4096),
            Err(LayoutError::CacheTooSmall { .. })
        ));
        assert_eq!(
            Layout::compute(1 << 30, 5000),
            Err(LayoutError::BadBlockSize(5000))
        );
    }

    /// Large records: 252 data blocks at 4 KiB (the header binds), 1 MiB at
    /// larger blocks; 64 blocks (256 KiB) without the feature. A log holds
    /// them only from 8 records' worth up.
    #[test]
    fn large_records_and_the_logs_that_hold_them() {
        use crate::{record_data_blocks_max, FEATURE_INTEGRITY, FEATURE_LARGE_RECORDS};
        let large = FEATURE_LARGE_RECORDS | FEATURE_INTEGRITY;
        assert_eq!(record_data_blocks_max(4096, 0), 64);
        assert_eq!(record_data_blocks_max(4096, FEATURE_INTEGRITY), 64);
        assert_eq!(record_data_blocks_max(4096, large), 252);
        assert_eq!(record_data_blocks_max(8192, large), 128);
        assert_eq!(record_data_blocks_max(65536, 0), 4);
        assert_eq!(record_data_blocks_max(65536, large), 16);
        for block_bytes in [4096u32, 16384, 65536] {
            let need = Layout::log_blocks_min_for(block_bytes, FEATURE_LARGE_RECORDS);
            assert!(need > Layout::log_blocks_min(block_bytes));
            let smallest = Layout::compute(Layout::cache_bytes_min(block_bytes), block_bytes)
                .expect("the smallest cache");
            assert!(!smallest.holds_large_records());
            let large_min = Layout::cache_bytes_min_for(block_bytes, FEATURE_LARGE_RECORDS);
            // The boundary is exact: one block of log fewer is too small.
            let just = Layout::compute(large_min, block_bytes).expect("layout");
            assert!(just.log_blocks == need && just.holds_large_records());
            let short =
                Layout::compute(large_min - block_bytes as u64, block_bytes).expect("layout");
            assert!(short.log_blocks == need - 1 && !short.holds_large_records());
        }
    }
}
