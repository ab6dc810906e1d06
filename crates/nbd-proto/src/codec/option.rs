//! Option-haggling frames, both ways: what a client sends (option headers
//! and their data) and what a server answers (option replies and the
//! NBD_INFO payloads inside REP_INFO).

use super::wire::{put_u16, put_u32, put_u64, Reader};
use super::{BlockSizes, ReplyError};
use crate::proto::*;

/// IHAVEOPT, option, claimed length: the header of a client option. The
/// data (if any) follows it.
pub fn encode_option_header(out: &mut Vec<u8>, option: u32, length_bytes: u32) {
    put_u64(out, IHAVEOPT);
    put_u32(out, option);
    put_u32(out, length_bytes);
}

/// A whole client option: its header, then `data` (empty for ABORT).
pub fn encode_option(out: &mut Vec<u8>, option: u32, data: &[u8]) {
    encode_option_header(out, option, data.len() as u32);
    out.extend_from_slice(data);
}

/// The data of NBD_OPT_INFO or NBD_OPT_GO: the export name, then the
/// NBD_INFO items asked for (INFO_EXPORT always comes, asked or not).
pub fn encode_info_request(out: &mut Vec<u8>, name: &str, infos: &[u16]) {
    put_u32(out, name.len() as u32);
    out.extend_from_slice(name.as_bytes());
    put_u16(out, infos.len() as u16);
    for info in infos {
        put_u16(out, *info);
    }
}

/// The data of NBD_OPT_LIST_META_CONTEXT or NBD_OPT_SET_META_CONTEXT.
pub fn encode_meta_context_request(out: &mut Vec<u8>, name: &str, queries: &[&str]) {
    put_u32(out, name.len() as u32);
    out.extend_from_slice(name.as_bytes());
    put_u32(out, queries.len() as u32);
    for query in queries {
        put_u32(out, query.len() as u32);
        out.extend_from_slice(query.as_bytes());
    }
}

/// One option reply: magic, option, reply type, then `data`.
pub fn encode_option_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, data: &[u8]) {
    put_u64(out, OPTION_REPLY_MAGIC);
    put_u32(out, option);
    put_u32(out, reply_type);
    put_u32(out, data.len() as u32);
    out.extend_from_slice(data);
}

/// The fixed part of an option reply; `length_bytes` of data follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    pub option: u32,
    pub reply_type: u32,
    pub length_bytes: u32,
}

impl OptionReplyHeader {
    /// An NBD_REP_ERR_* reply, which ends the option like REP_ACK does.
    pub fn is_error(&self) -> bool {
        self.reply_type & REP_FLAG_ERROR != 0
    }
}

/// Parse an option reply header from the front of `input`.
///
/// The magic is checked as soon as its 8 bytes are there, so a client can
/// read the magic alone and refuse garbage before reading on. `Ok(None)`:
/// fewer than [`super::wire::OPTION_REPLY_HEADER_BYTES`] bytes (and no bad magic).
pub fn decode_option_reply_header(input: &[u8]) -> Result<Option<OptionReplyHeader>, ReplyError> {
    let mut r = Reader::new(input);
    let Some(magic) = r.u64() else {
        return Ok(None);
    };
    if magic != OPTION_REPLY_MAGIC {
        return Err(ReplyError::BadOptionReplyMagic { magic });
    }
    let (Some(option), Some(reply_type), Some(length_bytes)) = (r.u32(), r.u32(), r.u32()) else {
        return Ok(None);
    };
    Ok(Some(OptionReplyHeader {
        option,
        reply_type,
        length_bytes,
    }))
}

/// One NBD_INFO item, the payload of a REP_INFO reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Info<'a> {
    /// INFO_EXPORT: the export's size and transmission flags.
    Export {
        size_bytes: u64,
        transmission_flags: u16,
    },
    /// INFO_NAME: the export's canonical name.
    Name(&'a [u8]),
    /// INFO_DESCRIPTION: free text for humans.
    Description(&'a [u8]),
    /// INFO_BLOCK_SIZE: minimum, preferred and maximum block sizes.
    BlockSize(BlockSizes),
}

impl<'a> Info<'a> {
    /// Append the REP_INFO payload (type, then fields) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match *self {
            Info::Export {
                size_bytes,
                transmission_flags,
            } => {
                put_u16(out, INFO_EXPORT);
                put_u64(out, size_bytes);
                put_u16(out, transmission_flags);
            }
            Info::Name(name) => {
                put_u16(out, INFO_NAME);
                out.extend_from_slice(name);
            }
            Info::Description(text) => {
                put_u16(out, INFO_DESCRIPTION);
                out.extend_from_slice(text);
            }
            Info::BlockSize(sizes) => {
                put_u16(out, INFO_BLOCK_SIZE);
                put_u32(out, sizes.min_bytes);
                put_u32(out, sizes.preferred_bytes);
                put_u32(out, sizes.max_bytes);
            }
        }
    }

    /// Parse a REP_INFO payload. `None` for an unknown type or one too
    /// short for its fields, which a client ignores; bytes past the fixed
    /// fields are ignored too.
    pub fn decode(payload: &'a [u8]) -> Option<Info<'a>> {
        let mut r = Reader::new(payload);
        match r.u16()? {
            INFO_EXPORT => Some(Info::Export {
                size_bytes: r.u64()?,
                transmission_flags: r.u16()?,
            }),
            INFO_NAME => Some(Info::Name(r.take(r.remaining())?)),
            INFO_DESCRIPTION => Some(Info::Description(r.take(r.remaining())?)),
            INFO_BLOCK_SIZE => Some(Info::BlockSize(BlockSizes {
                min_bytes: r.u32()?,
                preferred_bytes: r.u32()?,
                max_bytes: r.u32()?,
            })),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::wire;

    #[test]
    fn option_layouts() {
        let mut out = Vec::new();
        encode_option(&mut out, OPT_EXPORT_NAME, b"disk");
        let mut expected = IHAVEOPT.to_be_bytes().to_vec();
        expected.extend_from_slice(&1u32.to_be_bytes());
        expected.extend_from_slice(&4u32.to_be_bytes());
        expected.extend_from_slice(b"disk");
        assert_eq!(out, expected);

        out.clear();
        encode_option(&mut out, OPT_ABORT, &[]);
        assert_eq!(out.len(), wire::OPTION_HEADER_BYTES);
        assert_eq!(&out[8..12], &OPT_ABORT.to_be_bytes());
        assert_eq!(&out[12..16], &0u32.to_be_bytes());

        out.clear();
        encode_option_header(&mut out, OPT_GO, 0xffff_ffff);
        assert_eq!(&out[12..16], &[0xff; 4]);
    }

    #[test]
    fn go_data_names_the_export_and_the_infos() {
        let mut data = Vec::new();
        encode_info_request(&mut data, "disk", &[INFO_BLOCK_SIZE]);
        assert_eq!(data, [0, 0, 0, 4, b'd', b'i', b's', b'k', 0, 1, 0, 3]);

        data.clear();
        encode_meta_context_request(&mut data, "", &[BASE_ALLOCATION]);
        let mut expected = vec![0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 15];
        expected.extend_from_slice(BASE_ALLOCATION.as_bytes());
        assert_eq!(data, expected);
    }

    #[test]
    fn option_reply_header_round_trip() {
        let mut out = Vec::new();
        encode_option_reply(&mut out, OPT_GO, REP_ERR_UNKNOWN, b"nope");
        assert_eq!(out.len(), wire::OPTION_REPLY_HEADER_BYTES + 4);
        // The magic alone is enough to accept or refuse.
        assert_eq!(decode_option_reply_header(&out[..8]), Ok(None));
        assert_eq!(
            decode_option_reply_header(&out[..19]),
            Ok(None),
            "one byte short"
        );
        let header = decode_option_reply_header(&out).unwrap().unwrap();
        assert_eq!(
            header,
            OptionReplyHeader {
                option: OPT_GO,
                reply_type: REP_ERR_UNKNOWN,
                length_bytes: 4
            }
        );
        assert!(header.is_error());

        out[0] ^= 1;
        assert_eq!(
            decode_option_reply_header(&out[..8]),
            Err(ReplyError::BadOptionReplyMagic {
                magic: OPTION_REPLY_MAGIC ^ (1 << 56)
            })
        );
        assert_eq!(
            ReplyError::BadOptionReplyMagic { magic: 0x1234 }.to_string(),
            "bad option reply magic 0x1234"
        );
    }

    #[test]
    fn info_round_trip() {
        let sizes = BlockSizes {
            min_bytes: 512,
            preferred_bytes: 4096,
            max_bytes: 1 << 20,
        };
        for info in [
            Info::Export {
                size_bytes: 1 << 40,
                transmission_flags: FLAG_HAS_FLAGS | FLAG_READ_ONLY,
            },
            Info::Name(b"disk"),
            Info::Description(b""),
            Info::BlockSize(sizes),
        ] {
            let mut payload = Vec::new();
            info.encode(&mut payload);
            assert_eq!(Info::decode(&payload), Some(info));
            // Extra bytes after the fields are not an error.
            if let Info::Export { .. } | Info::BlockSize(_) = info {
                payload.push(0);
                assert_eq!(Info::decode(&payload), Some(info));
            }
        }
        let mut payload = Vec::new();
        Info::Export {
            size_bytes: 7,
            transmission_flags: 1,
        }
        .encode(&mut payload);
        assert_eq!(payload.len(), 12);
        assert_eq!(Info::decode(&payload[..11]), None, "short INFO_EXPORT");
        assert_eq!(Info::decode(&[0]), None, "no type");
        assert_eq!(Info::decode(&[0, 99, 1, 2]), None, "unknown type");
    }
}
