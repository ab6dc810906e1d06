//! How a local device is known in the identity a cache records.

use std::path::Path;

/// What comes between a regular file's path and its inode number in its
/// identity (`file:/srv/origin.img#ino=1234`).
const INODE_MARK: &str = "#ino=";
/// What comes between a block device's path and its lasting id
/// (`file:/dev/sdb#dev=wwid:naa.5000c500a1b2c3d4`; see `block_id`).
const DEVICE_ID_MARK: &str = "#dev=";

/// A local device's identity: `file:` and its canonical path, and for a
/// regular file its inode, so a file replaced at the same path (restored
/// from a backup, another image moved over it) is not taken for the
/// origin a cache was formatted for. A block device's node has no number
/// that outlives a reboot; where sysfs names the device for good (a WWN,
/// a serial, a device-mapper uuid, a loop device's backing file), that id
/// follows the path, so another disk that now answers to the path is not
/// taken for it either.
pub(crate) fn local_identity(
    canonical: &Path,
    inode: Option<u64>,
    device_id: Option<&str>,
) -> String {
    match (inode, device_id) {
        (Some(inode), _) => format!("file:{}{INODE_MARK}{inode}", canonical.display()),
        (None, Some(id)) => format!("file:{}{DEVICE_ID_MARK}{id}", canonical.display()),
        (None, None) => format!("file:{}", canonical.display()),
    }
}

/// `identity` without a regular file's inode or a block device's id: its
/// path alone, which is all caches formatted before 2026-12-06 recorded.
pub fn identity_without_inode(identity: &str) -> &str {
    if !identity.starts_with("file:") {
        return identity;
    }
    if let Some((path, inode)) = identity.rsplit_once(INODE_MARK) {
        if !inode.is_empty() && inode.bytes().all(|b| b.is_ascii_digit()) {
            return path;
        }
    }
    if let Some((path, id)) = identity.rsplit_once(DEVICE_ID_MARK) {
        // An id is one printable word without '#' (see `block_id`).
        if !id.is_empty() && id.bytes().all(|b| b.is_ascii_graphic() && b != b'#') {
            return path;
        }
    }
    identity
}

/// The lasting id a block device's identity carries, if any.
pub fn device_id_of_identity(identity: &str) -> Option<&str> {
    let stripped = identity_without_inode(identity);
    identity
        .strip_prefix(stripped)?
        .strip_prefix(DEVICE_ID_MARK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regular_file_is_known_by_its_inode_a_block_device_by_its_path() {
        assert_eq!(
            local_identity(Path::new("/srv/a#b.img"), Some(7), None),
            "file:/srv/a#b.img#ino=7"
        );
        assert_eq!(
            identity_without_inode("file:/srv/a#b.img#ino=7"),
            "file:/srv/a#b.img"
        );
        // A '#' in a path is not an inode mark; nor is a mark without digits.
        assert_eq!(
            identity_without_inode("file:/srv/a#b.img"),
            "file:/srv/a#b.img"
        );
        assert_eq!(
            identity_without_inode("file:/srv/a#ino=x"),
            "file:/srv/a#ino=x"
        );
        assert_eq!(identity_without_inode("rbd:p/i#ino=5"), "rbd:p/i#ino=5");
        assert_eq!(
            local_identity(Path::new("/dev/sdb"), None, None),
            "file:/dev/sdb"
        );
        let disk = local_identity(Path::new("/dev/sdb"), None, Some("wwid:naa.5000c5"));
        assert_eq!(disk, "file:/dev/sdb#dev=wwid:naa.5000c5");
        assert_eq!(identity_without_inode(&disk), "file:/dev/sdb");
        assert_eq!(device_id_of_identity(&disk), Some("wwid:naa.5000c5"));
        assert_eq!(device_id_of_identity("file:/srv/a#ino=7"), None);
        assert_eq!(device_id_of_identity("file:/dev/sdb"), None);
        // A mark with nothing after it, or a '#' in the id, is part of the path.
        assert_eq!(
            identity_without_inode("file:/dev/x#dev="),
            "file:/dev/x#dev="
        );
        assert_eq!(
            identity_without_inode("file:/dev/x#dev=a#b"),
            "file:/dev/x#dev=a#b"
        );
    }
}
