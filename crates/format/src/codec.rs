//! Little-endian field cursors over byte slices. Bounds are checked on every
//! access so a truncated buffer becomes a `DecodeError`, never a panic.

use crate::DecodeError;

pub struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl<'a> Writer<'a> {
    pub fn new(buf: &'a mut [u8]) -> Self {
        Writer { buf, pos: 0 }
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn bytes(&mut self, value: &[u8]) {
        // Encoders size their buffers from the same constants they write, so
        // running off the end is a programming error, not bad input.
        assert!(self.pos + value.len() <= self.buf.len(), "encoder overflow");
        self.buf[self.pos..self.pos + value.len()].copy_from_slice(value);
        self.pos += value.len();
    }

    pub fn u8(&mut self, value: u8) {
        self.bytes(&[value]);
    }
    pub fn u16(&mut self, value: u16) {
        self.bytes(&value.to_le_bytes());
    }
    pub fn u32(&mut self, value: u32) {
        self.bytes(&value.to_le_bytes());
    }
    pub fn u64(&mut self, value: u64) {
        self.bytes(&value.to_le_bytes());
    }
    pub fn skip(&mut self, count: usize) {
        assert!(self.pos + count <= self.buf.len(), "encoder overflow");
        self.pos += count;
    }
}

pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn bytes(&mut self, count: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(count).ok_or(DecodeError::Short {
            need: usize::MAX,
            have: self.buf.len(),
        })?;
        if end > self.buf.len() {
            return Err(DecodeError::Short {
                need: end,
                have: self.buf.len(),
            });
        }
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.bytes(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        let b = self.bytes(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.bytes(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        let b = self.bytes(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

/// crc32c of `buf` with the 4 bytes at `crc_at` taken as zero.
pub fn crc_with_hole(buf: &[u8], crc_at: usize) -> u32 {
    let crc = crate::crc32c(&buf[..crc_at]);
    let crc = crate::crc32c_append(crc, &[0u8; 4]);
    crate::crc32c_append(crc, &buf[crc_at + 4..])
}

/// The first `need` bytes of `buf`, or `Short` if it has fewer.
pub fn prefix(buf: &[u8], need: usize) -> Result<&[u8], DecodeError> {
    buf.get(..need).ok_or(DecodeError::Short {
        need,
        have: buf.len(),
    })
}

/// Compare the crc32c stored at `crc_at` with that of `buf` (the 4 bytes
/// at `crc_at` taken as zero).
pub fn check_crc(buf: &[u8], crc_at: usize) -> Result<(), DecodeError> {
    let stored = u32::from_le_bytes([
        buf[crc_at],
        buf[crc_at + 1],
        buf[crc_at + 2],
        buf[crc_at + 3],
    ]);
    let computed = crc_with_hole(buf, crc_at);
    if stored != computed {
        return Err(DecodeError::BadChecksum { stored, computed });
    }
    Ok(())
}

pub fn check_magic(found: u64, expected: u64) -> Result<(), DecodeError> {
    if found != expected {
        return Err(DecodeError::BadMagic { found, expected });
    }
    Ok(())
}

/// Check the version of a record, checkpoint, tag page or lifetime block.
pub fn check_version(found: u32) -> Result<(), DecodeError> {
    if found != crate::STRUCTURE_VERSION {
        return Err(DecodeError::BadVersion {
            found,
            supported: crate::STRUCTURE_VERSION,
        });
    }
    Ok(())
}
