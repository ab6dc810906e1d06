//! Transmission-phase replies: the server's encoding of simple replies,
//! structured chunks and extended chunks, and the client's decoding of
//! their headers.

use super::wire::{self, put_u16, put_u32, put_u64, Reader};
use super::{ReplyError, ReplyMode, ReplyTo};
use crate::proto::*;

/// A simple reply: magic, error, cookie. A successful READ is followed by
/// its data.
pub fn encode_simple(out: &mut Vec<u8>, cookie: u64, error: u32) {
    put_u32(out, SIMPLE_REPLY_MAGIC);
    put_u32(out, error);
    put_u64(out, cookie);
}

/// A simple reply header as a client reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    /// Zero on success, else an NBD error (see [`nbd_to_errno`]).
    pub error: u32,
    pub cookie: u64,
}

/// Parse a simple reply header. Any other magic (a structured chunk, or
/// garbage) is an error carrying the magic found.
pub fn decode_simple_reply(
    header: &[u8; wire::SIMPLE_REPLY_BYTES],
) -> Result<SimpleReply, ReplyError> {
    let magic = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
    if magic != SIMPLE_REPLY_MAGIC {
        return Err(ReplyError::BadReplyMagic { magic });
    }
    let error = u32::from_be_bytes([header[4], header[5], header[6], header[7]]);
    let mut cookie = [0u8; 8];
    cookie.copy_from_slice(&header[8..16]);
    Ok(SimpleReply {
        error,
        cookie: u64::from_be_bytes(cookie),
    })
}

/// A structured or extended chunk header as a client reads it;
/// `payload_bytes` of chunk payload follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    /// `Structured` or `Extended`, from the magic.
    pub mode: ReplyMode,
    pub flags: u16,
    pub reply_type: u16,
    pub cookie: u64,
    /// The request offset echoed by an extended chunk; 0 when structured.
    pub offset: u64,
    pub payload_bytes: u64,
}

impl ChunkHeader {
    pub fn is_done(&self) -> bool {
        self.flags & REPLY_FLAG_DONE != 0
    }

    /// An error chunk (its type has the error bit, whatever the rest).
    pub fn is_error(&self) -> bool {
        self.reply_type & REPLY_TYPE_FLAG_ERROR != 0
    }
}

/// An error chunk's payload: the NBD error and the server's message (a
/// 16-bit length, then that many bytes, clamped to what is there). A
/// payload too short to hold the error gives error 0, which callers
/// treat as a protocol fault.
pub fn decode_error_chunk(payload: &[u8]) -> (u32, String) {
    let mut r = Reader::new(payload);
    let error = r.u32().unwrap_or(0);
    let declared = r.u16().unwrap_or(0) as usize;
    let text = payload.get(6..).unwrap_or_default();
    let message = String::from_utf8_lossy(&text[..declared.min(text.len())]).into_owned();
    (error, message)
}

/// Parse a structured or extended chunk header from the front of `input`.
/// The magic decides the header size; `Ok(None)` means fewer bytes than
/// that (the magic is refused as soon as its 4 bytes are there).
pub fn decode_chunk_header(input: &[u8]) -> Result<Option<ChunkHeader>, ReplyError> {
    let mut r = Reader::new(input);
    let Some(magic) = r.u32() else {
        return Ok(None);
    };
    let (mode, header_bytes) = match magic {
        STRUCTURED_REPLY_MAGIC => (ReplyMode::Structured, wire::STRUCTURED_REPLY_HEADER_BYTES),
        EXTENDED_REPLY_MAGIC => (ReplyMode::Extended, wire::EXTENDED_REPLY_HEADER_BYTES),
        _ => return Err(ReplyError::BadReplyMagic { magic }),
    };
    if input.len() < header_bytes {
        return Ok(None);
    }
    let fields = (|| {
        let flags = r.u16()?;
        let reply_type = r.u16()?;
        let cookie = r.u64()?;
        let (offset, payload_bytes) = if mode == ReplyMode::Extended {
            (r.u64()?, r.u64()?)
        } else {
            (0, r.u32()? as u64)
        };
        Some(ChunkHeader {
            mode,
            flags,
            reply_type,
            cookie,
            offset,
            payload_bytes,
        })
    })();
    Ok(fields)
}

/// A structured or extended chunk header. `mode` must not be `Simple`.
pub fn encode_chunk_header(
    out: &mut Vec<u8>,
    mode: ReplyMode,
    flags: u16,
    reply_type: u16,
    to: ReplyTo,
    payload_bytes: u64,
) {
    debug_assert!(mode != ReplyMode::Simple);
    if mode == ReplyMode::Extended {
        put_u32(out, EXTENDED_REPLY_MAGIC);
        put_u16(out, flags);
        put_u16(out, reply_type);
        put_u64(out, to.cookie);
        put_u64(out, to.offset);
        put_u64(out, payload_bytes);
    } else {
        debug_assert!(payload_bytes <= u32::MAX as u64);
        put_u32(out, STRUCTURED_REPLY_MAGIC);
        put_u16(out, flags);
        put_u16(out, reply_type);
        put_u64(out, to.cookie);
        put_u32(out, payload_bytes as u32);
    }
}

/// A successful reply that carries no data.
pub fn encode_ok(out: &mut Vec<u8>, mode: ReplyMode, to: ReplyTo) {
    match mode {
        // A READ must never get a simple reply once chunks are negotiated,
        // so a zero-length read ends with NONE.
        ReplyMode::Structured if to.command != CMD_READ => encode_simple(out, to.cookie, 0),
        ReplyMode::Simple => encode_simple(out, to.cookie, 0),
        _ => encode_chunk_header(out, mode, REPLY_FLAG_DONE, REPLY_TYPE_NONE, to, 0),
    }
}

/// A failed reply. Structured modes carry `message` for the user.
pub fn encode_error(out: &mut Vec<u8>, mode: ReplyMode, to: ReplyTo, error: u32, message: &str) {
    // An error chunk's error MUST be non-zero.
    let error = if error == 0 { NBD_EIO } else { error };
    if mode == ReplyMode::Simple {
        encode_simple(out, to.cookie, error);
        return;
    }
    let message = wire::truncate_utf8(message, MAX_STRING_BYTES);
    let payload_bytes = 6 + message.len() as u64;
    encode_chunk_header(
        out,
        mode,
        REPLY_FLAG_DONE,
        REPLY_TYPE_ERROR,
        to,
        payload_bytes,
    );
    put_u32(out, error);
    put_u16(out, message.len() as u16);
    out.extend_from_slice(message.as_bytes());
}

/// Bytes of header in front of the data of a successful, non-empty READ.
pub fn read_prefix_bytes(mode: ReplyMode) -> usize {
    match mode {
        ReplyMode::Simple => wire::SIMPLE_REPLY_BYTES,
        // Chunk header plus the 8-byte offset of OFFSET_DATA.
        ReplyMode::Structured => wire::STRUCTURED_REPLY_HEADER_BYTES + 8,
        ReplyMode::Extended => wire::EXTENDED_REPLY_HEADER_BYTES + 8,
    }
}

/// Append the header of a successful READ of `data_bytes` (> 0) to
/// `out`: `read_prefix_bytes(mode)` bytes. The whole read is sent as one
/// OFFSET_DATA chunk, which also satisfies DF.
pub fn encode_read_prefix(out: &mut Vec<u8>, mode: ReplyMode, to: ReplyTo, data_bytes: u32) {
    let start = out.len();
    if mode == ReplyMode::Simple {
        encode_simple(out, to.cookie, 0);
    } else {
        encode_chunk_header(
            out,
            mode,
            REPLY_FLAG_DONE,
            REPLY_TYPE_OFFSET_DATA,
            to,
            8 + data_bytes as u64,
        );
        put_u64(out, to.offset);
    }
    debug_assert_eq!(out.len() - start, read_prefix_bytes(mode));
}

/// One `base:allocation` descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    pub length_bytes: u64,
    pub flags: u32,
}

/// Turn the extents an export reported (in order, as descriptors) into
/// descriptors that obey the spec: non-zero lengths, clipped to the
/// request, merged where flags repeat, at most one with REQ_ONE and at most
/// `max_extents` otherwise.
pub fn shape_extents(
    extents: impl IntoIterator<Item = Descriptor>,
    request_length: u64,
    req_one: bool,
    max_extents: u32,
) -> Result<Vec<Descriptor>, &'static str> {
    let max_extents = max_extents.max(1) as usize;
    let mut out: Vec<Descriptor> = Vec::new();
    let mut covered = 0u64;
    for extent in extents {
        if extent.length_bytes == 0 {
            return Err("export reported a zero-length extent");
        }
        if covered >= request_length {
            break;
        }
        let length_bytes = extent.length_bytes.min(request_length - covered);
        let flags = extent.flags;
        let full = req_one || out.len() >= max_extents;
        match out.last_mut() {
            Some(last) if last.flags == flags => last.length_bytes += length_bytes,
            Some(_) if full => break,
            _ => out.push(Descriptor {
                length_bytes,
                flags,
            }),
        }
        covered += length_bytes;
    }
    if out.is_empty() {
        return Err("export reported no extents");
    }
    Ok(out)
}

/// A complete BLOCK_STATUS reply (one context, final chunk).
pub fn encode_block_status(
    out: &mut Vec<u8>,
    mode: ReplyMode,
    to: ReplyTo,
    context_id: u32,
    descriptors: &[Descriptor],
) {
    debug_assert!(!descriptors.is_empty());
    if mode == ReplyMode::Extended {
        let payload_bytes = 8 + 16 * descriptors.len() as u64;
        encode_chunk_header(
            out,
            mode,
            REPLY_FLAG_DONE,
            REPLY_TYPE_BLOCK_STATUS_EXT,
            to,
            payload_bytes,
        );
        put_u32(out, context_id);
        put_u32(out, descriptors.len() as u32);
        for d in descriptors {
            put_u64(out, d.length_bytes);
            put_u64(out, d.flags as u64);
        }
    } else {
        let payload_bytes = 4 + 8 * descriptors.len() as u64;
        encode_chunk_header(
            out,
            mode,
            REPLY_FLAG_DONE,
            REPLY_TYPE_BLOCK_STATUS,
            to,
            payload_bytes,
        );
        put_u32(out, context_id);
        for d in descriptors {
            // Compact requests carry 32-bit lengths and descriptors are
            // clipped to the request, so this never truncates.
            debug_assert!(d.length_bytes <= u32::MAX as u64);
            put_u32(out, d.length_bytes.min(u32::MAX as u64) as u32);
            put_u32(out, d.flags);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_chunk_decodes_to_what_was_encoded_and_a_short_one_to_error_zero() {
        let to = ReplyTo {
            cookie: 9,
            offset: 0,
            command: CMD_BLOCK_STATUS,
        };
        let mut out = Vec::new();
        encode_error(&mut out, ReplyMode::Structured, to, NBD_EINVAL, "bad range");
        let header = decode_chunk_header(&out).unwrap().unwrap();
        assert!(header.is_error() && header.is_done());
        let payload = &out[wire::STRUCTURED_REPLY_HEADER_BYTES..];
        assert_eq!(payload.len() as u64, header.payload_bytes);
        assert_eq!(
            decode_error_chunk(payload),
            (NBD_EINVAL, "bad range".to_string())
        );
        // A message length past the payload is clamped; no error at all is 0.
        assert_eq!(
            decode_error_chunk(&[0, 0, 0, 5, 0, 200, b'x']),
            (5, "x".to_string())
        );
        assert_eq!(decode_error_chunk(&[0, 0]), (0, String::new()));
        let mut other = header;
        other.reply_type = REPLY_TYPE_FLAG_ERROR | 77;
        assert!(other.is_error(), "an unknown error type is still an error");
        other.reply_type = REPLY_TYPE_BLOCK_STATUS;
        assert!(!other.is_error());
    }

    /// Allocated data, a zero run, and a hole, as an export reports them.
    const DATA: u32 = 0;
    const ZERO: u32 = STATE_ZERO;
    const HOLE: u32 = STATE_HOLE | STATE_ZERO;

    fn ext(length_bytes: u64, flags: u32) -> Descriptor {
        Descriptor {
            length_bytes,
            flags,
        }
    }

    #[test]
    fn shape_clips_merges_and_honours_req_one() {
        let extents = [
            ext(4096, DATA),
            ext(4096, DATA),
            ext(8192, HOLE),
            ext(4096, ZERO),
        ];
        let d = shape_extents(extents, 10_000, false, 100).unwrap();
        assert_eq!(
            d,
            vec![
                Descriptor {
                    length_bytes: 8192,
                    flags: 0
                },
                Descriptor {
                    length_bytes: 1808,
                    flags: STATE_HOLE | STATE_ZERO
                },
            ]
        );
        let d = shape_extents(extents, 10_000, true, 100).unwrap();
        assert_eq!(
            d,
            vec![Descriptor {
                length_bytes: 8192,
                flags: 0
            }]
        );
        let d = shape_extents(extents, 100, true, 100).unwrap();
        assert_eq!(
            d,
            vec![Descriptor {
                length_bytes: 100,
                flags: 0
            }]
        );
        let d = shape_extents(extents, 1 << 20, false, 2).unwrap();
        assert_eq!(d.len(), 2);
        assert!(shape_extents([], 10, false, 10).is_err());
        assert!(shape_extents([ext(0, DATA)], 10, false, 10).is_err());
    }

    #[test]
    fn error_chunk_layout() {
        let to = ReplyTo {
            cookie: 7,
            offset: 512,
            command: CMD_READ,
        };
        let mut out = Vec::new();
        encode_error(&mut out, ReplyMode::Structured, to, NBD_EIO, "boom");
        assert_eq!(out.len(), 20 + 6 + 4);
        assert_eq!(&out[0..4], &STRUCTURED_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&out[4..6], &REPLY_FLAG_DONE.to_be_bytes());
        assert_eq!(&out[6..8], &REPLY_TYPE_ERROR.to_be_bytes());
        assert_eq!(&out[8..16], &7u64.to_be_bytes());
        assert_eq!(&out[16..20], &10u32.to_be_bytes());
        assert_eq!(&out[20..24], &NBD_EIO.to_be_bytes());
        assert_eq!(&out[26..], b"boom");

        out.clear();
        encode_error(&mut out, ReplyMode::Extended, to, NBD_EIO, "");
        assert_eq!(out.len(), 32 + 6);
        assert_eq!(
            &out[16..24],
            &512u64.to_be_bytes(),
            "extended replies echo the offset"
        );
        assert_eq!(&out[24..32], &6u64.to_be_bytes());
    }

    #[test]
    fn zero_length_read_never_gets_a_simple_reply_in_structured_mode() {
        let to = ReplyTo {
            cookie: 1,
            offset: 0,
            command: CMD_READ,
        };
        let mut out = Vec::new();
        encode_ok(&mut out, ReplyMode::Structured, to);
        assert_eq!(&out[0..4], &STRUCTURED_REPLY_MAGIC.to_be_bytes());
        out.clear();
        encode_ok(
            &mut out,
            ReplyMode::Structured,
            ReplyTo {
                command: CMD_WRITE,
                ..to
            },
        );
        assert_eq!(&out[0..4], &SIMPLE_REPLY_MAGIC.to_be_bytes());
    }

    #[test]
    fn simple_reply_round_trip() {
        let mut out = Vec::new();
        encode_simple(&mut out, 0x0102_0304_0506_0708, NBD_ENOSPC);
        let header: [u8; wire::SIMPLE_REPLY_BYTES] = out.as_slice().try_into().unwrap();
        assert_eq!(
            decode_simple_reply(&header),
            Ok(SimpleReply {
                error: NBD_ENOSPC,
                cookie: 0x0102_0304_0506_0708
            })
        );
        let mut chunk = Vec::new();
        let to = ReplyTo {
            cookie: 1,
            offset: 0,
            command: CMD_READ,
        };
        encode_ok(&mut chunk, ReplyMode::Structured, to);
        let header: [u8; wire::SIMPLE_REPLY_BYTES] = chunk[..16].try_into().unwrap();
        assert_eq!(
            decode_simple_reply(&header),
            Err(ReplyError::BadReplyMagic {
                magic: STRUCTURED_REPLY_MAGIC
            })
        );
        assert_eq!(
            ReplyError::BadReplyMagic { magic: 0xab }.to_string(),
            "bad reply magic 0xab"
        );
    }

    #[test]
    fn chunk_header_round_trip() {
        let to = ReplyTo {
            cookie: 77,
            offset: 1 << 33,
            command: CMD_READ,
        };
        for (mode, header_bytes) in [
            (ReplyMode::Structured, wire::STRUCTURED_REPLY_HEADER_BYTES),
            (ReplyMode::Extended, wire::EXTENDED_REPLY_HEADER_BYTES),
        ] {
            let mut out = Vec::new();
            encode_chunk_header(
                &mut out,
                mode,
                REPLY_FLAG_DONE,
                REPLY_TYPE_OFFSET_DATA,
                to,
                520,
            );
            assert_eq!(out.len(), header_bytes);
            assert_eq!(decode_chunk_header(&out[..header_bytes - 1]), Ok(None));
            let header = decode_chunk_header(&out).unwrap().unwrap();
            assert_eq!(
                header,
                ChunkHeader {
                    mode,
                    flags: REPLY_FLAG_DONE,
                    reply_type: REPLY_TYPE_OFFSET_DATA,
                    cookie: 77,
                    offset: if mode == ReplyMode::Extended {
                        1 << 33
                    } else {
                        0
                    },
                    payload_bytes: 520,
                }
            );
            assert!(header.is_done());
        }
        let mut simple = Vec::new();
        encode_simple(&mut simple, 1, 0);
        assert_eq!(
            decode_chunk_header(&simple[..4]),
            Err(ReplyError::BadReplyMagic {
                magic: SIMPLE_REPLY_MAGIC
            })
        );
    }
}
