//! Transmission-phase requests: the header a client encodes, and the
//! server's parsing and validation of it.

use super::wire::{self, Reader};
use super::{Limits, ProtocolError, Session};
use crate::proto::*;

/// The fields of a request header, as a client sends them. A WRITE's
/// payload follows the header on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub command: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length_bytes: u64,
}

impl RequestHeader {
    /// The compact header (REQUEST_MAGIC, 32-bit length) used unless
    /// extended headers were negotiated. `length_bytes` must fit in 32 bits.
    pub fn to_compact(&self) -> [u8; wire::COMPACT_REQUEST_BYTES] {
        debug_assert!(self.length_bytes <= u32::MAX as u64);
        let mut h = [0u8; wire::COMPACT_REQUEST_BYTES];
        self.put_fields(&mut h, REQUEST_MAGIC);
        h[24..28].copy_from_slice(&(self.length_bytes as u32).to_be_bytes());
        h
    }

    /// The extended header (EXTENDED_REQUEST_MAGIC, 64-bit length).
    pub fn to_extended(&self) -> [u8; wire::EXTENDED_REQUEST_BYTES] {
        let mut h = [0u8; wire::EXTENDED_REQUEST_BYTES];
        self.put_fields(&mut h, EXTENDED_REQUEST_MAGIC);
        h[24..32].copy_from_slice(&self.length_bytes.to_be_bytes());
        h
    }

    /// Append the header in the form the session uses.
    pub fn encode(&self, out: &mut Vec<u8>, extended: bool) {
        if extended {
            out.extend_from_slice(&self.to_extended());
        } else {
            out.extend_from_slice(&self.to_compact());
        }
    }

    /// Magic through offset: the 24 bytes both forms share.
    fn put_fields(&self, h: &mut [u8], magic: u32) {
        h[0..4].copy_from_slice(&magic.to_be_bytes());
        h[4..6].copy_from_slice(&self.flags.to_be_bytes());
        h[6..8].copy_from_slice(&self.command.to_be_bytes());
        h[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        h[16..24].copy_from_slice(&self.offset.to_be_bytes());
    }
}

/// Where a reply goes: the cookie to echo, plus the request offset (extended
/// replies echo it too) and the command (a READ always gets a structured
/// reply once structured replies are on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyTo {
    pub cookie: u64,
    pub offset: u64,
    pub command: u16,
}

/// A validated command. Offsets and lengths are in range for the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read {
        length_bytes: u32,
    },
    /// `length_bytes` of payload follow the header on the wire.
    Write {
        length_bytes: u32,
        fua: bool,
    },
    Flush,
    Trim {
        length_bytes: u64,
        fua: bool,
    },
    WriteZeroes {
        length_bytes: u64,
        fua: bool,
        may_trim: bool,
        fast_only: bool,
    },
    Cache {
        length_bytes: u64,
    },
    BlockStatus {
        length_bytes: u64,
        req_one: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub reply_to: ReplyTo,
    pub offset: u64,
    pub command: Command,
}

impl Request {
    /// Payload bytes that follow the header on the wire.
    pub fn payload_bytes(&self) -> u64 {
        match self.command {
            Command::Write { length_bytes, .. } => length_bytes as u64,
            _ => 0,
        }
    }
}

/// What the caller must do with a parsed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestAction {
    /// Run it. For `Write`, read `payload_bytes()` bytes first.
    Execute(Request),
    /// Reply with `errno` and carry on, after reading and dropping
    /// `discard_bytes` of payload that followed the header.
    Reject {
        reply_to: ReplyTo,
        errno: u32,
        message: &'static str,
        discard_bytes: u64,
    },
    /// NBD_CMD_DISC: finish in-flight requests, then close.
    Disconnect,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestDecode {
    NeedMore {
        min_total_bytes: usize,
    },
    /// `header_bytes` were consumed from the input.
    Request {
        header_bytes: usize,
        action: RequestAction,
    },
}

/// Parse one request header from the front of `input` and validate it.
///
/// Never reads past the header: payload handling is up to the caller, as
/// told by the returned action. An `Err` means the stream can no longer be
/// framed (bad magic, unskippable payload) and the session must end.
pub fn decode_request(
    input: &[u8],
    session: &Session,
    limits: &Limits,
) -> Result<RequestDecode, ProtocolError> {
    let header_bytes = session.request_header_bytes();
    let expected = if session.extended() {
        EXTENDED_REQUEST_MAGIC
    } else {
        REQUEST_MAGIC
    };
    let mut r = Reader::new(input);
    let Some(magic) = r.u32() else {
        return Ok(RequestDecode::NeedMore {
            min_total_bytes: header_bytes,
        });
    };
    if magic != expected {
        return Err(ProtocolError::BadRequestMagic { magic, expected });
    }
    if input.len() < header_bytes {
        return Ok(RequestDecode::NeedMore {
            min_total_bytes: header_bytes,
        });
    }
    // The length check above makes these infallible; keep the Option path
    // anyway rather than unwrap.
    let fields = (|| {
        let flags = r.u16()?;
        let command = r.u16()?;
        let cookie = r.u64()?;
        let offset = r.u64()?;
        let length = if session.extended() {
            r.u64()?
        } else {
            r.u32()? as u64
        };
        Some((flags, command, cookie, offset, length))
    })();
    let Some((flags, command, cookie, offset, length)) = fields else {
        return Ok(RequestDecode::NeedMore {
            min_total_bytes: header_bytes,
        });
    };
    debug_assert_eq!(r.remaining(), input.len() - header_bytes);

    // How many payload bytes follow, independent of whether the request is
    // valid: that decides how the stream continues.
    // A WRITE always carries its payload. With extended headers the spec
    // wants PAYLOAD_LEN on it too, but qemu (10.0) omits the flag and its
    // own server accepts that, so we do as well.
    let payload_bytes =
        if command == CMD_WRITE || (session.extended() && flags & CMD_FLAG_PAYLOAD_LEN != 0) {
            length
        } else {
            0
        };
    let reply_to = ReplyTo {
        cookie,
        offset,
        command,
    };
    let action = if payload_bytes > limits.max_payload_bytes as u64 {
        if payload_bytes > limits.max_discard_bytes {
            return Err(ProtocolError::PayloadTooLarge {
                length_bytes: payload_bytes,
                max_bytes: limits.max_discard_bytes,
            });
        }
        reject(
            reply_to,
            NBD_EINVAL,
            "payload exceeds the maximum block size",
            payload_bytes,
        )
    } else {
        validate(session, limits, reply_to, flags, length, payload_bytes)
    };
    Ok(RequestDecode::Request {
        header_bytes,
        action,
    })
}

fn reject(
    reply_to: ReplyTo,
    errno: u32,
    message: &'static str,
    discard_bytes: u64,
) -> RequestAction {
    RequestAction::Reject {
        reply_to,
        errno,
        message,
        discard_bytes,
    }
}

fn validate(
    session: &Session,
    limits: &Limits,
    reply_to: ReplyTo,
    flags: u16,
    length: u64,
    payload_bytes: u64,
) -> RequestAction {
    let command = reply_to.command;
    let offset = reply_to.offset;
    let fail = |errno: u32, message: &'static str| reject(reply_to, errno, message, payload_bytes);

    let structured = session.mode != super::ReplyMode::Simple;
    // FUA is valid on every command (we advertise SEND_FUA on writable
    // exports; a read-only one still takes it, as there is nothing to
    // make durable); the rest are command specific.
    let allowed = CMD_FLAG_FUA
        | match command {
            CMD_READ if structured => CMD_FLAG_DF,
            CMD_WRITE if session.extended() => CMD_FLAG_PAYLOAD_LEN,
            CMD_WRITE_ZEROES => CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
            CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
            _ => 0,
        };
    match command {
        CMD_DISC => return RequestAction::Disconnect,
        CMD_READ | CMD_WRITE | CMD_FLUSH | CMD_TRIM | CMD_CACHE | CMD_WRITE_ZEROES
        | CMD_BLOCK_STATUS => {}
        _ => return fail(NBD_EINVAL, "unknown command"),
    }
    if flags & !allowed != 0 {
        return fail(NBD_EINVAL, "flag not valid for this command");
    }
    if command != CMD_WRITE && payload_bytes != 0 {
        return fail(NBD_EINVAL, "command does not take a payload");
    }
    let writes = matches!(command, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if writes && session.read_only {
        return fail(NBD_EPERM, "export is read-only");
    }
    if command == CMD_FLUSH {
        if offset != 0 || length != 0 {
            return fail(NBD_EINVAL, "FLUSH offset and length must be zero");
        }
        return RequestAction::Execute(Request {
            reply_to,
            offset: 0,
            command: Command::Flush,
        });
    }
    if command == CMD_READ && length > limits.max_payload_bytes as u64 {
        return fail(NBD_EINVAL, "read exceeds the maximum block size");
    }
    let in_bounds = offset
        .checked_add(length)
        .is_some_and(|end| end <= session.size_bytes);
    if !in_bounds {
        return if matches!(command, CMD_WRITE | CMD_WRITE_ZEROES) {
            fail(NBD_ENOSPC, "request extends past the end of the export")
        } else {
            fail(NBD_EINVAL, "request extends past the end of the export")
        };
    }
    // Alignment binds the data commands; BLOCK_STATUS and CACHE are hints.
    let aligned_command = matches!(command, CMD_READ | CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if session.block_sizes_agreed && aligned_command {
        let min = session.block_sizes.min_bytes.max(1) as u64;
        // The tail of an export whose size is not a multiple of the minimum
        // block is still reachable.
        let ends_at_size = offset + length == session.size_bytes;
        if offset % min != 0 || (length % min != 0 && !ends_at_size) {
            return fail(
                NBD_EINVAL,
                "request is not aligned to the minimum block size",
            );
        }
    }
    match command_for(session, command, flags, length) {
        Ok(command) => RequestAction::Execute(Request {
            reply_to,
            offset,
            command,
        }),
        Err(message) => fail(NBD_EINVAL, message),
    }
}

/// The command of a request that passed the checks of [`validate`], or
/// why it is refused (EINVAL).
fn command_for(
    session: &Session,
    command: u16,
    flags: u16,
    length: u64,
) -> Result<Command, &'static str> {
    let fua = flags & CMD_FLAG_FUA != 0;
    Ok(match command {
        // Both lengths were checked against max_payload_bytes (a u32) in
        // `validate`.
        CMD_READ => Command::Read {
            length_bytes: length as u32,
        },
        CMD_WRITE => Command::Write {
            length_bytes: length as u32,
            fua,
        },
        CMD_TRIM => Command::Trim {
            length_bytes: length,
            fua,
        },
        CMD_CACHE => Command::Cache {
            length_bytes: length,
        },
        CMD_WRITE_ZEROES => Command::WriteZeroes {
            length_bytes: length,
            fua,
            may_trim: flags & CMD_FLAG_NO_HOLE == 0,
            fast_only: flags & CMD_FLAG_FAST_ZERO != 0,
        },
        _ => {
            if !session.base_allocation {
                return Err("BLOCK_STATUS without a selected metadata context");
            }
            if length == 0 {
                return Err("zero-length BLOCK_STATUS");
            }
            Command::BlockStatus {
                length_bytes: length,
                req_one: flags & CMD_FLAG_REQ_ONE != 0,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{BlockSizes, ReplyMode};

    fn session(mode: ReplyMode) -> Session {
        Session {
            size_bytes: 1 << 20,
            transmission_flags: 0,
            mode,
            base_allocation: false,
            block_sizes_agreed: false,
            block_sizes: BlockSizes::default(),
            read_only: false,
            tls: false,
            export_id: 0,
            export_name: String::new(),
        }
    }

    #[test]
    fn compact_header_layout() {
        let header = RequestHeader {
            flags: CMD_FLAG_FUA,
            command: CMD_WRITE,
            cookie: 9,
            offset: 4096,
            length_bytes: 13,
        };
        let mut expected = REQUEST_MAGIC.to_be_bytes().to_vec();
        expected.extend_from_slice(&[0, 1, 0, 1]);
        expected.extend_from_slice(&9u64.to_be_bytes());
        expected.extend_from_slice(&4096u64.to_be_bytes());
        expected.extend_from_slice(&13u32.to_be_bytes());
        assert_eq!(header.to_compact().to_vec(), expected);
        let mut out = Vec::new();
        header.encode(&mut out, false);
        assert_eq!(out, expected);
    }

    #[test]
    fn encoded_headers_decode_to_the_same_request() {
        for (mode, extended) in [(ReplyMode::Simple, false), (ReplyMode::Extended, true)] {
            let header = RequestHeader {
                flags: CMD_FLAG_FUA,
                command: CMD_TRIM,
                cookie: u64::MAX,
                offset: 8192,
                length_bytes: 4096,
            };
            let mut bytes = Vec::new();
            header.encode(&mut bytes, extended);
            let session = session(mode);
            assert_eq!(bytes.len(), session.request_header_bytes());
            let decoded = decode_request(&bytes, &session, &Limits::default()).unwrap();
            let RequestDecode::Request {
                header_bytes,
                action: RequestAction::Execute(request),
            } = decoded
            else {
                panic!("expected an executable request, got {decoded:?}");
            };
            assert_eq!(header_bytes, bytes.len());
            assert_eq!(request.reply_to.cookie, u64::MAX);
            assert_eq!(request.offset, 8192);
            assert_eq!(
                request.command,
                Command::Trim {
                    length_bytes: 4096,
                    fua: true
                }
            );
        }
    }

    #[test]
    fn extended_header_carries_64_bit_lengths() {
        let header = RequestHeader {
            flags: 0,
            command: CMD_BLOCK_STATUS,
            cookie: 1,
            offset: 0,
            length_bytes: 1 << 40,
        };
        let h = header.to_extended();
        assert_eq!(&h[0..4], &EXTENDED_REQUEST_MAGIC.to_be_bytes());
        assert_eq!(&h[24..32], &(1u64 << 40).to_be_bytes());
    }
}
