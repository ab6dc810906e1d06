//! Big-endian field access with bounds checks, and fixed header sizes.

/// NBDMAGIC + IHAVEOPT + handshake flags.
pub const GREETING_BYTES: usize = 18;
pub const CLIENT_FLAGS_BYTES: usize = 4;
/// IHAVEOPT + option + length.
pub const OPTION_HEADER_BYTES: usize = 16;
/// magic + option + type + length.
pub const OPTION_REPLY_HEADER_BYTES: usize = 20;
/// magic + flags + type + cookie + offset + 32-bit length.
pub const COMPACT_REQUEST_BYTES: usize = 28;
/// magic + flags + type + cookie + offset + 64-bit length.
pub const EXTENDED_REQUEST_BYTES: usize = 32;
pub const SIMPLE_REPLY_BYTES: usize = 16;
pub const STRUCTURED_REPLY_HEADER_BYTES: usize = 20;
pub const EXTENDED_REPLY_HEADER_BYTES: usize = 32;

/// A read-only cursor over a byte slice. Every getter returns `None`
/// instead of panicking when the slice is too short.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, pos: 0 }
    }

    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.remaining() < n {
            return None;
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Some(s)
    }

    pub fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }

    pub fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|b| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            u64::from_be_bytes(a)
        })
    }
}

pub fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_be_bytes());
}

pub fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_be_bytes());
}

pub fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_be_bytes());
}

/// Cut `s` to at most `max` bytes on a UTF-8 boundary.
pub fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_refuses_short_input() {
        let mut r = Reader::new(&[0, 1, 2]);
        assert_eq!(r.u16(), Some(1));
        assert_eq!(r.u16(), None);
        assert_eq!(r.remaining(), 1);
        assert_eq!(r.take(usize::MAX), None);
    }

    #[test]
    fn truncate_keeps_char_boundaries() {
        assert_eq!(truncate_utf8("héllo", 2), "h");
        assert_eq!(truncate_utf8("abc", 10), "abc");
    }
}
