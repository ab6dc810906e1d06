//! A hand-driven NBD client for tests of what real clients never send:
//! the frames come from `cairn-nbd-proto`, the bytes go out as the test
//! says.

use std::io::{Read, Write};

use cairn_nbd_proto::codec::option::encode_option;
use cairn_nbd_proto::proto::{IHAVEOPT, NBDMAGIC, OPTION_REPLY_MAGIC};

/// Read the fixed-newstyle greeting and answer it (fixed newstyle, no
/// zeroes); false if the server closed first.
pub fn greet(s: &mut (impl Read + Write)) -> bool {
    let mut greeting = [0u8; 18];
    if s.read_exact(&mut greeting).is_err() {
        return false;
    }
    assert_eq!(&greeting[..8], &NBDMAGIC.to_be_bytes());
    assert_eq!(&greeting[8..16], &IHAVEOPT.to_be_bytes());
    s.write_all(&3u32.to_be_bytes()).is_ok()
}

/// An option header claiming `length` bytes of data (sent or not).
pub fn option_header(option: u32, length: u32) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&IHAVEOPT.to_be_bytes());
    h.extend_from_slice(&option.to_be_bytes());
    h.extend_from_slice(&length.to_be_bytes());
    h
}

/// An option with its data.
pub fn option(option: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_option(&mut out, option, data);
    out
}

/// One option reply: (option, reply type, data); `None` at EOF.
pub fn read_option_reply(s: &mut impl Read) -> Option<(u32, u32, Vec<u8>)> {
    let mut header = [0u8; 20];
    s.read_exact(&mut header).ok()?;
    assert_eq!(&header[..8], &OPTION_REPLY_MAGIC.to_be_bytes());
    let option = u32::from_be_bytes(header[8..12].try_into().ok()?);
    let reply = u32::from_be_bytes(header[12..16].try_into().ok()?);
    let length = u32::from_be_bytes(header[16..20].try_into().ok()?);
    assert!(length <= 64 * 1024, "option reply of {length} bytes");
    let mut data = vec![0u8; length as usize];
    s.read_exact(&mut data).ok()?;
    Some((option, reply, data))
}

/// The data of NBD_OPT_GO / NBD_OPT_INFO for `name`, no info requests.
pub fn go_data(name: &str) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend_from_slice(&(name.len() as u32).to_be_bytes());
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&0u16.to_be_bytes());
    d
}
