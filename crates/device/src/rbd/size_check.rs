//! [`SizeCheck`]: an image resized under cairn by another client.
//!
//! The volume is the size the image had when the cache was formatted.
//! Shrunk (`rbd resize --allow-shrink`), the image has lost its data past
//! the new end, and a write-back there would fail with a bare EINVAL;
//! worse, one inside it would carry on as if nothing happened. So while
//! the image is smaller than the volume every write is refused with an
//! error that says what happened and how to undo it: write-back holds
//! (the volume's origin is failing, nothing is dropped) until the image
//! has its size back. Reads past the new end are refused the same way;
//! reads inside it go on. Grown, the image still holds the whole volume:
//! requests go on, and the next open refuses the new size (the engine
//! compares it with the recorded one), which the log says now.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

use super::handles::Handles;

/// What a request does to the image.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Access {
    Read,
    /// Writes, zeroes and discards; not flushes, which change nothing.
    Write,
}

/// The volume's size and the image's size as last seen.
pub(super) struct SizeCheck {
    /// `POOL/IMAGE`, for the advice.
    image_path: String,
    volume_bytes: u64,
    seen_bytes: AtomicU64,
}

impl SizeCheck {
    pub fn new(image_path: String, volume_bytes: u64) -> SizeCheck {
        SizeCheck {
            image_path,
            volume_bytes,
            seen_bytes: AtomicU64::new(volume_bytes),
        }
    }

    /// Whether a request over `offset..offset + len` may go to the image.
    pub fn check(
        &self,
        handles: &Handles,
        access: Access,
        offset: u64,
        len: u64,
    ) -> io::Result<()> {
        if handles.header_changed() {
            self.look_again(handles);
        }
        let seen = self.seen_bytes.load(Ordering::Acquire);
        if seen >= self.volume_bytes {
            return Ok(());
        }
        if access == Access::Read && offset.saturating_add(len) <= seen {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            self.shrunk_message(seen),
        ))
    }

    fn shrunk_message(&self, seen: u64) -> String {
        format!(
            "the image {image} was shrunk from {volume} to {seen} bytes by another client while cairn served it, and its data past {seen} bytes is gone; cairn holds the volume's writes (nothing is dropped) until the image has its size back: `rbd resize --size {volume}B {image}`",
            image = self.image_path,
            volume = self.volume_bytes,
        )
    }

    /// Read the image's size after its header changed, and say so if it
    /// is not the volume's.
    fn look_again(&self, handles: &Handles) {
        let now = match handles.size_bytes() {
            Ok(now) => now,
            Err(e) => {
                tracing::warn!(image = %self.image_path, error = %e, "the image's header changed, and its size cannot be read");
                return;
            }
        };
        let before = self.seen_bytes.swap(now, Ordering::AcqRel);
        if now == before {
            return;
        }
        let volume = self.volume_bytes;
        if now < volume {
            tracing::error!(image = %self.image_path, volume_bytes = volume, image_bytes = now, "{}", self.shrunk_message(now));
        } else if now > volume {
            tracing::warn!(image = %self.image_path, volume_bytes = volume, image_bytes = now,
                "the image grew past the volume; cairn goes on serving {volume} bytes, and will refuse to open the image at its new size: `rbd resize --allow-shrink --size {volume}B {}` before cairn restarts", self.image_path);
        } else {
            tracing::info!(image = %self.image_path, volume_bytes = volume, "the image has the volume's size again; writes go on");
        }
    }
}
