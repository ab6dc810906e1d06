//! What a device about to be formatted already holds: the signatures of
//! common filesystems, volume managers and partition tables, and the
//! structures of a cairn cache whose superblocks are damaged. `format`
//! refuses such a device without `--force`, as mkfs does: formatting over
//! a filesystem or a damaged cache with dirty data destroys data that
//! exists nowhere else.

use crate::{CHECKPOINT_MAGIC, RECORD_MAGIC, SUPERBLOCK_MAGIC, TAG_PAGE_MAGIC, VOLUME_TABLE_MAGIC};

/// Bytes from the start of a device that [`existing_contents`] looks at.
pub const SIGNATURE_PROBE_BYTES: usize = 1 << 20;

/// Where cairn structures are looked for: the 8-byte magic at the start
/// of each 4 KiB page of the probe (superblocks, the volume table, the
/// checkpoints and the first records and tag pages all start on one).
const CAIRN_PAGE_BYTES: usize = 4096;

/// What a device holds that formatting would destroy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExistingContents {
    /// The structures of a cairn cache whose superblocks are damaged: it
    /// may hold dirty data that exists nowhere else.
    CairnCache,
    /// Something else known, described ("an XFS filesystem").
    Other(&'static str),
}

impl std::fmt::Display for ExistingContents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExistingContents::CairnCache => {
                f.write_str("the structures of a cairn cache (its superblocks are damaged)")
            }
            ExistingContents::Other(what) => f.write_str(what),
        }
    }
}

/// A known signature: its magic at a byte offset.
struct Signature {
    what: &'static str,
    offset: usize,
    magic: &'static [u8],
}

const SIGNATURES: &[Signature] = &[
    Signature {
        what: "an ext2/ext3/ext4 filesystem",
        offset: 1080,
        magic: &[0x53, 0xEF],
    },
    Signature {
        what: "an XFS filesystem",
        offset: 0,
        magic: b"XFSB",
    },
    Signature {
        what: "a Btrfs filesystem",
        offset: 65_600,
        magic: b"_BHRfS_M",
    },
    Signature {
        what: "a LUKS encrypted volume",
        offset: 0,
        magic: b"LUKS\xba\xbe",
    },
    Signature {
        what: "an LVM physical volume",
        offset: 512,
        magic: b"LABELONE",
    },
    Signature {
        what: "an LVM physical volume",
        offset: 0,
        magic: b"LABELONE",
    },
    Signature {
        what: "a GPT partition table",
        offset: 512,
        magic: b"EFI PART",
    },
    Signature {
        what: "a swap area",
        offset: 4086,
        magic: b"SWAPSPACE2",
    },
    Signature {
        what: "a bcache device",
        offset: 4096 + 24,
        magic: &[
            0xc6, 0x85, 0x73, 0xf6, 0x4e, 0x1a, 0x45, 0xca, 0x82, 0x65, 0xf5, 0x7f, 0x48, 0xba,
            0x6d, 0x81,
        ],
    },
    Signature {
        what: "a squashfs image",
        offset: 0,
        magic: b"hsqs",
    },
    Signature {
        what: "an ISO 9660 image",
        offset: 32_769,
        magic: b"CD001",
    },
    Signature {
        what: "an NTFS filesystem",
        offset: 3,
        magic: b"NTFS    ",
    },
];

/// What `head` (the first bytes of a device, up to
/// [`SIGNATURE_PROBE_BYTES`]) shows the device holds, if anything known.
/// `None` for zeroes, random data and anything not recognised.
pub fn existing_contents(head: &[u8]) -> Option<ExistingContents> {
    let cairn = [
        SUPERBLOCK_MAGIC,
        VOLUME_TABLE_MAGIC,
        CHECKPOINT_MAGIC,
        RECORD_MAGIC,
        TAG_PAGE_MAGIC,
    ];
    let cairn_page = head.chunks(CAIRN_PAGE_BYTES).any(|page| {
        page.get(..8)
            .and_then(|m| m.try_into().ok())
            .is_some_and(|m: [u8; 8]| cairn.contains(&u64::from_le_bytes(m)))
    });
    if cairn_page {
        return Some(ExistingContents::CairnCache);
    }
    if let Some(found) = SIGNATURES
        .iter()
        .find(|s| head.get(s.offset..s.offset + s.magic.len()) == Some(s.magic))
    {
        return Some(ExistingContents::Other(found.what));
    }
    // A DOS partition table: the boot signature and at least one entry
    // with a partition type (a bare 0x55AA also ends FAT boot sectors).
    let boot_signature = head.get(510..512) == Some(&[0x55, 0xAA][..]);
    let has_partition = (0..4).any(|k| head.get(446 + 16 * k + 4).is_some_and(|&t| t != 0));
    if boot_signature && has_partition {
        return Some(ExistingContents::Other("a DOS (MBR) partition table"));
    }
    if boot_signature {
        return Some(ExistingContents::Other(
            "a boot sector (a FAT filesystem or a partition table)",
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(offset: usize, magic: &[u8]) -> Vec<u8> {
        let mut head = vec![0u8; SIGNATURE_PROBE_BYTES];
        head[offset..offset + magic.len()].copy_from_slice(magic);
        head
    }

    #[test]
    fn zeroes_and_noise_hold_nothing_known() {
        assert_eq!(existing_contents(&vec![0u8; SIGNATURE_PROBE_BYTES]), None);
        assert_eq!(existing_contents(&[]), None);
        // Deterministic noise with no magic where one is looked for.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let noise: Vec<u8> = (0..SIGNATURE_PROBE_BYTES)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8 | 1
            })
            .collect();
        let mut noise = noise;
        noise[510] = 0;
        noise[1080] = 0;
        assert_eq!(existing_contents(&noise), None);
    }

    #[test]
    fn each_signature_is_named() {
        for s in SIGNATURES {
            assert_eq!(
                existing_contents(&with(s.offset, s.magic)),
                Some(ExistingContents::Other(s.what))
            );
        }
        // A short head (a small device) is looked at as far as it goes.
        assert_eq!(
            existing_contents(&with(0, b"XFSB")[..4096]),
            Some(ExistingContents::Other("an XFS filesystem"))
        );
        assert_eq!(existing_contents(&with(65_600, b"_BHRfS_M")[..4096]), None);
    }

    #[test]
    fn a_damaged_cairn_cache_is_recognised_by_any_structure() {
        for magic in [VOLUME_TABLE_MAGIC, CHECKPOINT_MAGIC, RECORD_MAGIC] {
            let head = with(8192, &magic.to_le_bytes());
            assert_eq!(existing_contents(&head), Some(ExistingContents::CairnCache));
        }
        // Not at a page start: not a structure.
        assert_eq!(
            existing_contents(&with(8193, &RECORD_MAGIC.to_le_bytes())),
            None
        );
    }

    #[test]
    fn partition_tables_and_boot_sectors() {
        let mut mbr = with(510, &[0x55, 0xAA]);
        assert_eq!(
            existing_contents(&mbr),
            Some(ExistingContents::Other(
                "a boot sector (a FAT filesystem or a partition table)"
            ))
        );
        mbr[446 + 4] = 0x83;
        assert_eq!(
            existing_contents(&mbr),
            Some(ExistingContents::Other("a DOS (MBR) partition table"))
        );
    }
}
