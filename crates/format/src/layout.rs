//! Where things live on the cache device, derived from its size and the
//! block size. Deterministic, so the superblock only has to store the
//! results for cross-checking.

use crate::{
    align_up, block_size_valid, record_data_blocks_max, CHECKPOINT_ENTRY_BYTES,
    CHECKPOINT_HEADER_BYTES, LOG_RECORDS_MIN, METADATA_AREA_OFFSET, PENDING_RANGES_MAX,
    PENDING_RANGE_BYTES,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub block_size_bytes: u32,
    pub checkpoint_slot_bytes: u64,
    pub log_blocks: u64,
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
}

impl Layout {
    pub fn checkpoint_slot_bytes_for(log_blocks: u64, block_size_bytes: u32) -> u64 {
        let raw = CHECKPOINT_HEADER_BYTES as u64
            + log_blocks * CHECKPOINT_ENTRY_BYTES as u64
            + (PENDING_RANGES_MAX * PENDING_RANGE_BYTES) as u64;
        align_up(raw, block_size_bytes as u64)
    }

    fn bytes_needed(log_blocks: u64, block_size_bytes: u32) -> u64 {
        METADATA_AREA_OFFSET
            + 2 * Self::checkpoint_slot_bytes_for(log_blocks, block_size_bytes)
            + log_blocks * block_size_bytes as u64
    }

    pub fn log_blocks_min(block_size_bytes: u32) -> u64 {
        LOG_RECORDS_MIN * (record_data_blocks_max(block_size_bytes) as u64 + 1)
    }

    pub fn cache_bytes_min(block_size_bytes: u32) -> u64 {
        Self::bytes_needed(Self::log_blocks_min(block_size_bytes), block_size_bytes)
    }

    /// The largest log that fits a cache of `cache_size_bytes`.
    pub fn compute(cache_size_bytes: u64, block_size_bytes: u32) -> Result<Layout, LayoutError> {
        if !block_size_valid(block_size_bytes) {
            return Err(LayoutError::BadBlockSize(block_size_bytes));
        }
        let min_bytes = Self::cache_bytes_min(block_size_bytes);
        if cache_size_bytes < min_bytes {
            return Err(LayoutError::CacheTooSmall {
                size_bytes: cache_size_bytes,
                min_bytes,
                block_size_bytes,
            });
        }
        // Each log block costs its own bytes plus two checkpoint entries.
        let per_block = block_size_bytes as u64 + 2 * CHECKPOINT_ENTRY_BYTES as u64;
        let mut log_blocks = (cache_size_bytes - METADATA_AREA_OFFSET) / per_block;
        // Alignment of the checkpoint slots may cost a few blocks; bounded.
        for _ in 0..64 {
            if Self::bytes_needed(log_blocks, block_size_bytes) <= cache_size_bytes {
                break;
            }
            log_blocks -= 1;
        }
        assert!(Self::bytes_needed(log_blocks, block_size_bytes) <= cache_size_bytes);
        assert!(log_blocks >= Self::log_blocks_min(block_size_bytes));
        assert!(log_blocks < u32::MAX as u64, "slot indices are u32");
        Ok(Layout {
            block_size_bytes,
            checkpoint_slot_bytes: Self::checkpoint_slot_bytes_for(log_blocks, block_size_bytes),
            log_blocks,
        })
    }

    pub fn checkpoint_offset_bytes(&self, slot: u8) -> u64 {
        assert!(slot <= 1);
        METADATA_AREA_OFFSET + slot as u64 * self.checkpoint_slot_bytes
    }

    pub fn log_offset_bytes(&self) -> u64 {
        METADATA_AREA_OFFSET + 2 * self.checkpoint_slot_bytes
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
}
