//! Wire constants from the NBD protocol (`doc/proto.md`, plus the
//! `extension-ext-header` branch for extended headers). Every multi-byte
//! field on the wire is big-endian.

// Handshake magics.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// What an oldstyle server sends where a newstyle one sends IHAVEOPT.
pub const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;

/// The IANA port for NBD over TCP.
pub const DEFAULT_TCP_PORT: u16 = 10809;

// Transmission magics.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

// Handshake flags (server, 16 bits) and client flags (32 bits).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_PEEK_EXPORT: u32 = 4;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;
pub const OPT_EXTENDED_HEADERS: u32 = 11;

// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_FLAG_ERROR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
pub const REP_ERR_POLICY: u32 = REP_FLAG_ERROR | 2;
pub const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
pub const REP_ERR_PLATFORM: u32 = REP_FLAG_ERROR | 4;
pub const REP_ERR_TLS_REQD: u32 = REP_FLAG_ERROR | 5;
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_FLAG_ERROR | 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_FLAG_ERROR | 8;
pub const REP_ERR_TOO_BIG: u32 = REP_FLAG_ERROR | 9;
pub const REP_ERR_EXT_HEADER_REQD: u32 = REP_FLAG_ERROR | 10;

// NBD_INFO types inside REP_INFO.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Transmission flags (16 bits).
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const FLAG_READ_ONLY: u16 = 1 << 1;
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const FLAG_SEND_FUA: u16 = 1 << 3;
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const FLAG_SEND_DF: u16 = 1 << 7;
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const FLAG_SEND_RESIZE: u16 = 1 << 9;
pub const FLAG_SEND_CACHE: u16 = 1 << 10;
pub const FLAG_SEND_FAST_ZERO: u16 = 1 << 11;
pub const FLAG_BLOCK_STATUS_PAYLOAD: u16 = 1 << 12;

// Commands.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
pub const CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

// Structured / extended reply chunks.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_BLOCK_STATUS_EXT: u16 = 6;
/// Set in the type of every error chunk, known or not.
pub const REPLY_TYPE_FLAG_ERROR: u16 = 1 << 15;
pub const REPLY_TYPE_ERROR: u16 = REPLY_TYPE_FLAG_ERROR | 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = REPLY_TYPE_FLAG_ERROR | 2;

// `base:allocation` status bits.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;
pub const BASE_ALLOCATION: &str = "base:allocation";

// Error values on the wire. These happen to equal Linux errno values, but
// the protocol defines them independently.
pub const NBD_EPERM: u32 = 1;
pub const NBD_EIO: u32 = 5;
pub const NBD_ENOMEM: u32 = 12;
pub const NBD_EINVAL: u32 = 22;
pub const NBD_ENOSPC: u32 = 28;
pub const NBD_EOVERFLOW: u32 = 75;
pub const NBD_ENOTSUP: u32 = 95;
pub const NBD_ESHUTDOWN: u32 = 108;

/// Bytes of zero padding after the EXPORT_NAME reply unless NO_ZEROES was
/// agreed.
pub const EXPORT_NAME_PADDING_BYTES: usize = 124;

/// The longest string (export name, query, error message) the spec allows.
pub const MAX_STRING_BYTES: usize = 4096;

/// The largest payload every server must accept when it advertises no
/// maximum block size.
pub const DEFAULT_MAX_PAYLOAD_BYTES: u32 = 32 << 20;

/// The largest minimum block size a server may advertise (it must also be
/// a power of two).
pub const MAX_MIN_BLOCK_BYTES: u32 = 64 << 10;

/// Map a host errno to the NBD error the client sees. The spec only defines
/// a handful of values; anything else becomes EIO.
pub fn errno_to_nbd(errno: i32) -> u32 {
    match errno {
        libc::EPERM | libc::EROFS => NBD_EPERM,
        libc::EIO => NBD_EIO,
        libc::ENOMEM => NBD_ENOMEM,
        libc::EINVAL => NBD_EINVAL,
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => NBD_ENOSPC,
        libc::EOVERFLOW => NBD_EOVERFLOW,
        libc::ENOTSUP => NBD_ENOTSUP,
        libc::ESHUTDOWN => NBD_ESHUTDOWN,
        _ => NBD_EIO,
    }
}

/// Map an NBD error from the wire to the host errno a caller sees. The
/// defined values keep their meaning; the spec says to treat any other
/// value as EINVAL.
pub fn nbd_to_errno(error: u32) -> i32 {
    match error {
        NBD_EPERM => libc::EPERM,
        NBD_EIO => libc::EIO,
        NBD_ENOMEM => libc::ENOMEM,
        NBD_EINVAL => libc::EINVAL,
        NBD_ENOSPC => libc::ENOSPC,
        NBD_EOVERFLOW => libc::EOVERFLOW,
        NBD_ENOTSUP => libc::ENOTSUP,
        NBD_ESHUTDOWN => libc::ESHUTDOWN,
        _ => libc::EINVAL,
    }
}

/// A short name for a command, for logs.
pub fn command_name(command: u16) -> &'static str {
    match command {
        CMD_READ => "READ",
        CMD_WRITE => "WRITE",
        CMD_DISC => "DISC",
        CMD_FLUSH => "FLUSH",
        CMD_TRIM => "TRIM",
        CMD_CACHE => "CACHE",
        CMD_WRITE_ZEROES => "WRITE_ZEROES",
        CMD_BLOCK_STATUS => "BLOCK_STATUS",
        _ => "UNKNOWN",
    }
}

/// A short name for an option, for logs.
pub fn option_name(option: u32) -> &'static str {
    match option {
        OPT_EXPORT_NAME => "EXPORT_NAME",
        OPT_ABORT => "ABORT",
        OPT_LIST => "LIST",
        OPT_PEEK_EXPORT => "PEEK_EXPORT",
        OPT_STARTTLS => "STARTTLS",
        OPT_INFO => "INFO",
        OPT_GO => "GO",
        OPT_STRUCTURED_REPLY => "STRUCTURED_REPLY",
        OPT_LIST_META_CONTEXT => "LIST_META_CONTEXT",
        OPT_SET_META_CONTEXT => "SET_META_CONTEXT",
        OPT_EXTENDED_HEADERS => "EXTENDED_HEADERS",
        _ => "UNKNOWN",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nbd_errors_map_to_errno_and_back() {
        for error in [
            NBD_EPERM,
            NBD_EIO,
            NBD_ENOMEM,
            NBD_EINVAL,
            NBD_ENOSPC,
            NBD_EOVERFLOW,
            NBD_ENOTSUP,
            NBD_ESHUTDOWN,
        ] {
            assert_eq!(errno_to_nbd(nbd_to_errno(error)), error);
            // The wire values equal Linux errno values.
            #[cfg(target_os = "linux")]
            assert_eq!(nbd_to_errno(error), error as i32);
        }
        assert_eq!(nbd_to_errno(0xdead), libc::EINVAL);
        assert_eq!(nbd_to_errno(libc::EAGAIN as u32), libc::EINVAL);
    }
}
