//! [`ReadData`]: the bytes of one read, in the buffer the device filled.

use cairn_device::PooledBuf;

/// The bytes a read returned: a window of the page-aligned buffer its
/// whole blocks were read into (the window differs from the buffer only
/// for a read that does not start or end on a block boundary). The buffer
/// goes back to the engine's pool when this is dropped.
pub struct ReadData {
    pub(crate) buf: PooledBuf,
    pub(crate) start: usize,
    pub(crate) len: usize,
}

impl ReadData {
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl AsRef<[u8]> for ReadData {
    fn as_ref(&self) -> &[u8] {
        self.as_bytes()
    }
}
