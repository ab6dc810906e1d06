//! A pure NBD protocol codec: bytes in, frames and reply bytes out, no I/O.
//!
//! Server side:
//! - [`Negotiation`] runs the fixed-newstyle handshake one option at a time
//!   and ends in a [`Session`] describing what was agreed. It asks an
//!   [`ExportCatalog`] (one export, an [`ExportList`], or the server's
//!   registry) which exports there are.
//! - [`decode_request`] parses one transmission request header and validates
//!   it against the session (bounds, flags, sizes).
//! - The `encode_*` functions in [`reply`] build simple, structured and
//!   extended replies.
//!
//! Client side, each next to the server function for the same frame:
//! - [`option`]: option headers and data (GO/INFO with information
//!   requests, EXPORT_NAME, ABORT, meta contexts), option-reply headers and
//!   NBD_INFO payloads ([`Info`]).
//! - [`RequestHeader`]: compact and extended request headers.
//! - [`reply::decode_simple_reply`] and [`reply::decode_chunk_header`].
//!
//! Every server-side parser is incremental: given too few bytes it answers
//! `NeedMore { min_total_bytes }`, and it checks client-claimed lengths
//! against [`Limits`] *before* asking for more, so a caller that buffers
//! what it is told never holds more than the limits allow. The client-side
//! decoders check a magic as soon as its bytes are there, so a client can
//! refuse garbage before it reads further.

mod catalog;
mod export_list;
mod handshake;
pub mod harness;
pub mod option;
pub mod reply;
mod request;
pub mod wire;

pub use catalog::{ExportCatalog, MAX_LISTED_EXPORTS};
pub use export_list::ExportList;
pub use handshake::{client_flags_for, Negotiation, NegotiationStep};
pub use option::{Info, OptionReplyHeader};
pub use request::{
    decode_request, Command, ReplyTo, Request, RequestAction, RequestDecode, RequestHeader,
};

use crate::proto;

/// Size limits the codec enforces on client input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Largest option payload accepted during negotiation. Longer options
    /// end the session before any of the payload is buffered.
    pub max_option_bytes: u32,
    /// Largest export name or metadata query (the spec's hard limit is 4096).
    pub max_name_bytes: u32,
    /// Options a client may send before the server gives up on it.
    pub max_options: u32,
    /// Largest READ/WRITE payload (advertised as the maximum block size).
    pub max_payload_bytes: u32,
    /// An oversized write payload up to this many bytes is read and thrown
    /// away so the client gets EINVAL; anything larger ends the session.
    pub max_discard_bytes: u64,
    /// Most extents in one BLOCK_STATUS reply chunk.
    pub max_block_status_extents: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_option_bytes: 64 * 1024,
            max_name_bytes: proto::MAX_STRING_BYTES as u32,
            max_options: 256,
            max_payload_bytes: 32 * 1024 * 1024,
            max_discard_bytes: 64 * 1024 * 1024,
            max_block_status_extents: 64 * 1024,
        }
    }
}

/// Block size constraints sent in NBD_INFO_BLOCK_SIZE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    pub min_bytes: u32,
    pub preferred_bytes: u32,
    pub max_bytes: u32,
}

impl Default for BlockSizes {
    fn default() -> Self {
        BlockSizes {
            min_bytes: 512,
            preferred_bytes: 4096,
            max_bytes: 32 * 1024 * 1024,
        }
    }
}

/// One export, as the negotiation describes it to a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// The server's identity for this export, opaque to the codec: the
    /// [`Session`] hands it back, so the server serves the very export the
    /// client was told about (not another one added under the same name
    /// since).
    pub id: u64,
    /// The export's canonical name (NBD_INFO_NAME, NBD_REP_SERVER).
    pub name: String,
    pub description: Option<String>,
    pub size_bytes: u64,
    pub read_only: bool,
    pub block_sizes: BlockSizes,
    /// Offer NBD_OPT_EXTENDED_HEADERS (64-bit lengths). When false the
    /// option is answered with ERR_UNSUP and clients fall back. It is a
    /// server setting, asked before any export is chosen: a one-export
    /// negotiation ([`Negotiation::new`]) takes it from its export, one
    /// over a catalog ([`Negotiation::with_catalog`]) from its own
    /// argument, and then ignores this field.
    pub extended_headers: bool,
}

/// Which reply headers the transmission phase uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyMode {
    Simple,
    Structured,
    Extended,
}

/// The outcome of a successful negotiation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub size_bytes: u64,
    pub transmission_flags: u16,
    pub mode: ReplyMode,
    /// The client selected `base:allocation` with SET_META_CONTEXT.
    pub base_allocation: bool,
    /// The client asked for NBD_INFO_BLOCK_SIZE in NBD_OPT_GO, so it
    /// promised to respect the minimum block size; unaligned requests get
    /// EINVAL.
    pub block_sizes_agreed: bool,
    pub block_sizes: BlockSizes,
    pub read_only: bool,
    /// The session runs over TLS (STARTTLS was negotiated).
    pub tls: bool,
    /// The chosen export: [`ExportInfo::id`] and its canonical name.
    pub export_id: u64,
    pub export_name: String,
}

/// What the server does with NBD_OPT_STARTTLS (nbdkit's `--tls`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsPolicy {
    /// STARTTLS is refused with ERR_POLICY.
    #[default]
    Off,
    /// Clients may upgrade with STARTTLS or stay in clear text.
    Offered,
    /// Nothing but STARTTLS and ABORT is answered before TLS (each other
    /// option gets ERR_TLS_REQD; EXPORT_NAME ends the connection).
    Required,
}

impl Session {
    pub fn extended(&self) -> bool {
        self.mode == ReplyMode::Extended
    }

    pub fn request_header_bytes(&self) -> usize {
        if self.extended() {
            wire::EXTENDED_REQUEST_BYTES
        } else {
            wire::COMPACT_REQUEST_BYTES
        }
    }
}

/// The metadata context id used for `base:allocation`.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// Transmission flags for an export, given what was negotiated so far.
pub fn transmission_flags(info: &ExportInfo, mode: ReplyMode) -> u16 {
    let mut flags = proto::FLAG_HAS_FLAGS
        | proto::FLAG_SEND_FLUSH
        | proto::FLAG_CAN_MULTI_CONN
        | proto::FLAG_SEND_CACHE;
    if info.read_only {
        // The commands that change data are refused (EPERM), so they are
        // not offered either, as nbdkit -r does. FLUSH stays: the spec
        // lets a client flush a read-only export, and it is harmless.
        flags |= proto::FLAG_READ_ONLY;
    } else {
        flags |= proto::FLAG_SEND_FUA
            | proto::FLAG_SEND_TRIM
            | proto::FLAG_SEND_WRITE_ZEROES
            | proto::FLAG_SEND_FAST_ZERO;
    }
    // DF only means something once reads are answered with chunks.
    if mode != ReplyMode::Simple {
        flags |= proto::FLAG_SEND_DF;
    }
    flags
}

/// A client violation that ends the session (a hard disconnect). The
/// server logs it and closes only this connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    #[error("client sent unknown handshake flags {flags:#x}")]
    BadClientFlags { flags: u32 },
    #[error("expected IHAVEOPT option magic, got {magic:#018x}")]
    BadOptionMagic { magic: u64 },
    #[error("option {option} claims {length_bytes} bytes of data, limit is {max_bytes}")]
    OptionTooLong {
        option: u32,
        length_bytes: u32,
        max_bytes: u32,
    },
    #[error("NBD_OPT_EXPORT_NAME with a {length_bytes}-byte name, limit is {max_bytes}")]
    ExportNameTooLong { length_bytes: u32, max_bytes: u32 },
    #[error("NBD_OPT_EXPORT_NAME for unknown export {name:?}")]
    UnknownExport { name: String },
    #[error("NBD_OPT_EXPORT_NAME after extended headers were negotiated")]
    ExportNameAfterExtendedHeaders,
    #[error("client sent more than {max} options")]
    TooManyOptions { max: u32 },
    #[error("expected request magic {expected:#010x}, got {magic:#010x}")]
    BadRequestMagic { magic: u32, expected: u32 },
    #[error("request payload of {length_bytes} bytes is too large to skip (limit {max_bytes})")]
    PayloadTooLarge { length_bytes: u64, max_bytes: u64 },
    #[error("data after the session ended")]
    AfterEnd,
    #[error(
        "TLS is required, and the client asked for an export with NBD_OPT_EXPORT_NAME without it"
    )]
    TlsRequired,
    #[error("client sent {bytes} bytes after NBD_OPT_STARTTLS without waiting for its reply")]
    DataAfterStartTls { bytes: usize },
}

/// A server answer a client cannot frame: the stream is lost.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReplyError {
    #[error("bad option reply magic {magic:#x}")]
    BadOptionReplyMagic { magic: u64 },
    #[error("bad reply magic {magic:#x}")]
    BadReplyMagic { magic: u32 },
}

/// Lossy, bounded rendering of client bytes for logs and errors.
pub(crate) fn printable(bytes: &[u8]) -> String {
    let shown = &bytes[..bytes.len().min(64)];
    let mut s = String::from_utf8_lossy(shown).into_owned();
    if bytes.len() > shown.len() {
        s.push_str("...");
    }
    s
}
