//! The NBD protocol, written once for all of cairn.
//!
//! - [`proto`]: every wire constant (magics, options, reply types, flags,
//!   commands, errors) and the errno mappings.
//! - [`codec`]: frames as pure functions, bytes in and frames out, with no
//!   sockets and no threads. The server half ([`codec::Negotiation`],
//!   [`codec::decode_request`], the reply encoders) is fuzzed on its own;
//!   the client half (option and request encoders, option-reply, NBD_INFO
//!   and reply-header decoders) sits next to the server function that
//!   produces or consumes the same frame.
//!
//! The NBD server (`cairn-nbd`) and the NBD client device (`cairn-device`)
//! both build on this crate, which depends on neither.

pub mod codec;
pub mod proto;
