//! [`UringOptions`]: tuning for the io_uring backend.

/// Tuning for [`UringDevice`](super::UringDevice).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UringOptions {
    /// Rings in the pool: how many callers can have I/O in flight at once.
    pub ring_count: usize,
    /// Submission queue entries per ring: how many I/Os one caller keeps in
    /// flight at once.
    pub queue_depth: u32,
    /// Open with O_DIRECT. If the filesystem refuses it, the device falls
    /// back to buffered I/O (still through io_uring) with one warning.
    pub direct_io: bool,
}

impl Default for UringOptions {
    fn default() -> Self {
        UringOptions {
            ring_count: 16,
            queue_depth: 128,
            direct_io: true,
        }
    }
}
