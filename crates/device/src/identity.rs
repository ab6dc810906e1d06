//! How a local device is known in the identity a cache records.

use std::path::Path;

/// What comes between a regular file's path and its inode number in its
/// identity (`file:/srv/origin.img#ino=1234`).
const INODE_MARK: &str = "#ino=";

/// A local device's identity: `file:` and its canonical path, and for a
/// regular file its inode, so a file replaced at the same path (restored
/// from a backup, another image moved over it) is not taken for the
/// origin a cache was formatted for. A block device's node has no such
/// number that outlives a reboot; its path is its identity.
pub(crate) fn local_identity(canonical: &Path, inode: Option<u64>) -> String {
    match inode {
        Some(inode) => format!("file:{}{INODE_MARK}{inode}", canonical.display()),
        None => format!("file:{}", canonical.display()),
    }
}

/// `identity` without a regular file's inode: its path alone, which is
/// all caches formatted before 2026-12-06 recorded.
pub fn identity_without_inode(identity: &str) -> &str {
    if !identity.starts_with("file:") {
        return identity;
    }
    match identity.rsplit_once(INODE_MARK) {
        Some((path, inode)) if !inode.is_empty() && inode.bytes().all(|b| b.is_ascii_digit()) => {
            path
        }
        _ => identity,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regular_file_is_known_by_its_inode_a_block_device_by_its_path() {
        assert_eq!(
            local_identity(Path::new("/srv/a#b.img"), Some(7)),
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
        assert_eq!(local_identity(Path::new("/dev/sdb"), None), "file:/dev/sdb");
    }
}
