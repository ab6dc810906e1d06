//! [`Blocklisted`]: librbd's EBLOCKLISTED, as an error the device can
//! recognise (the errno alone is ESHUTDOWN, which says nothing to a user).

use std::fmt;

/// The cluster fenced this client for good (see `RbdDevice::fenced`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Blocklisted;

impl Blocklisted {
    /// Whether `error` is (or wraps) a blocklisting.
    pub fn is(error: &std::io::Error) -> bool {
        error.get_ref().is_some_and(|e| e.is::<Blocklisted>())
    }
}

impl fmt::Display for Blocklisted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the Ceph cluster blocklisted this client: another client took the image's lock while cairn was frozen or cut off, and nothing this process sends reaches the image again. Writes absorbed before stay in the cache, and new ones are refused; stop the other client, then restart cairn")
    }
}

impl std::error::Error for Blocklisted {}
