//! Byte builders for client input, shared by the codec tests here and, by
//! `#[path]`, the server tests of `cairn-nbd`. They wrap the codec's own
//! client encoders, whose layouts the unit tests pin byte by byte.
#![allow(dead_code)] // each test binary uses a different subset

use cairn_nbd_proto::codec::option::{
    encode_info_request, encode_meta_context_request, encode_option, encode_option_header,
};
use cairn_nbd_proto::codec::RequestHeader;
use cairn_nbd_proto::proto::*;

#[allow(unused_imports)] // each test binary uses a different subset
pub use cairn_nbd_proto::codec::wire::{put_u16 as be16, put_u32 as be32, put_u64 as be64};

pub fn client_flags(flags: u32) -> Vec<u8> {
    flags.to_be_bytes().to_vec()
}

pub fn option(option: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_option(&mut out, option, data);
    out
}

/// An option header claiming `length` bytes, without the data.
pub fn option_header(option: u32, length: u32) -> Vec<u8> {
    let mut out = Vec::new();
    encode_option_header(&mut out, option, length);
    out
}

pub fn info_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_info_request(&mut out, name, infos);
    out
}

pub fn meta_data(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_meta_context_request(&mut out, name, queries);
    out
}

/// A request header; in compact form only the low 32 bits of `length` are
/// sent, so tests can build any header a client could.
pub fn request(
    extended: bool,
    flags: u16,
    command: u16,
    cookie: u64,
    offset: u64,
    length: u64,
) -> Vec<u8> {
    let header = RequestHeader {
        flags,
        command,
        cookie,
        offset,
        length_bytes: if extended {
            length
        } else {
            length as u32 as u64
        },
    };
    let mut out = Vec::new();
    header.encode(&mut out, extended);
    out
}

/// A complete valid client byte stream: flags, the given negotiation
/// options, GO, then `requests` (each already encoded, payload included).
pub fn session_bytes(
    structured: bool,
    extended: bool,
    meta: bool,
    requests: &[Vec<u8>],
) -> Vec<u8> {
    let mut out = client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    if extended {
        out.extend(option(OPT_EXTENDED_HEADERS, &[]));
    } else if structured {
        out.extend(option(OPT_STRUCTURED_REPLY, &[]));
    }
    if meta {
        out.extend(option(
            OPT_SET_META_CONTEXT,
            &meta_data("", &[BASE_ALLOCATION]),
        ));
    }
    out.extend(option(OPT_GO, &info_data("", &[INFO_BLOCK_SIZE])));
    for r in requests {
        out.extend_from_slice(r);
    }
    out
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptReply {
    pub option: u32,
    pub reply_type: u32,
    pub data: Vec<u8>,
}
