//! A checkpoint's payload, streamed to the device in bounded chunks: a
//! checkpoint of a full 4 GiB cache is 16 MiB, and building it whole would
//! double the daemon's memory.

use cairn_device::DeviceError;

use crate::env::Env;

/// Checkpoints are written in chunks of this size.
const CHECKPOINT_CHUNK_BYTES: usize = 1 << 20;

/// The payload is padded to this, not to the cache's block size: it starts
/// one header (4 KiB) into its slot, so a block-size multiple could run
/// past the slot's end (64 KiB blocks did), and 4 KiB is all the alignment
/// direct I/O needs.
pub(crate) const PAYLOAD_ALIGN_BYTES: u64 = cairn_format::CHECKPOINT_HEADER_BYTES as u64;

pub(crate) struct PayloadWriter<'a> {
    env: &'a Env,
    chunk: Vec<u8>,
    used_bytes: usize,
    /// Where the next chunk goes on the cache device.
    at_bytes: u64,
    payload_crc: u32,
    written_bytes: u64,
}

impl<'a> PayloadWriter<'a> {
    pub(crate) fn new(env: &'a Env, at_bytes: u64) -> PayloadWriter<'a> {
        PayloadWriter {
            env,
            chunk: vec![0u8; CHECKPOINT_CHUNK_BYTES],
            used_bytes: 0,
            at_bytes,
            payload_crc: 0,
            written_bytes: 0,
        }
    }

    /// Append `bytes` to the payload. Items may straddle chunks: the
    /// payload on disk is contiguous, so every chunk but the last is
    /// written whole.
    pub(crate) fn put(&mut self, mut bytes: &[u8]) -> Result<(), DeviceError> {
        while !bytes.is_empty() {
            let n = bytes.len().min(self.chunk.len() - self.used_bytes);
            self.chunk[self.used_bytes..self.used_bytes + n].copy_from_slice(&bytes[..n]);
            self.used_bytes += n;
            bytes = &bytes[n..];
            if self.used_bytes == self.chunk.len() {
                self.write_chunk()?;
            }
        }
        Ok(())
    }

    /// Write what is left, padded to [`PAYLOAD_ALIGN_BYTES`] (the checksum
    /// covers the payload only). Returns the payload's crc32c and the bytes
    /// written.
    pub(crate) fn finish(mut self) -> Result<(u32, u64), DeviceError> {
        if self.used_bytes > 0 {
            self.write_chunk()?;
        }
        Ok((self.payload_crc, self.written_bytes))
    }

    fn write_chunk(&mut self) -> Result<(), DeviceError> {
        let used = self.used_bytes;
        self.payload_crc = cairn_format::crc32c_append(self.payload_crc, &self.chunk[..used]);
        let io_bytes = cairn_format::align_up(used as u64, PAYLOAD_ALIGN_BYTES) as usize;
        self.chunk[used..io_bytes].fill(0);
        self.env
            .cache
            .write_at(self.at_bytes, &self.chunk[..io_bytes])?;
        self.at_bytes += io_bytes as u64;
        self.written_bytes += io_bytes as u64;
        self.used_bytes = 0;
        Ok(())
    }
}
