//! The client side of the fixed-newstyle handshake: NBD_OPT_GO asking for
//! the block-size constraints, falling back to NBD_OPT_EXPORT_NAME. The
//! frames come from `cairn-nbd-proto`; this file does the reads and writes
//! and decides what the client accepts.

use std::io::{self, Read, Write};

use cairn_nbd_proto::codec::option::{
    decode_option_reply_header, encode_info_request, encode_meta_context_request, encode_option,
};
use cairn_nbd_proto::codec::wire::{OPTION_HEADER_BYTES, OPTION_REPLY_HEADER_BYTES};
use cairn_nbd_proto::codec::{client_flags_for, BlockSizes, Info, OptionReplyHeader, ReplyError};
use cairn_nbd_proto::proto::{
    option_name, BASE_ALLOCATION, DEFAULT_MAX_PAYLOAD_BYTES, EXPORT_NAME_PADDING_BYTES,
    FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES, IHAVEOPT, INFO_BLOCK_SIZE, MAX_MIN_BLOCK_BYTES,
    MAX_STRING_BYTES, NBDMAGIC, OLDSTYLE_MAGIC, OPT_ABORT, OPT_EXPORT_NAME, OPT_GO,
    OPT_SET_META_CONTEXT, OPT_STRUCTURED_REPLY, REP_ACK, REP_ERR_BLOCK_SIZE_REQD, REP_ERR_INVALID,
    REP_ERR_PLATFORM, REP_ERR_POLICY, REP_ERR_SHUTDOWN, REP_ERR_TLS_REQD, REP_ERR_TOO_BIG,
    REP_ERR_UNKNOWN, REP_ERR_UNSUP, REP_INFO, REP_META_CONTEXT,
};

use std::time::Duration;

use super::starttls::start_tls;
use super::transport::Stream;
use super::uri::NbdUri;

/// Option replies larger than this are a broken or hostile server.
const MAX_OPTION_REPLY_BYTES: u32 = 64 << 10;

/// Replies to one NBD_OPT_GO we read before giving up: a server sends a
/// handful of NBD_REP_INFO before its final reply.
const MAX_GO_REPLIES: usize = 64;

/// What the handshake tells us about the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct NegotiatedExport {
    pub size_bytes: u64,
    /// Transmission flags.
    pub flags: u16,
    pub min_block_bytes: u32,
    pub max_payload_bytes: u32,
}

pub(super) fn protocol_error(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

fn read_u16(r: &mut impl Read) -> io::Result<u16> {
    let mut b = [0u8; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}

pub(super) fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

/// One option, header and data, in one write.
pub(super) fn send_option(w: &mut impl Write, option: u32, data: &[u8]) -> io::Result<()> {
    let mut msg = Vec::with_capacity(OPTION_HEADER_BYTES + data.len());
    encode_option(&mut msg, option, data);
    w.write_all(&msg)
}

pub(super) fn option_error_name(reply: u32) -> &'static str {
    match reply {
        REP_ERR_UNSUP => "NBD_REP_ERR_UNSUP",
        REP_ERR_POLICY => "NBD_REP_ERR_POLICY",
        REP_ERR_INVALID => "NBD_REP_ERR_INVALID",
        REP_ERR_PLATFORM => "NBD_REP_ERR_PLATFORM",
        REP_ERR_TLS_REQD => {
            "NBD_REP_ERR_TLS_REQD (the server requires TLS: use an nbds:// or nbds+unix:// URI)"
        }
        REP_ERR_UNKNOWN => "NBD_REP_ERR_UNKNOWN (no such export)",
        REP_ERR_SHUTDOWN => "NBD_REP_ERR_SHUTDOWN",
        REP_ERR_BLOCK_SIZE_REQD => "NBD_REP_ERR_BLOCK_SIZE_REQD",
        REP_ERR_TOO_BIG => "NBD_REP_ERR_TOO_BIG",
        _ => "unknown option error",
    }
}

/// Connect, read the greeting and answer it, and (for `nbds://`) switch
/// to TLS: what follows is the option haggling, in plain text on the
/// returned stream either way.
pub(super) fn open_session(
    uri: &NbdUri,
    connect_timeout: Duration,
    stall_timeout: Duration,
) -> io::Result<(Stream, Greeting)> {
    let mut stream = Stream::connect(uri, connect_timeout)?;
    stream.set_timeouts(Some(connect_timeout), Some(connect_timeout))?;
    let mut greeting = greet(&mut stream, &uri.export)?;
    if let Some(tls) = &uri.tls {
        greeting.tls = Some(start_tls(&mut stream, &greeting, uri, tls, stall_timeout)?);
        // The relay's socket: the handshake's deadlines again.
        stream.set_timeouts(Some(connect_timeout), Some(connect_timeout))?;
    }
    Ok((stream, greeting))
}

/// Read the greeting and answer it with the client flags.
fn greet(stream: &mut Stream, export: &str) -> io::Result<Greeting> {
    if export.len() > MAX_STRING_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("export name longer than {MAX_STRING_BYTES} bytes"),
        ));
    }
    // Field by field, so a server that is not NBD is named as such even
    // when it sends less than a whole greeting.
    let magic = read_u64(stream)?;
    if magic != NBDMAGIC {
        return Err(protocol_error(format!(
            "not an NBD server (greeting {magic:#018x})"
        )));
    }
    let style = read_u64(stream)?;
    if style == OLDSTYLE_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the server speaks the oldstyle handshake, which cairn does not support",
        ));
    }
    if style != IHAVEOPT {
        return Err(protocol_error(format!(
            "unexpected handshake magic {style:#018x}"
        )));
    }
    let server_flags = read_u16(stream)?;
    let fixed = server_flags & FLAG_FIXED_NEWSTYLE != 0;
    let no_zeroes = server_flags & FLAG_NO_ZEROES != 0;
    stream.write_all(&client_flags_for(server_flags).to_be_bytes())?;
    Ok(Greeting {
        fixed,
        no_zeroes,
        tls: None,
    })
}

/// What the server's greeting allows.
pub(super) struct Greeting {
    /// Fixed newstyle: options can be haggled over.
    pub fixed: bool,
    pub no_zeroes: bool,
    /// The TLS relay, once STARTTLS succeeded (it knows why TLS ended).
    pub tls: Option<cairn_tls::RelayOutcome>,
}

impl Greeting {
    /// A handshake's outcome; a failure after TLS carries the reason the
    /// TLS session ended, if it did.
    fn explained<T>(&self, result: io::Result<T>) -> io::Result<T> {
        result.map_err(|e| super::starttls::explain(e, self.tls.as_ref()))
    }
}

/// Run the client side of the handshake, after [`open_session`], up to
/// the transmission phase.
pub(super) fn handshake(
    stream: &mut Stream,
    greeting: &Greeting,
    export: &str,
) -> io::Result<NegotiatedExport> {
    greeting.explained(negotiate_export(stream, greeting, export))
}

fn negotiate_export(
    stream: &mut Stream,
    greeting: &Greeting,
    export: &str,
) -> io::Result<NegotiatedExport> {
    let (fixed, no_zeroes) = (greeting.fixed, greeting.no_zeroes);
    if fixed {
        if let Some(info) = option_go(stream, export)? {
            return Ok(info);
        }
        tracing::debug!("server does not know NBD_OPT_GO; using NBD_OPT_EXPORT_NAME");
    }
    option_export_name(stream, export, no_zeroes)
}

/// The handshake of a connection that asks only for block status:
/// structured replies, then the `base:allocation` context, then GO.
/// `Ok(None)`: the server cannot give block status (no fixed newstyle, no
/// structured replies, no such context, no GO); the caller closes the
/// socket.
pub(super) fn extents_handshake(
    stream: &mut Stream,
    greeting: &Greeting,
    export: &str,
) -> io::Result<Option<(NegotiatedExport, u32)>> {
    greeting.explained(negotiate_extents(stream, greeting, export))
}

fn negotiate_extents(
    stream: &mut Stream,
    greeting: &Greeting,
    export: &str,
) -> io::Result<Option<(NegotiatedExport, u32)>> {
    if !greeting.fixed {
        return Ok(None);
    }
    send_option(stream, OPT_STRUCTURED_REPLY, &[])?;
    let (reply, _) = read_option_reply(stream, OPT_STRUCTURED_REPLY)?;
    if reply.reply_type != REP_ACK {
        abort(stream);
        return Ok(None);
    }
    let mut data = Vec::with_capacity(export.len() + BASE_ALLOCATION.len() + 12);
    encode_meta_context_request(&mut data, export, &[BASE_ALLOCATION]);
    send_option(stream, OPT_SET_META_CONTEXT, &data)?;
    let mut context_id: Option<u32> = None;
    for _ in 0..MAX_GO_REPLIES {
        let (reply, payload) = read_option_reply(stream, OPT_SET_META_CONTEXT)?;
        match reply.reply_type {
            // The context id, then its name.
            REP_META_CONTEXT
                if payload.len() >= 4 && &payload[4..] == BASE_ALLOCATION.as_bytes() =>
            {
                context_id = Some(u32::from_be_bytes([
                    payload[0], payload[1], payload[2], payload[3],
                ]));
            }
            REP_ACK => break,
            _ if reply.is_error() => {
                abort(stream);
                return Ok(None);
            }
            _ => {}
        }
    }
    let Some(context_id) = context_id else {
        abort(stream);
        return Ok(None);
    };
    Ok(option_go(stream, export)?.map(|info| (info, context_id)))
}

/// A soft disconnect during the handshake; errors only mean the server
/// already went away.
fn abort(stream: &mut Stream) {
    let _ = send_option(stream, OPT_ABORT, &[]);
}

/// Read one reply to `option`: the header (the magic first, so garbage is
/// refused before more is read), then its data.
pub(super) fn read_option_reply(
    stream: &mut Stream,
    option: u32,
) -> io::Result<(OptionReplyHeader, Vec<u8>)> {
    let bad = |err: ReplyError| protocol_error(err.to_string());
    let mut header = [0u8; OPTION_REPLY_HEADER_BYTES];
    stream.read_exact(&mut header[..8])?;
    decode_option_reply_header(&header[..8]).map_err(bad)?;
    stream.read_exact(&mut header[8..])?;
    let reply = decode_option_reply_header(&header)
        .map_err(bad)?
        .ok_or_else(|| protocol_error("short option reply header".into()))?;
    if reply.option != option {
        return Err(protocol_error(format!(
            "reply to option {}, expected NBD_OPT_{}",
            reply.option,
            option_name(option)
        )));
    }
    let len = reply.length_bytes;
    if len > MAX_OPTION_REPLY_BYTES {
        return Err(protocol_error(format!("option reply of {len} bytes")));
    }
    let mut payload = vec![0u8; len as usize];
    stream.read_exact(&mut payload)?;
    Ok((reply, payload))
}

/// NBD_OPT_GO; `None` when the server does not support it.
fn option_go(stream: &mut Stream, export: &str) -> io::Result<Option<NegotiatedExport>> {
    let mut data = Vec::with_capacity(export.len() + 8);
    encode_info_request(&mut data, export, &[INFO_BLOCK_SIZE]);
    send_option(stream, OPT_GO, &data)?;
    let mut size_and_flags: Option<(u64, u16)> = None;
    let mut block_sizes: Option<BlockSizes> = None;
    for _ in 0..MAX_GO_REPLIES {
        let (reply, payload) = read_option_reply(stream, OPT_GO)?;
        match reply.reply_type {
            REP_ACK => {
                let (size_bytes, flags) = size_and_flags.ok_or_else(|| {
                    protocol_error("NBD_OPT_GO succeeded without NBD_INFO_EXPORT".into())
                })?;
                return Ok(Some(negotiated(size_bytes, flags, block_sizes)?));
            }
            REP_INFO => match Info::decode(&payload) {
                Some(Info::Export {
                    size_bytes,
                    transmission_flags,
                }) => size_and_flags = Some((size_bytes, transmission_flags)),
                Some(Info::BlockSize(sizes)) => block_sizes = Some(sizes),
                // Information we did not ask for or do not know: ignore.
                _ => {}
            },
            REP_ERR_UNSUP => return Ok(None),
            _ if reply.is_error() => {
                // A soft disconnect, as the protocol asks; the error matters more.
                let _ = send_option(stream, OPT_ABORT, &[]);
                let message = String::from_utf8_lossy(&payload);
                return Err(io::Error::other(format!(
                    "the server refused export {export:?}: {}{}{}",
                    option_error_name(reply.reply_type),
                    if message.is_empty() { "" } else { ": " },
                    message
                )));
            }
            _ => {}
        }
    }
    Err(protocol_error("too many replies to NBD_OPT_GO".into()))
}

fn option_export_name(
    stream: &mut Stream,
    export: &str,
    no_zeroes: bool,
) -> io::Result<NegotiatedExport> {
    send_option(stream, OPT_EXPORT_NAME, export.as_bytes())?;
    let size_bytes = read_u64(stream).map_err(|err| {
        if err.kind() == io::ErrorKind::UnexpectedEof {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("the server closed the connection after NBD_OPT_EXPORT_NAME (no export {export:?}?)"),
            )
        } else {
            err
        }
    })?;
    let flags = read_u16(stream)?;
    if !no_zeroes {
        let mut zeroes = [0u8; EXPORT_NAME_PADDING_BYTES];
        stream.read_exact(&mut zeroes)?;
    }
    negotiated(size_bytes, flags, None)
}

/// Check the server's block sizes and settle what the client sends.
fn negotiated(
    size_bytes: u64,
    flags: u16,
    block_sizes: Option<BlockSizes>,
) -> io::Result<NegotiatedExport> {
    let (min_block_bytes, max_payload_bytes) = match block_sizes {
        Some(sizes) => {
            let (min, max) = (sizes.min_bytes, sizes.max_bytes);
            if !min.is_power_of_two() || min > MAX_MIN_BLOCK_BYTES || max < min {
                return Err(protocol_error(format!(
                    "invalid block sizes: minimum {min}, maximum {max}"
                )));
            }
            // Cap what we send at what every server must take, even if it
            // claims more (0xffffffff means "no limit").
            (min, max.min(DEFAULT_MAX_PAYLOAD_BYTES) / min * min)
        }
        None => (1, DEFAULT_MAX_PAYLOAD_BYTES),
    };
    Ok(NegotiatedExport {
        size_bytes,
        flags,
        min_block_bytes,
        max_payload_bytes,
    })
}
