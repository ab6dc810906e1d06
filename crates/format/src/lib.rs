//! cairn's on-disk format, version 2 (version 1 is read, and upgraded in
//! place by the engine).
//!
//! Pure encode/decode with validation; no I/O happens here. Every structure
//! carries a magic number, a format version and a crc32c. See `docs/format.md`
//! for the picture; this file is the authority.
//!
//! Layout of a cache device (offsets in bytes):
//!
//! ```text
//! 0        superblock copy A (4 KiB)
//! 4096     superblock copy B (4 KiB)
//! 8192     volume table copy 0 (28 KiB, format 2)
//! 36864    volume table copy 1 (28 KiB, format 2)
//! 65536    tag area, only with FEATURE_INTEGRITY (2 copies of every tag page)
//! ...      checkpoint slot 0 (ckpt_slot_bytes)
//! ...      checkpoint slot 1 (ckpt_slot_bytes)
//! ...      log: log_blocks blocks of block_size_bytes, a circular log of records
//! ```

mod codec;
mod layout;
mod lifetime;
mod origin_v1;
mod records;
mod settings;
mod signatures;
mod superblock;
mod superblock_volumes;
mod tag_area;
mod tags;
mod volume_entry;
mod volume_position;
mod volume_table;

pub use codec::{Reader, Writer};
pub use layout::{Layout, LayoutError};
pub use lifetime::{
    decode_lifetime, encode_lifetime, lifetime_key, lifetime_pairs_max, LIFETIME_MAGIC,
};
pub use origin_v1::OriginV1;
pub use records::{
    CheckpointEntry, CheckpointHeader, PendingRange, RangeKind, RecordEntry, RecordHeader,
    CHECKPOINT_ENTRY_BYTES, CHECKPOINT_HEADER_BYTES, CHECKPOINT_LIFETIME_OFFSET, LOST_BLOCK_BYTES,
    PENDING_RANGE_BYTES, RECORD_ENTRY_BYTES, RECORD_FLAG_EPOCH_END, RECORD_HEADER_FIXED_BYTES,
};
pub use settings::{StoredSettings, SETTINGS_COUNT, STORED_SETTINGS_BYTES};
pub use signatures::{existing_contents, ExistingContents, SIGNATURE_PROBE_BYTES};
pub use superblock::{origin_identity_for_superblock, Superblock, ORIGIN_IDENTITY_MAX_BYTES};
pub use superblock_volumes::SuperblockVolumes;
pub use tag_area::{TagArea, TagExtent};
pub use tags::{
    fold_tag, origin_tag, tag_area_bytes_for, tag_matches, tag_pages_for, TagPage, TAGS_PER_PAGE,
    TAG_DISCARDED, TAG_PAGE_BYTES, TAG_PAGE_HEADER_BYTES, TAG_RESERVED_MAX, TAG_UNSET, TAG_ZERO,
};
pub use volume_entry::{VolumeEntry, VolumeState, VOLUME_ENTRY_BYTES, VOLUME_NAME_MAX_BYTES};
pub use volume_position::{VolumePosition, VOLUME_POSITION_BYTES};
pub use volume_table::{
    VolumeTable, VolumeTableExpected, VOLUME_TABLE_COPY_BYTES, VOLUME_TABLE_MAGIC,
    VOLUME_TABLE_OFFSETS, VOLUME_TABLE_VERSION,
};

/// Version of the cache format this code writes, stamped in the
/// superblock: 2, a volume table beside the superblocks (see
/// `volume_table`).
pub const FORMAT_VERSION: u32 = 2;
/// The first format: one origin, described by the superblock itself. It is
/// still read; the engine upgrades it in place at open.
pub const FORMAT_VERSION_V1: u32 = 1;
/// Version stamped in records, checkpoints, tag pages and lifetime
/// counters. Their layout is unchanged since format 1, so a v1 cache's log
/// and checkpoints are read as they are after the upgrade.
pub const STRUCTURE_VERSION: u32 = 1;

pub const SUPERBLOCK_MAGIC: u64 = u64::from_le_bytes(*b"CAIRNSB1");
pub const RECORD_MAGIC: u64 = u64::from_le_bytes(*b"CAIRNREC");
pub const CHECKPOINT_MAGIC: u64 = u64::from_le_bytes(*b"CAIRNCKP");
pub const TAG_PAGE_MAGIC: u64 = u64::from_le_bytes(*b"CAIRNTAG");

/// Superblock feature: origin integrity tags (a tag area between the
/// superblocks and the checkpoint slots; see `tags`).
pub const FEATURE_INTEGRITY: u32 = 1;
/// Superblock feature: the cache is *degraded*. A cache write failed for
/// good, every dirty block was written back to the origin, and from then on
/// writes went straight to the origin. The cache's contents (log, clean
/// copies, checkpoints, tags) may be stale and must never be served or
/// replayed. Set once, cleared only by formatting again.
pub const FEATURE_DEGRADED: u32 = 2;
/// Superblock feature (format 2): the tag area is shared out in extents,
/// one per volume with integrity, so volumes added later can keep tags
/// too. The volume table's header holds the area's size and each entry its
/// first page (see `tag_area`). Without it the tag area, if any, is the
/// first volume's alone. A build that predates it refuses such a cache
/// instead of misreading the tags of a volume it thinks has none.
pub const FEATURE_TAG_EXTENTS: u32 = 4;
/// Superblock feature: records carry up to [`RECORD_DATA_MAX_BYTES_LARGE`]
/// of data instead of [`RECORD_DATA_MAX_BYTES`]. Set by `format` when the
/// log holds [`LOG_RECORDS_MIN`] such records: a sequential writer then
/// pays the per-record costs (a hand-off to a writer thread, a device
/// write, a wake-up) a quarter as often. A build that predates it refuses
/// such a cache instead of calling its larger records damage.
pub const FEATURE_LARGE_RECORDS: u32 = 8;
/// Every feature bit this build understands. A superblock with any other
/// bit set is refused, so an older build never misreads a newer cache (and
/// a build older than `FEATURE_DEGRADED` refuses a degraded cache instead
/// of serving stale data from it).
pub const FEATURES_KNOWN: u32 =
    FEATURE_INTEGRITY | FEATURE_DEGRADED | FEATURE_TAG_EXTENTS | FEATURE_LARGE_RECORDS;

/// Each superblock copy occupies this many bytes.
pub const SUPERBLOCK_BYTES: usize = 4096;
/// Byte offsets of the two superblock copies.
pub const SUPERBLOCK_OFFSETS: [u64; 2] = [0, 4096];
/// The checkpoint area starts here, so every supported block size is aligned.
pub const METADATA_AREA_OFFSET: u64 = 65536;

pub const BLOCK_SIZE_MIN_BYTES: u32 = 4096;
pub const BLOCK_SIZE_MAX_BYTES: u32 = 65536;

/// A record never carries more data than this, so one record is one bounded
/// I/O: in a cache formatted without [`FEATURE_LARGE_RECORDS`].
pub const RECORD_DATA_MAX_BYTES: u32 = 256 << 10;
/// The most data a record carries in a cache with [`FEATURE_LARGE_RECORDS`]
/// (at 4 KiB blocks the header's 252 entries bind first: 1008 KiB).
pub const RECORD_DATA_MAX_BYTES_LARGE: u32 = 1 << 20;

/// At most this many zero/discard ranges may wait for write-back at once.
/// Bounded so the checkpoint slot has a fixed size.
pub const PENDING_RANGES_MAX: usize = 1024;

/// Largest origin address (in blocks) a volume can have: 40 bits.
pub const ORIGIN_BLOCKS_MAX: u64 = (1 << 40) - 1;

/// At most this many volumes share one cache; their ids are below it.
pub const VOLUMES_MAX: usize = 32;

/// A cached block is named by a key: its volume's id above the 40 bits of
/// its address. Volume 0's keys are its addresses, exactly what format 1
/// wrote in records and checkpoints, so a format 1 log is format 2's log of
/// volume 0 as it is.
pub const VOLUME_KEY_SHIFT: u32 = 40;
/// The largest key: volume ids are below [`VOLUMES_MAX`], so keys take 45
/// bits.
pub const KEY_MAX: u64 = ((VOLUMES_MAX as u64) << VOLUME_KEY_SHIFT) - 1;

/// The key of block `lba` of volume `volume_id`.
pub fn block_key(volume_id: u16, lba: u64) -> u64 {
    assert!((volume_id as usize) < VOLUMES_MAX && lba <= ORIGIN_BLOCKS_MAX);
    (volume_id as u64) << VOLUME_KEY_SHIFT | lba
}

/// The volume a key belongs to.
pub fn key_volume(key: u64) -> u16 {
    (key >> VOLUME_KEY_SHIFT) as u16
}

/// The address within its volume that a key names.
pub fn key_lba(key: u64) -> u64 {
    key & ORIGIN_BLOCKS_MAX
}

/// Are the `count` keys from `key` valid keys of one volume? (A range of a
/// record or a checkpoint never crosses from one volume into the next.)
pub fn keys_in_one_volume(key: u64, count: u64) -> bool {
    count > 0
        && key <= KEY_MAX
        && key
            .checked_add(count - 1)
            .is_some_and(|last| last <= KEY_MAX && key_volume(last) == key_volume(key))
}

/// The log must hold at least this many of the largest records, so write-back
/// and eviction always have room to make progress.
pub const LOG_RECORDS_MIN: u64 = 8;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("bad magic: found {found:#018x}, expected {expected:#018x}")]
    BadMagic { found: u64, expected: u64 },
    #[error("unsupported format version {found} (this build reads version {supported})")]
    BadVersion { found: u32, supported: u32 },
    #[error("checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    BadChecksum { stored: u32, computed: u32 },
    #[error("field {field} out of range: {value}")]
    OutOfRange { field: &'static str, value: u64 },
    #[error("buffer too short: need {need} bytes, have {have}")]
    Short { need: usize, have: usize },
}

/// CRC-32C (Castagnoli, the iSCSI polynomial): the checksum of every
/// on-disk structure and every cached block. Computed with `crc-fast`,
/// which folds with carry-less multiplication (VPCLMULQDQ where the CPU has
/// it): 40-54 GB/s on 4 KiB blocks on the benchmark machine against
/// 14-15 GB/s for the SSE4.2 `crc32` instruction (the `crc32c` crate), and
/// checksums were 15% of the daemon's CPU on 64 KiB writes.
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(bytes)
}

/// CRC-32C one bit at a time: slow, obviously right, and independent of
/// the CPU, for [`crc32c_self_test`].
fn crc32c_bitwise(crc: u32, bytes: &[u8]) -> u32 {
    let mut state = !crc;
    for &byte in bytes {
        state ^= u32::from(byte);
        for _ in 0..8 {
            let mask = (state & 1).wrapping_neg();
            state = (state >> 1) ^ (0x82F6_3B78 & mask);
        }
    }
    !state
}

/// Check the fast CRC-32C against the bitwise reference on this CPU.
/// `crc-fast` picks its code path (AVX-512, PCLMULQDQ, SSE, portable) at
/// run time, so a test on one machine does not vouch for another; a wrong
/// CRC would make every block and record of the cache look corrupt. Runs
/// once per process (about 0.7 MB of bitwise CRC: 4.7-4.9 ms in a release
/// build on the benchmark machine); later calls return the first answer. Call before a cache is formatted
/// or opened.
pub fn crc32c_self_test() -> Result<(), String> {
    static RESULT: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    RESULT.get_or_init(crc32c_compare_with_reference).clone()
}

fn crc32c_compare_with_reference() -> Result<(), String> {
    // Up to a full record payload (256 KiB) and one byte more.
    let bytes: Vec<u8> = (0..(256 << 10) + 16u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    for len in [
        0usize,
        1,
        7,
        8,
        9,
        31,
        64,
        255,
        4096,
        4104,
        8200,
        65543,
        (256 << 10) + 1,
    ] {
        let data = &bytes[..len];
        let reference = crc32c_bitwise(0, data);
        let split = len / 3;
        let lba = len as u64 * 0x0101_0101;
        let mut with_lba = lba.to_le_bytes().to_vec();
        with_lba.extend_from_slice(data);
        let checks = [
            ("crc32c", crc32c(data), reference),
            (
                "crc32c_append",
                crc32c_append(crc32c(&data[..split]), &data[split..]),
                reference,
            ),
            (
                "block_checksum",
                block_checksum(lba, data),
                crc32c_bitwise(0, &with_lba),
            ),
        ];
        for (what, fast, slow) in checks {
            if fast != slow {
                return Err(format!(
                    "CRC-32C self-test failed on this CPU: {what} of {len} bytes gave {fast:#010x}, the reference {slow:#010x}"
                ));
            }
        }
    }
    Ok(())
}

/// Continue a CRC-32C: `crc32c_append(crc32c(a), b) == crc32c(a ‖ b)`.
pub fn crc32c_append(crc: u32, bytes: &[u8]) -> u32 {
    // The digest's state is the CRC before the final inversion.
    let mut digest =
        crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    digest.update(bytes);
    digest.finalize() as u32
}

/// The checksum of one cached block: crc32c over the block's origin address
/// (little endian) followed by its bytes. Covering the address means a block
/// written to the wrong place, or read from the wrong place, fails the check.
pub fn block_checksum(lba: u64, data: &[u8]) -> u32 {
    thread_local! {
        // One digest per thread, reset for each block: `Digest::new` copies
        // the algorithm's parameter tables each time, which profiles of 64
        // KiB writes (W3) put at up to 6% of the daemon's CPU.
        static DIGEST: std::cell::RefCell<crc_fast::Digest> =
            std::cell::RefCell::new(crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi));
    }
    DIGEST.with(|digest| {
        let mut digest = digest.borrow_mut();
        digest.reset();
        digest.update(&lba.to_le_bytes());
        digest.update(data);
        digest.finalize() as u32
    })
}

/// True if `block_size_bytes` is a block size this format supports.
pub fn block_size_valid(block_size_bytes: u32) -> bool {
    block_size_bytes.is_power_of_two()
        && (BLOCK_SIZE_MIN_BYTES..=BLOCK_SIZE_MAX_BYTES).contains(&block_size_bytes)
}

/// How many data blocks one record may carry for this block size, in a
/// cache with these superblock `features`.
pub fn record_data_blocks_max(block_size_bytes: u32, features: u32) -> u32 {
    let data_max_bytes = if features & FEATURE_LARGE_RECORDS != 0 {
        RECORD_DATA_MAX_BYTES_LARGE
    } else {
        RECORD_DATA_MAX_BYTES
    };
    let by_bytes = data_max_bytes / block_size_bytes;
    let by_entries = RecordHeader::entries_max(block_size_bytes) as u32;
    by_bytes.min(by_entries)
}

pub fn align_up(value: u64, align: u64) -> u64 {
    debug_assert!(align.is_power_of_two());
    value.div_ceil(align) * align
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_covers_address() {
        let data = vec![7u8; 4096];
        assert_ne!(block_checksum(1, &data), block_checksum(2, &data));
        assert_eq!(block_checksum(1, &data), block_checksum(1, &data));
    }

    /// The on-disk format is unchanged by the switch of CRC crate: every
    /// function agrees with the `crc32c` crate (what earlier builds used)
    /// on the standard check value and on random inputs of every length
    /// around the SIMD folding boundaries.
    #[test]
    fn crc32c_matches_the_reference_implementation() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(&[]), ::crc32c::crc32c(&[]));
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let bytes: Vec<u8> = (0..70_000).map(|_| next() as u8).collect();
        for len in (0..300).chain([1023, 1024, 4095, 4096, 4097, 8192, 65536, 65543]) {
            let data = &bytes[..len];
            assert_eq!(crc32c(data), ::crc32c::crc32c(data), "len {len}");
            let split = (next() as usize) % (len + 1);
            let head = ::crc32c::crc32c(&data[..split]);
            assert_eq!(
                crc32c_append(head, &data[split..]),
                ::crc32c::crc32c_append(head, &data[split..]),
                "len {len} split {split}"
            );
            let lba = next();
            let reference = ::crc32c::crc32c_append(::crc32c::crc32c(&lba.to_le_bytes()), data);
            assert_eq!(block_checksum(lba, data), reference, "len {len}");
        }
    }

    #[test]
    fn self_test_passes_and_the_reference_is_right() {
        assert_eq!(crc32c_bitwise(0, b"123456789"), 0xe306_9283);
        crc32c_self_test().unwrap();
    }

    #[test]
    fn block_sizes() {
        assert!(block_size_valid(4096));
        assert!(block_size_valid(65536));
        assert!(!block_size_valid(2048));
        assert!(!block_size_valid(6144));
        assert!(!block_size_valid(131072));
        assert_eq!(record_data_blocks_max(4096, 0), 64);
        assert_eq!(record_data_blocks_max(65536, 0), 4);
    }
}
