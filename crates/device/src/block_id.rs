//! What names a block device for good, read from sysfs: the id a cache
//! records next to its origin's path, so a disk that now answers to that
//! path (names like `/dev/sdb` follow probe order and can change at a
//! reboot; a loop device can be re-attached to another file) is not taken
//! for the one the cache was formatted for.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Longest id kept: the identity, path included, must fit the superblock's
/// field with room to spare.
const ID_MAX_BYTES: usize = 200;

/// The lasting id of the block device `rdev` (its `st_rdev`), or `None`
/// where sysfs gives none (a virtual disk without a serial, md, a node
/// sysfs does not show): that device is known by its path alone, as
/// before.
pub(crate) fn block_device_id(rdev: u64) -> Option<String> {
    let major = libc::major(rdev);
    let minor = libc::minor(rdev);
    let node = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    let id = id_of_node(&node)?;
    Some(clean(&id))
}

fn id_of_node(node: &Path) -> Option<String> {
    if let Some(uuid) = read_trimmed(&node.join("dm/uuid")) {
        // device-mapper (LVM, LUKS, multipath): the uuid it was made with.
        return Some(format!("dm:{uuid}"));
    }
    if let Some(backing) = read_trimmed(&node.join("loop/backing_file")) {
        return Some(loop_id(node, &backing));
    }
    if let Some(part) = read_trimmed(&node.join("partition")) {
        // A partition: its disk's id, its number and where it starts.
        let start = read_trimmed(&node.join("start")).unwrap_or_default();
        let disk = std::fs::canonicalize(node).ok()?.parent()?.to_path_buf();
        let disk_id = id_of_disk(&disk)?;
        return Some(format!("{disk_id}-part{part}@{start}"));
    }
    id_of_disk(node)
}

/// A whole disk's id: its WWN/EUI where it has one, else its serial.
fn id_of_disk(node: &Path) -> Option<String> {
    for (file, kind) in [
        ("wwid", "wwid"),
        ("device/wwid", "wwid"),
        ("serial", "serial"),
        ("device/serial", "serial"),
    ] {
        if let Some(value) = read_trimmed(&node.join(file)) {
            return Some(format!("{kind}:{value}"));
        }
    }
    None
}

/// A loop device is its backing file (by device and inode, which survive
/// a rename of the file) and its offset into it.
fn loop_id(node: &Path, backing: &str) -> String {
    let offset = read_trimmed(&node.join("loop/offset")).unwrap_or_else(|| "0".into());
    match std::fs::metadata(backing) {
        Ok(meta) => format!("loop:{}:{}+{offset}", meta.dev(), meta.ino()),
        // Deleted or out of reach: its path is all there is.
        Err(_) => format!("loop:{backing}+{offset}"),
    }
}

fn read_trimmed(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

/// Printable ASCII without spaces or `#` (the identity's field mark), cut
/// to [`ID_MAX_BYTES`].
fn clean(id: &str) -> String {
    id.chars()
        .map(|c| {
            if c.is_ascii_graphic() && c != '#' {
                c
            } else {
                '_'
            }
        })
        .take(ID_MAX_BYTES)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_one_printable_word() {
        assert_eq!(clean("ATA  WDC#1\n"), "ATA__WDC_1_");
        assert_eq!(clean(&"x".repeat(500)).len(), ID_MAX_BYTES);
    }

    #[test]
    fn a_node_sysfs_does_not_know_has_no_id() {
        // Major 0 minor 0 is never a block device.
        assert_eq!(block_device_id(0), None);
    }
}
