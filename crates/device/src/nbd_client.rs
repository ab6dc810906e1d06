//! An NBD client device, so the origin can be a remote export.
//!
//! URIs: `nbd://host[:port]/export` (TCP, port 10809 by default) and
//! `nbd+unix:///export?socket=PATH`. TLS (`nbds://`) is not supported.
//!
//! Protocol: fixed-newstyle handshake with `NBD_OPT_GO` (asking for the
//! server's block-size constraints), falling back to `NBD_OPT_EXPORT_NAME`
//! when the server does not know GO. Transmission uses simple replies only;
//! structured replies are never negotiated, so a reply is a fixed 16-byte
//! header plus, for a successful read, exactly the bytes asked for.
//!
//! Concurrency: one connection, fully pipelined. Callers write their
//! requests straight to the socket (under a short writer lock) and a reader
//! thread matches each reply to its request by cookie. A batch call
//! (`read_many`, `write_many`, a long write split at the server's maximum
//! payload) sends everything before waiting, and requests from different
//! threads are in flight together, up to `max_in_flight` per connection. One
//! connection keeps ordering and FLUSH semantics simple (a FLUSH covers every
//! write already replied to, without the CAN_MULTI_CONN caveats); it is not
//! the bottleneck in front of a slow origin.
//!
//! Failure: every request has a deadline (`request_timeout_ms`). A request
//! that misses it fails with `TimedOut` and tears the connection down, since
//! a server that stopped answering one request is not trusted with the next.
//! When the connection is lost, the requests in flight fail (the engine
//! decides whether to retry) and the next request reconnects, retrying with
//! exponential backoff for up to `reconnect_wait_ms`; after that, requests
//! fail at once while the server stays down, with a reconnect attempt at
//! most every backoff period. Every such failure is a [`DeviceError::Io`]
//! (errno EIO for the client).

use std::collections::HashMap;
use std::ffi::OsString;
use std::fmt;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::io::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::{check_range, Device, DeviceError, DeviceResult};

// Handshake magic numbers and values (doc/proto.md of the NBD project).
const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
const IHAVEOPT: u64 = 0x4948_4156_454f_5054; // "IHAVEOPT"
const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;
const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
const FLAG_NO_ZEROES: u16 = 1 << 1;
const CLIENT_FLAG_FIXED_NEWSTYLE: u32 = 1 << 0;
const CLIENT_FLAG_NO_ZEROES: u32 = 1 << 1;
const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_BIT: u32 = 1 << 31;
const REP_ERR_UNSUP: u32 = REP_ERR_BIT + 1;
const INFO_EXPORT: u16 = 0;
const INFO_BLOCK_SIZE: u16 = 3;

// Transmission flags.
const TF_READ_ONLY: u16 = 1 << 1;
const TF_SEND_FLUSH: u16 = 1 << 2;
const TF_SEND_TRIM: u16 = 1 << 5;
const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
const TF_CAN_MULTI_CONN: u16 = 1 << 8;

// Transmission phase.
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_TRIM: u16 = 4;
const CMD_WRITE_ZEROES: u16 = 6;
const NBD_ESHUTDOWN: u32 = 108;

const DEFAULT_PORT: u16 = 10809;
/// The payload limit every server must accept when it advertises none.
const DEFAULT_MAX_PAYLOAD_BYTES: u32 = 32 << 20;
/// Option replies larger than this are a broken or hostile server.
const MAX_OPTION_REPLY_BYTES: u32 = 64 << 10;
/// TRIM and WRITE_ZEROES carry no payload but a 32-bit length: split at 1 GiB
/// (a multiple of every legal minimum block size).
const MAX_EFFECT_BYTES: u64 = 1 << 30;
/// Zero-filled payload used when the server cannot WRITE_ZEROES.
const ZERO_CHUNK_BYTES: usize = 1 << 20;
/// How long close and a timed-out request wait for the reader thread to
/// notice the socket was shut down.
const READER_EXIT_WAIT_MS: u64 = 2_000;

/// Tuning for [`NbdDevice`]. Every field is a bound, so nothing waits forever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NbdOptions {
    /// A request with no reply after this long fails (and the connection is
    /// torn down and re-established).
    pub request_timeout_ms: u64,
    /// Bound on connecting plus the handshake.
    pub connect_timeout_ms: u64,
    /// After the connection drops, requests wait this long for a reconnect
    /// before failing; later requests fail at once until the server is back.
    pub reconnect_wait_ms: u64,
    /// First delay between reconnect attempts; doubles after each failure.
    pub backoff_initial_ms: u64,
    /// Longest delay between reconnect attempts.
    pub backoff_max_ms: u64,
    /// Most requests in flight on the connection at once.
    pub max_in_flight: usize,
}

impl Default for NbdOptions {
    fn default() -> Self {
        NbdOptions {
            request_timeout_ms: 30_000,
            connect_timeout_ms: 10_000,
            reconnect_wait_ms: 5_000,
            backoff_initial_ms: 100,
            backoff_max_ms: 5_000,
            max_in_flight: 64,
        }
    }
}

/// Counters of one [`NbdDevice`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NbdStats {
    /// Requests sent (reads, writes, flushes, trims, zeroes).
    pub requests: u64,
    /// Successful connections after the first.
    pub reconnects: u64,
    /// Connections lost (server gone, protocol error or timeout).
    pub connection_losses: u64,
    /// Requests that got no reply in time.
    pub timeouts: u64,
    /// Most requests ever in flight at once.
    pub peak_in_flight: u64,
}

// ---------------------------------------------------------------------------
// URIs

/// Where the server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdTransport {
    Tcp { host: String, port: u16 },
    Unix { socket: PathBuf },
}

/// A parsed NBD URI. `Display` gives the normalized form (explicit port,
/// lowercase host, canonical percent-encoding), used as the device identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    pub transport: NbdTransport,
    pub export: String,
}

impl NbdUri {
    pub fn parse(uri: &str) -> Result<NbdUri, String> {
        let (scheme, rest) = uri
            .split_once("://")
            .ok_or_else(|| format!("{uri:?} is not a URI (expected nbd://host/export or nbd+unix:///export?socket=PATH)"))?;
        let scheme = scheme.to_ascii_lowercase();
        if scheme == "nbds" || scheme == "nbds+unix" {
            return Err(format!("{uri:?}: TLS ({scheme}://) is not supported"));
        }
        if scheme != "nbd" && scheme != "nbd+unix" {
            return Err(format!(
                "{uri:?}: unknown scheme {scheme:?}, expected nbd or nbd+unix"
            ));
        }
        let rest = rest.split_once('#').map_or(rest, |(before, _)| before);
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, path) = match rest.find('/') {
            Some(slash) => (&rest[..slash], &rest[slash..]),
            None => (rest, ""),
        };
        let export_bytes = percent_decode(path.strip_prefix('/').unwrap_or(path))
            .map_err(|e| format!("{uri:?}: export name: {e}"))?;
        let export = String::from_utf8(export_bytes)
            .map_err(|_| format!("{uri:?}: export name is not UTF-8"))?;
        if export.contains('\0') {
            return Err(format!("{uri:?}: export name contains NUL"));
        }
        let mut socket: Option<Vec<u8>> = None;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            if key == "socket" {
                socket = Some(percent_decode(value).map_err(|e| format!("{uri:?}: socket: {e}"))?);
            }
        }
        let transport = if scheme == "nbd+unix" {
            if !authority.is_empty() {
                return Err(format!(
                    "{uri:?}: nbd+unix URIs take no host (write nbd+unix:///export?socket=PATH)"
                ));
            }
            let socket = socket.ok_or_else(|| format!("{uri:?}: nbd+unix needs ?socket=PATH"))?;
            if socket.is_empty() {
                return Err(format!("{uri:?}: empty socket path"));
            }
            if socket[0] == 0 {
                return Err(format!("{uri:?}: abstract unix sockets are not supported"));
            }
            NbdTransport::Unix {
                socket: PathBuf::from(OsString::from_vec(socket)),
            }
        } else {
            // Userinfo only matters for TLS, which we do not do.
            let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
            let (host, port) = if let Some(bracketed) = host_port.strip_prefix('[') {
                let (host, after) = bracketed
                    .split_once(']')
                    .ok_or_else(|| format!("{uri:?}: unterminated [IPv6] host"))?;
                let port = match after.strip_prefix(':') {
                    Some(port) => Some(port),
                    None if after.is_empty() => None,
                    None => return Err(format!("{uri:?}: junk after ]")),
                };
                (host, port)
            } else {
                match host_port.rsplit_once(':') {
                    Some((host, port)) => (host, Some(port)),
                    None => (host_port, None),
                }
            };
            if host.is_empty() {
                return Err(format!("{uri:?}: nbd:// needs a host"));
            }
            let port = match port {
                None | Some("") => DEFAULT_PORT,
                Some(port) => port
                    .parse::<u16>()
                    .map_err(|_| format!("{uri:?}: bad port {port:?}"))?,
            };
            NbdTransport::Tcp {
                host: host.to_ascii_lowercase(),
                port,
            }
        };
        Ok(NbdUri { transport, export })
    }
}

impl fmt::Display for NbdUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let export = percent_encode(self.export.as_bytes(), b"/");
        match &self.transport {
            NbdTransport::Tcp { host, port } if host.contains(':') => {
                write!(f, "nbd://[{host}]:{port}/{export}")
            }
            NbdTransport::Tcp { host, port } => write!(f, "nbd://{host}:{port}/{export}"),
            NbdTransport::Unix { socket } => write!(
                f,
                "nbd+unix:///{export}?socket={}",
                percent_encode(socket.as_os_str().as_bytes(), b"/")
            ),
        }
    }
}

fn percent_decode(s: &str) -> Result<Vec<u8>, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent escape in {s:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(out)
}

fn percent_encode(bytes: &[u8], also_keep: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for &b in bytes {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) || also_keep.contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

// ---------------------------------------------------------------------------
// Sockets

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn connect(uri: &NbdUri, timeout: Duration) -> io::Result<Stream> {
        match &uri.transport {
            NbdTransport::Tcp { host, port } => {
                let mut last_error =
                    io::Error::new(io::ErrorKind::NotFound, format!("{host} has no address"));
                for addr in (host.as_str(), *port).to_socket_addrs()? {
                    match TcpStream::connect_timeout(&addr, timeout) {
                        Ok(stream) => {
                            // Requests are small and latency-bound: no Nagle.
                            stream.set_nodelay(true)?;
                            return Ok(Stream::Tcp(stream));
                        }
                        Err(err) => last_error = err,
                    }
                }
                Err(last_error)
            }
            NbdTransport::Unix { socket } => Ok(Stream::Unix(connect_unix(socket, timeout)?)),
        }
    }

    fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    fn shutdown(&self) {
        // Errors only mean it is already shut down or disconnected.
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }

    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
            Stream::Unix(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write_vectored(bufs),
            Stream::Unix(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Connect a unix socket without blocking past `timeout`: a blocking
/// connect waits forever on a server whose listen backlog is full (a hung
/// server), so connect non-blocking and retry on EAGAIN until the deadline.
fn connect_unix(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    let path_bytes = path.as_os_str().as_bytes();
    // SAFETY: an all-zero sockaddr_un is a valid value of this C struct.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if path_bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("socket path {} is too long", path.display()),
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, &src) in addr.sun_path.iter_mut().zip(path_bytes) {
        *dst = src as libc::c_char;
    }
    // SAFETY: socket(2) takes no memory; we own the returned descriptor.
    let raw = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let deadline = Instant::now() + timeout;
    let mut backoff_ms = 1u64;
    loop {
        // SAFETY: `addr` is a live, initialized sockaddr_un and the length
        // passed is its size.
        let rc = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                &addr as *const libc::sockaddr_un as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            break;
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EINTR) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(backoff_ms));
                backoff_ms = (backoff_ms * 2).min(50);
            }
            Some(libc::EAGAIN) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the server's listen queue stayed full",
                ))
            }
            _ => return Err(err),
        }
    }
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

// ---------------------------------------------------------------------------
// Handshake

/// What the handshake tells us about the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ExportInfo {
    size_bytes: u64,
    flags: u16,
    min_block_bytes: u32,
    max_payload_bytes: u32,
}

fn protocol_error(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

fn read_u16(r: &mut impl Read) -> io::Result<u16> {
    let mut b = [0u8; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

fn send_option(w: &mut impl Write, option: u32, data: &[u8]) -> io::Result<()> {
    let mut msg = Vec::with_capacity(16 + data.len());
    msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
    msg.extend_from_slice(&option.to_be_bytes());
    msg.extend_from_slice(&(data.len() as u32).to_be_bytes());
    msg.extend_from_slice(data);
    w.write_all(&msg)
}

fn option_error_name(reply: u32) -> &'static str {
    match reply.wrapping_sub(REP_ERR_BIT) {
        1 => "NBD_REP_ERR_UNSUP",
        2 => "NBD_REP_ERR_POLICY",
        3 => "NBD_REP_ERR_INVALID",
        4 => "NBD_REP_ERR_PLATFORM",
        5 => "NBD_REP_ERR_TLS_REQD (TLS is not supported by cairn)",
        6 => "NBD_REP_ERR_UNKNOWN (no such export)",
        7 => "NBD_REP_ERR_SHUTDOWN",
        8 => "NBD_REP_ERR_BLOCK_SIZE_REQD",
        9 => "NBD_REP_ERR_TOO_BIG",
        _ => "unknown option error",
    }
}

/// Run the client side of the handshake up to the transmission phase.
fn handshake(stream: &mut Stream, export: &str) -> io::Result<ExportInfo> {
    if export.len() > 4096 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "export name longer than 4096 bytes",
        ));
    }
    let magic = read_u64(stream)?;
    if magic != NBD_MAGIC {
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
    let mut client_flags = 0u32;
    if fixed {
        client_flags |= CLIENT_FLAG_FIXED_NEWSTYLE;
    }
    if no_zeroes {
        client_flags |= CLIENT_FLAG_NO_ZEROES;
    }
    stream.write_all(&client_flags.to_be_bytes())?;
    if fixed {
        if let Some(info) = option_go(stream, export)? {
            return Ok(info);
        }
        tracing::debug!("server does not know NBD_OPT_GO; using NBD_OPT_EXPORT_NAME");
    }
    option_export_name(stream, export, no_zeroes)
}

/// NBD_OPT_GO; `None` when the server does not support it.
fn option_go(stream: &mut Stream, export: &str) -> io::Result<Option<ExportInfo>> {
    let mut data = Vec::with_capacity(export.len() + 8);
    data.extend_from_slice(&(export.len() as u32).to_be_bytes());
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    send_option(stream, OPT_GO, &data)?;
    let mut size_and_flags: Option<(u64, u16)> = None;
    let mut block_sizes: Option<(u32, u32, u32)> = None;
    // Bounded: a server sends a handful of NBD_REP_INFO before its final reply.
    for _ in 0..64 {
        let magic = read_u64(stream)?;
        if magic != OPTION_REPLY_MAGIC {
            return Err(protocol_error(format!("bad option reply magic {magic:#x}")));
        }
        let option = read_u32(stream)?;
        let reply = read_u32(stream)?;
        let len = read_u32(stream)?;
        if option != OPT_GO {
            return Err(protocol_error(format!(
                "reply to option {option}, expected NBD_OPT_GO"
            )));
        }
        if len > MAX_OPTION_REPLY_BYTES {
            return Err(protocol_error(format!("option reply of {len} bytes")));
        }
        let mut payload = vec![0u8; len as usize];
        stream.read_exact(&mut payload)?;
        match reply {
            REP_ACK => {
                let (size_bytes, flags) = size_and_flags.ok_or_else(|| {
                    protocol_error("NBD_OPT_GO succeeded without NBD_INFO_EXPORT".into())
                })?;
                return Ok(Some(export_info(size_bytes, flags, block_sizes)?));
            }
            REP_INFO if payload.len() >= 2 => match u16::from_be_bytes([payload[0], payload[1]]) {
                INFO_EXPORT if payload.len() >= 12 => {
                    let size = u64::from_be_bytes(
                        payload[2..10]
                            .try_into()
                            .map_err(|_| protocol_error("short info".into()))?,
                    );
                    let flags = u16::from_be_bytes([payload[10], payload[11]]);
                    size_and_flags = Some((size, flags));
                }
                INFO_BLOCK_SIZE if payload.len() >= 14 => {
                    let field = |at: usize| {
                        u32::from_be_bytes([
                            payload[at],
                            payload[at + 1],
                            payload[at + 2],
                            payload[at + 3],
                        ])
                    };
                    block_sizes = Some((field(2), field(6), field(10)));
                }
                // Information we did not ask for or do not know: ignore.
                _ => {}
            },
            REP_ERR_UNSUP => return Ok(None),
            reply if reply & REP_ERR_BIT != 0 => {
                // A soft disconnect, as the protocol asks; the error matters more.
                let _ = send_option(stream, OPT_ABORT, &[]);
                let message = String::from_utf8_lossy(&payload);
                return Err(io::Error::other(format!(
                    "the server refused export {export:?}: {}{}{}",
                    option_error_name(reply),
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
) -> io::Result<ExportInfo> {
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
        let mut zeroes = [0u8; 124];
        stream.read_exact(&mut zeroes)?;
    }
    export_info(size_bytes, flags, None)
}

fn export_info(
    size_bytes: u64,
    flags: u16,
    block_sizes: Option<(u32, u32, u32)>,
) -> io::Result<ExportInfo> {
    let (min_block_bytes, max_payload_bytes) = match block_sizes {
        Some((min, _preferred, max)) => {
            if !min.is_power_of_two() || min > 65536 || max < min {
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
    Ok(ExportInfo {
        size_bytes,
        flags,
        min_block_bytes,
        max_payload_bytes,
    })
}

// ---------------------------------------------------------------------------
// One connection: a writer side shared by callers, a reader thread

/// The replies of one caller's batch of requests.
struct Batch {
    state: Mutex<BatchState>,
    done: Condvar,
}

struct BatchState {
    /// `Some(Ok(data))` once a request completed (data for reads).
    results: Vec<Option<io::Result<Option<Vec<u8>>>>>,
    registered: usize,
    completed: usize,
}

impl Batch {
    fn new(count: usize) -> Batch {
        Batch {
            state: Mutex::new(BatchState {
                results: (0..count).map(|_| None).collect(),
                registered: 0,
                completed: 0,
            }),
            done: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BatchState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn complete(&self, index: usize, result: io::Result<Option<Vec<u8>>>) {
        let mut state = self.lock();
        if let Some(slot) = state.results.get_mut(index) {
            if slot.is_none() {
                *slot = Some(result);
                state.completed += 1;
                if state.completed == state.registered {
                    self.done.notify_all();
                }
            }
        }
    }
}

struct Pending {
    batch: Arc<Batch>,
    index: usize,
    /// Bytes of data that follow a successful reply (reads only).
    read_len: usize,
}

struct ConnState {
    /// Why the connection is unusable; `None` while it works.
    dead: Option<String>,
    pending: HashMap<u64, Pending>,
    in_flight: usize,
}

struct ConnShared {
    state: Mutex<ConnState>,
    /// Signalled when a request leaves flight or the connection dies.
    window: Condvar,
}

impl ConnShared {
    fn lock(&self) -> MutexGuard<'_, ConnState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

struct Conn {
    writer: Mutex<Stream>,
    /// A handle used only to shut the socket down, which wakes the reader.
    control: Stream,
    shared: Arc<ConnShared>,
    reader: Mutex<Option<JoinHandle<()>>>,
    info: ExportInfo,
}

impl Conn {
    fn is_alive(&self) -> bool {
        self.shared.lock().dead.is_none()
    }

    /// Mark the connection dead and wake everyone; the reader thread then
    /// fails whatever is still in flight.
    fn kill(&self, reason: String) {
        {
            let mut state = self.shared.lock();
            if state.dead.is_none() {
                state.dead = Some(reason);
            }
        }
        self.shared.window.notify_all();
        self.control.shutdown();
    }

    /// Soft disconnect (NBD_CMD_DISC), then stop the reader thread.
    fn close(&self) {
        if self.is_alive() {
            let header = request_header(0, CMD_DISC, 0, 0, 0);
            let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
            // Best effort: the server may already be gone.
            let _ = writer.write_all(&header);
        }
        self.kill("closed".into());
        let handle = self
            .reader
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(handle) = handle {
            // The shutdown above makes the reader's read return at once.
            let _ = handle.join();
        }
    }
}

fn request_header(flags: u16, command: u16, cookie: u64, offset: u64, len: u32) -> [u8; 28] {
    let mut h = [0u8; 28];
    h[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    h[4..6].copy_from_slice(&flags.to_be_bytes());
    h[6..8].copy_from_slice(&command.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    h[16..24].copy_from_slice(&offset.to_be_bytes());
    h[24..28].copy_from_slice(&len.to_be_bytes());
    h
}

/// Write the header and payload with as few syscalls as the socket allows.
fn write_request(w: &mut impl Write, header: &[u8], payload: &[&[u8]]) -> io::Result<()> {
    let mut parts: Vec<&[u8]> = Vec::with_capacity(payload.len() + 1);
    parts.push(header);
    parts.extend(payload.iter().copied().filter(|p| !p.is_empty()));
    let mut first = 0;
    while first < parts.len() {
        let slices: Vec<IoSlice<'_>> = parts[first..].iter().map(|p| IoSlice::new(p)).collect();
        let mut written = match w.write_vectored(&slices) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "socket accepted no bytes",
                ))
            }
            Ok(n) => n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        };
        while first < parts.len() && written >= parts[first].len() {
            written -= parts[first].len();
            first += 1;
        }
        if written > 0 {
            parts[first] = &parts[first][written..];
        }
    }
    Ok(())
}

fn nbd_error(error: u32) -> io::Error {
    let errno = match error {
        1 | 5 | 12 | 22 | 28 | 75 | 95 | 108 => error as i32,
        // The protocol says to treat an unknown error as EINVAL.
        _ => libc::EINVAL,
    };
    // Kept as a raw OS error so callers can tell ENOSPC from EIO.
    io::Error::from_raw_os_error(errno)
}

fn reader_loop(mut stream: Stream, shared: Arc<ConnShared>) {
    let reason = loop {
        let mut header = [0u8; 16];
        if let Err(err) = stream.read_exact(&mut header) {
            break format!("connection lost: {err}");
        }
        let magic = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
        if magic != SIMPLE_REPLY_MAGIC {
            break if magic == STRUCTURED_REPLY_MAGIC {
                "protocol error: structured reply that was never negotiated".to_string()
            } else {
                format!("protocol error: bad reply magic {magic:#x}")
            };
        }
        let error = u32::from_be_bytes([header[4], header[5], header[6], header[7]]);
        let mut cookie_bytes = [0u8; 8];
        cookie_bytes.copy_from_slice(&header[8..16]);
        let cookie = u64::from_be_bytes(cookie_bytes);
        let pending = {
            let mut state = shared.lock();
            let pending = state.pending.remove(&cookie);
            if pending.is_some() {
                state.in_flight -= 1;
            }
            pending
        };
        shared.window.notify_one();
        let Some(pending) = pending else {
            // We cannot know how much data would follow: the stream is lost.
            break format!("protocol error: reply for unknown cookie {cookie}");
        };
        if error != 0 {
            pending.batch.complete(pending.index, Err(nbd_error(error)));
            if error == NBD_ESHUTDOWN {
                break "the server is shutting down".to_string();
            }
            continue;
        }
        if pending.read_len == 0 {
            pending.batch.complete(pending.index, Ok(None));
            continue;
        }
        let mut data = vec![0u8; pending.read_len];
        match stream.read_exact(&mut data) {
            Ok(()) => pending.batch.complete(pending.index, Ok(Some(data))),
            Err(err) => {
                let reason = format!("connection lost during a read reply: {err}");
                pending.batch.complete(
                    pending.index,
                    Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        reason.clone(),
                    )),
                );
                break reason;
            }
        }
    };
    let orphans: Vec<Pending> = {
        let mut state = shared.lock();
        let reason = state.dead.get_or_insert(reason).clone();
        tracing::debug!("nbd connection closed: {reason}");
        state.in_flight = 0;
        state.pending.drain().map(|(_, p)| p).collect()
    };
    shared.window.notify_all();
    let reason = shared.lock().dead.clone().unwrap_or_default();
    for pending in orphans {
        pending.batch.complete(
            pending.index,
            Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                reason.clone(),
            )),
        );
    }
    stream.shutdown();
}

// ---------------------------------------------------------------------------
// The device

struct Link {
    conn: Option<Arc<Conn>>,
    /// When the connection was lost; `None` while connected.
    down_since: Option<Instant>,
    next_attempt: Instant,
    backoff_ms: u64,
    last_error: String,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    reconnects: AtomicU64,
    connection_losses: AtomicU64,
    timeouts: AtomicU64,
    peak_in_flight: AtomicU64,
}

/// Attempts at one batch when the connection breaks before any of it left.
const MAX_BATCH_ATTEMPTS: u32 = 3;

/// How one attempt at a batch failed.
enum Attempt {
    /// Nothing of the batch reached the server; it may be resent.
    NotSent(DeviceError),
    Failed(DeviceError),
}

struct SendError {
    error: io::Error,
    /// The request never fully left and the connection is dead.
    retryable: bool,
}

fn first_offset(commands: &[Command<'_>]) -> u64 {
    commands.first().map_or(0, |c| c.offset)
}

fn first_len(commands: &[Command<'_>]) -> u64 {
    commands.first().map_or(0, |c| c.len as u64)
}

/// One request of a batch.
struct Command<'a> {
    command: u16,
    offset: u64,
    len: u32,
    payload: Vec<&'a [u8]>,
}

/// A remote export served by an NBD server (see the module documentation).
pub struct NbdDevice {
    uri: NbdUri,
    name: String,
    size_bytes: u64,
    info: ExportInfo,
    options: NbdOptions,
    link: Mutex<Link>,
    next_cookie: AtomicU64,
    counters: Arc<Counters>,
    zeroes: Vec<u8>,
}

impl NbdDevice {
    /// Connect to `uri` with default options. Fails with a clear error
    /// naming the URI if the server is unreachable or refuses the export.
    pub fn open(uri: &str) -> DeviceResult<NbdDevice> {
        Self::open_with(uri, NbdOptions::default())
    }

    pub fn open_with(uri: &str, options: NbdOptions) -> DeviceResult<NbdDevice> {
        let parsed = NbdUri::parse(uri).map_err(|message| DeviceError::Open {
            device: uri.to_string(),
            source: io::Error::new(io::ErrorKind::InvalidInput, message),
        })?;
        let name = parsed.to_string();
        let counters = Arc::new(Counters::default());
        let conn = connect(&parsed, &options, None).map_err(|err| DeviceError::Open {
            device: name.clone(),
            source: io::Error::new(
                err.kind(),
                format!("cannot connect to the NBD server at {name}: {err}"),
            ),
        })?;
        let info = conn.info;
        if info.flags & TF_SEND_FLUSH == 0 {
            tracing::debug!(device = %name, "the server does not take FLUSH; flush is a no-op");
        }
        if info.flags & TF_READ_ONLY != 0 {
            tracing::warn!(device = %name, "the export is read-only; writes will fail");
        }
        tracing::debug!(
            device = %name,
            size_bytes = info.size_bytes,
            flags = info.flags,
            min_block_bytes = info.min_block_bytes,
            max_payload_bytes = info.max_payload_bytes,
            multi_conn = info.flags & TF_CAN_MULTI_CONN != 0,
            "connected"
        );
        Ok(NbdDevice {
            uri: parsed,
            name,
            size_bytes: info.size_bytes,
            info,
            link: Mutex::new(Link {
                conn: Some(conn),
                down_since: None,
                next_attempt: Instant::now(),
                backoff_ms: options.backoff_initial_ms.max(1),
                last_error: String::new(),
            }),
            options,
            next_cookie: AtomicU64::new(1),
            counters,
            zeroes: vec![0u8; ZERO_CHUNK_BYTES.min(info.max_payload_bytes as usize)],
        })
    }

    /// The parsed URI.
    pub fn uri(&self) -> &NbdUri {
        &self.uri
    }

    pub fn stats(&self) -> NbdStats {
        let c = &self.counters;
        NbdStats {
            requests: c.requests.load(Ordering::Relaxed),
            reconnects: c.reconnects.load(Ordering::Relaxed),
            connection_losses: c.connection_losses.load(Ordering::Relaxed),
            timeouts: c.timeouts.load(Ordering::Relaxed),
            peak_in_flight: c.peak_in_flight.load(Ordering::Relaxed),
        }
    }

    /// Whether the server advertised the export as read-only.
    pub fn is_read_only(&self) -> bool {
        self.info.flags & TF_READ_ONLY != 0
    }

    fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.options.request_timeout_ms)
    }

    fn lock_link(&self) -> MutexGuard<'_, Link> {
        self.link.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A live connection, reconnecting with backoff if needed (see the
    /// module documentation for how long this waits).
    fn connection(&self) -> io::Result<Arc<Conn>> {
        let start = Instant::now();
        loop {
            let sleep_for = {
                let mut link = self.lock_link();
                if let Some(conn) = link.conn.clone() {
                    if conn.is_alive() {
                        return Ok(conn);
                    }
                    let reason = conn.shared.lock().dead.clone().unwrap_or_default();
                    tracing::warn!(device = %self.name, "NBD connection lost ({reason}); reconnecting");
                    self.counters
                        .connection_losses
                        .fetch_add(1, Ordering::Relaxed);
                    link.conn = None;
                    link.last_error = reason;
                    conn.close();
                }
                let now = Instant::now();
                let down_since = *link.down_since.get_or_insert(now);
                if now >= link.next_attempt {
                    match connect(&self.uri, &self.options, Some(self.size_bytes)) {
                        Ok(conn) => {
                            tracing::info!(
                                device = %self.name,
                                down_ms = now.duration_since(down_since).as_millis() as u64,
                                "NBD connection re-established"
                            );
                            self.counters.reconnects.fetch_add(1, Ordering::Relaxed);
                            link.conn = Some(Arc::clone(&conn));
                            link.down_since = None;
                            link.backoff_ms = self.options.backoff_initial_ms.max(1);
                            return Ok(conn);
                        }
                        Err(err) => {
                            let now = Instant::now();
                            link.last_error = err.to_string();
                            link.next_attempt = now + Duration::from_millis(link.backoff_ms);
                            link.backoff_ms =
                                (link.backoff_ms * 2).min(self.options.backoff_max_ms.max(1));
                        }
                    }
                }
                let give_up_at = (down_since
                    + Duration::from_millis(self.options.reconnect_wait_ms))
                .min(start + self.request_timeout());
                if link.next_attempt > give_up_at {
                    return Err(io::Error::new(
                        io::ErrorKind::NotConnected,
                        format!("the NBD server is unreachable: {}", link.last_error),
                    ));
                }
                link.next_attempt.saturating_duration_since(Instant::now())
            };
            std::thread::sleep(sleep_for);
        }
    }

    fn io_error(&self, offset: u64, len: u64, source: io::Error) -> DeviceError {
        DeviceError::Io {
            device: self.name.clone(),
            offset,
            len,
            source,
        }
    }

    fn check_aligned(&self, op: &'static str, offset: u64, len: u64) -> DeviceResult<()> {
        let min = self.info.min_block_bytes as u64;
        if offset.is_multiple_of(min) && len.is_multiple_of(min) {
            return Ok(());
        }
        Err(DeviceError::Unsupported {
            device: self.name.clone(),
            message: format!(
                "{op} at offset {offset} length {len} is not aligned to the server's minimum block size of {min} bytes"
            ),
        })
    }

    fn check_writable(&self) -> DeviceResult<()> {
        if self.is_read_only() {
            return Err(DeviceError::Unsupported {
                device: self.name.clone(),
                message: "the export is read-only".into(),
            });
        }
        Ok(())
    }

    /// Send every command, then wait for every reply. Returns the data of
    /// each read, or the first error.
    fn execute(&self, commands: &[Command<'_>]) -> DeviceResult<Vec<Option<Vec<u8>>>> {
        if commands.is_empty() {
            return Ok(Vec::new());
        }
        let first = &commands[0];
        let mut attempt = 1;
        loop {
            let conn = self
                .connection()
                .map_err(|err| self.io_error(first.offset, first.len as u64, err))?;
            match self.execute_on(&conn, commands) {
                Ok(results) => return Ok(results),
                // The connection died before the first request fully left:
                // the server cannot have run any of the batch, so resending it
                // on a new connection is safe. (A request that was sent and
                // then lost is ambiguous and fails; the engine decides.)
                Err(Attempt::NotSent(err)) if attempt < MAX_BATCH_ATTEMPTS => {
                    tracing::debug!(device = %self.name, "resending a batch that never reached the server: {err}");
                    attempt += 1;
                }
                Err(Attempt::NotSent(err) | Attempt::Failed(err)) => return Err(err),
            }
        }
    }

    fn execute_on(
        &self,
        conn: &Conn,
        commands: &[Command<'_>],
    ) -> Result<Vec<Option<Vec<u8>>>, Attempt> {
        let batch = Arc::new(Batch::new(commands.len()));
        let mut sent_at: Vec<Instant> = Vec::with_capacity(commands.len());
        let mut send_error: Option<(usize, SendError)> = None;
        for (index, command) in commands.iter().enumerate() {
            if let Err(err) = self.send(conn, &batch, index, command) {
                send_error = Some((index, err));
                break;
            }
            sent_at.push(Instant::now());
        }
        self.wait(conn, &batch, &sent_at);
        if let Some((
            0,
            SendError {
                error,
                retryable: true,
            },
        )) = send_error
        {
            return Err(Attempt::NotSent(self.io_error(
                first_offset(commands),
                first_len(commands),
                error,
            )));
        }
        let mut state = batch.lock();
        let mut results = Vec::with_capacity(commands.len());
        let mut first_error: Option<DeviceError> = None;
        for (index, slot) in state.results.iter_mut().enumerate() {
            match slot.take() {
                Some(Ok(data)) => results.push(data),
                Some(Err(err)) => {
                    let command = &commands[index];
                    first_error.get_or_insert_with(|| {
                        self.io_error(command.offset, command.len as u64, err)
                    });
                    results.push(None);
                }
                None => results.push(None),
            }
        }
        if let Some(err) = first_error {
            return Err(Attempt::Failed(err));
        }
        if let Some((index, err)) = send_error {
            let command = &commands[index];
            return Err(Attempt::Failed(self.io_error(
                command.offset,
                command.len as u64,
                err.error,
            )));
        }
        Ok(results)
    }

    /// Register one command as pending and write it to the socket.
    fn send(
        &self,
        conn: &Conn,
        batch: &Arc<Batch>,
        index: usize,
        command: &Command<'_>,
    ) -> Result<(), SendError> {
        let cookie = self.next_cookie.fetch_add(1, Ordering::Relaxed);
        let deadline = Instant::now() + self.request_timeout();
        {
            let mut state = conn.shared.lock();
            loop {
                if let Some(reason) = &state.dead {
                    return Err(SendError {
                        error: io::Error::new(io::ErrorKind::ConnectionAborted, reason.clone()),
                        retryable: true,
                    });
                }
                if state.in_flight < self.options.max_in_flight.max(1) {
                    break;
                }
                let now = Instant::now();
                if now >= deadline {
                    drop(state);
                    self.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                    let message = format!(
                        "no request slot freed within {} ms",
                        self.options.request_timeout_ms
                    );
                    conn.kill(message.clone());
                    return Err(SendError {
                        error: io::Error::new(io::ErrorKind::TimedOut, message),
                        retryable: false,
                    });
                }
                state = conn
                    .shared
                    .window
                    .wait_timeout(state, deadline - now)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            state.in_flight += 1;
            self.counters
                .peak_in_flight
                .fetch_max(state.in_flight as u64, Ordering::Relaxed);
            batch.lock().registered += 1;
            let read_len = if command.command == CMD_READ {
                command.len as usize
            } else {
                0
            };
            state.pending.insert(
                cookie,
                Pending {
                    batch: Arc::clone(batch),
                    index,
                    read_len,
                },
            );
        }
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let header = request_header(0, command.command, cookie, command.offset, command.len);
        let mut writer = conn.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(err) = write_request(&mut *writer, &header, &command.payload) {
            drop(writer);
            // Part of a request may be on the wire: the stream is unusable.
            // The reader fails this request (and the others in flight).
            conn.kill(format!("sending a request failed: {err}"));
            // A send timeout means the server stopped reading: not worth
            // resending. A broken connection is.
            let retryable = !matches!(
                err.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            );
            return Err(SendError {
                error: err,
                retryable,
            });
        }
        Ok(())
    }

    /// Wait until every registered request of `batch` completed, or the
    /// oldest incomplete one passed its deadline (which kills the
    /// connection and fails the rest).
    fn wait(&self, conn: &Conn, batch: &Batch, sent_at: &[Instant]) {
        let timeout = self.request_timeout();
        let mut state = batch.lock();
        let mut oldest = 0usize;
        while state.completed < state.registered {
            while oldest < sent_at.len() && state.results[oldest].is_some() {
                oldest += 1;
            }
            // Registered but never fully sent: its send failed and killed the
            // connection, so the reader completes it soon.
            let deadline = sent_at.get(oldest).map_or_else(Instant::now, |sent| *sent) + timeout;
            let now = Instant::now();
            if now >= deadline {
                drop(state);
                self.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                conn.kill(format!(
                    "no reply within {} ms",
                    self.options.request_timeout_ms
                ));
                self.wait_for_drain(batch);
                return;
            }
            state = batch
                .done
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// After a timeout killed the connection, the reader fails what is left;
    /// mark what it has not reached yet as timed out ourselves.
    fn wait_for_drain(&self, batch: &Batch) {
        let deadline = Instant::now() + Duration::from_millis(READER_EXIT_WAIT_MS);
        let mut state = batch.lock();
        while state.completed < state.registered {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            state = batch
                .done
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        let message = format!("no reply within {} ms", self.options.request_timeout_ms);
        for slot in state.results.iter_mut() {
            match slot {
                // Replaced so the caller sees the timeout, not the abort it caused.
                Some(Err(err)) if err.kind() == io::ErrorKind::ConnectionAborted => {
                    *slot = Some(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        message.clone(),
                    )));
                }
                None => {
                    *slot = Some(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        message.clone(),
                    )))
                }
                _ => {}
            }
        }
    }

    /// Split `[offset, offset + len)` at the server's payload limit.
    fn chunks(&self, offset: u64, len: u64, limit: u64) -> impl Iterator<Item = (u64, u64)> {
        let end = offset + len;
        let mut at = offset;
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let n = (end - at).min(limit);
            let chunk = (at, n);
            at += n;
            Some(chunk)
        })
    }

    fn write_commands<'a>(&self, offset: u64, bufs: &[&'a [u8]], commands: &mut Vec<Command<'a>>) {
        let limit = self.info.max_payload_bytes as usize;
        let mut current: Vec<&'a [u8]> = Vec::new();
        let mut current_len = 0usize;
        let mut at = offset;
        for buf in bufs {
            let mut rest: &'a [u8] = buf;
            while !rest.is_empty() {
                let n = (limit - current_len).min(rest.len());
                current.push(&rest[..n]);
                current_len += n;
                rest = &rest[n..];
                if current_len == limit {
                    commands.push(Command {
                        command: CMD_WRITE,
                        offset: at,
                        len: current_len as u32,
                        payload: std::mem::take(&mut current),
                    });
                    at += current_len as u64;
                    current_len = 0;
                }
            }
        }
        if current_len > 0 {
            commands.push(Command {
                command: CMD_WRITE,
                offset: at,
                len: current_len as u32,
                payload: current,
            });
        }
    }

    fn flags(&self) -> u16 {
        self.info.flags
    }
}

/// Connect and handshake; check the export still has the size we opened.
fn connect(
    uri: &NbdUri,
    options: &NbdOptions,
    expect_size_bytes: Option<u64>,
) -> io::Result<Arc<Conn>> {
    let connect_timeout = Duration::from_millis(options.connect_timeout_ms.max(1));
    let mut stream = Stream::connect(uri, connect_timeout)?;
    stream.set_timeouts(Some(connect_timeout), Some(connect_timeout))?;
    let info = handshake(&mut stream, &uri.export)?;
    if let Some(expected) = expect_size_bytes {
        if info.size_bytes != expected {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the export's size changed from {expected} to {} bytes",
                    info.size_bytes
                ),
            ));
        }
    }
    // The reader blocks until a reply comes (callers time out on their own);
    // a send must not block forever on a server that stopped reading.
    stream.set_timeouts(
        None,
        Some(Duration::from_millis(options.request_timeout_ms.max(1))),
    )?;
    let reader_stream = stream.try_clone()?;
    let control = stream.try_clone()?;
    let shared = Arc::new(ConnShared {
        state: Mutex::new(ConnState {
            dead: None,
            pending: HashMap::new(),
            in_flight: 0,
        }),
        window: Condvar::new(),
    });
    let reader_shared = Arc::clone(&shared);
    let reader = std::thread::Builder::new()
        .name("cairn-nbd-rx".into())
        .spawn(move || reader_loop(reader_stream, reader_shared))?;
    Ok(Arc::new(Conn {
        writer: Mutex::new(stream),
        control,
        shared,
        reader: Mutex::new(Some(reader)),
        info,
    }))
}

impl Drop for NbdDevice {
    fn drop(&mut self) {
        if let Some(conn) = self.lock_link().conn.take() {
            conn.close();
        }
    }
}

impl Device for NbdDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn backend(&self) -> &'static str {
        "nbd"
    }

    fn identity(&self) -> String {
        self.name.clone()
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn alignment_bytes(&self) -> u32 {
        self.info.min_block_bytes.max(512)
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> DeviceResult<()> {
        self.read_many(&mut [(offset, buf)])
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> DeviceResult<()> {
        self.write_vectored_at(offset, &[buf])
    }

    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        self.write_many_vectored(&[(offset, bufs)])
    }

    fn read_many(&self, requests: &mut [(u64, &mut [u8])]) -> DeviceResult<()> {
        let limit = self.info.max_payload_bytes as u64;
        let mut commands = Vec::new();
        for (offset, buf) in requests.iter() {
            check_range(
                &self.name,
                "read",
                *offset,
                buf.len() as u64,
                self.size_bytes,
            )?;
            self.check_aligned("read", *offset, buf.len() as u64)?;
            for (at, n) in self.chunks(*offset, buf.len() as u64, limit) {
                commands.push(Command {
                    command: CMD_READ,
                    offset: at,
                    len: n as u32,
                    payload: Vec::new(),
                });
            }
        }
        let results = self.execute(&commands)?;
        let mut replies = results.into_iter();
        for (_, buf) in requests.iter_mut() {
            let mut filled = 0usize;
            while filled < buf.len() {
                let data = replies.next().flatten().ok_or_else(|| {
                    self.io_error(
                        0,
                        buf.len() as u64,
                        io::Error::new(io::ErrorKind::InvalidData, "missing read reply"),
                    )
                })?;
                buf[filled..filled + data.len()].copy_from_slice(&data);
                filled += data.len();
            }
        }
        Ok(())
    }

    fn write_many(&self, requests: &[(u64, &[u8])]) -> DeviceResult<()> {
        let runs: Vec<[&[u8]; 1]> = requests.iter().map(|(_, buf)| [*buf]).collect();
        let requests: Vec<(u64, &[&[u8]])> = requests
            .iter()
            .zip(&runs)
            .map(|((offset, _), run)| (*offset, run.as_slice()))
            .collect();
        self.write_many_vectored(&requests)
    }

    /// Every run pipelined on the connection, each sent from the caller's
    /// buffers (one command per run, split at the export's payload limit).
    fn write_many_vectored(&self, requests: &[(u64, &[&[u8]])]) -> DeviceResult<()> {
        for (offset, bufs) in requests {
            let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
            check_range(&self.name, "write", *offset, total, self.size_bytes)?;
            self.check_aligned("write", *offset, total)?;
        }
        if !requests.is_empty() {
            self.check_writable()?;
        }
        let mut commands = Vec::new();
        for (offset, bufs) in requests {
            self.write_commands(*offset, bufs, &mut commands);
        }
        self.execute(&commands).map(drop)
    }

    fn flush(&self) -> DeviceResult<()> {
        // FLUSH covers every write already replied to, and every write call
        // returns only after its replies: nothing else to wait for.
        if self.flags() & TF_SEND_FLUSH == 0 {
            return Ok(());
        }
        self.execute(&[Command {
            command: CMD_FLUSH,
            offset: 0,
            len: 0,
            payload: Vec::new(),
        }])
        .map(drop)
    }

    fn discard(&self, offset: u64, len: u64) -> DeviceResult<()> {
        check_range(&self.name, "discard", offset, len, self.size_bytes)?;
        self.check_aligned("discard", offset, len)?;
        if len == 0 || self.flags() & TF_SEND_TRIM == 0 || self.is_read_only() {
            // Discard is a hint.
            return Ok(());
        }
        let commands: Vec<Command<'_>> = self
            .chunks(offset, len, MAX_EFFECT_BYTES)
            .map(|(at, n)| Command {
                command: CMD_TRIM,
                offset: at,
                len: n as u32,
                payload: Vec::new(),
            })
            .collect();
        self.execute(&commands).map(drop)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> DeviceResult<()> {
        check_range(&self.name, "write_zeroes", offset, len, self.size_bytes)?;
        self.check_aligned("write_zeroes", offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.check_writable()?;
        let commands: Vec<Command<'_>> = if self.flags() & TF_SEND_WRITE_ZEROES != 0 {
            self.chunks(offset, len, MAX_EFFECT_BYTES)
                .map(|(at, n)| Command {
                    command: CMD_WRITE_ZEROES,
                    offset: at,
                    len: n as u32,
                    payload: Vec::new(),
                })
                .collect()
        } else {
            self.chunks(offset, len, self.zeroes.len() as u64)
                .map(|(at, n)| Command {
                    command: CMD_WRITE,
                    offset: at,
                    len: n as u32,
                    payload: vec![&self.zeroes[..n as usize]],
                })
                .collect()
        };
        self.execute(&commands).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn parse_tcp_uris() {
        let uri = NbdUri::parse("nbd://Example.COM/disk").unwrap();
        assert_eq!(
            uri.transport,
            NbdTransport::Tcp {
                host: "example.com".into(),
                port: 10809
            }
        );
        assert_eq!(uri.export, "disk");
        assert_eq!(uri.to_string(), "nbd://example.com:10809/disk");

        let uri = NbdUri::parse("nbd://127.0.0.1:1234").unwrap();
        assert_eq!(uri.export, "");
        assert_eq!(uri.to_string(), "nbd://127.0.0.1:1234/");

        let uri = NbdUri::parse("nbd://[::1]:99//abs%20name").unwrap();
        assert_eq!(
            uri.transport,
            NbdTransport::Tcp {
                host: "::1".into(),
                port: 99
            }
        );
        assert_eq!(uri.export, "/abs name");
        assert_eq!(uri.to_string(), "nbd://[::1]:99//abs%20name");
        // The normalized form parses back to the same URI.
        assert_eq!(NbdUri::parse(&uri.to_string()).unwrap(), uri);
    }

    #[test]
    fn parse_unix_uris() {
        let uri = NbdUri::parse("nbd+unix:///exp?socket=/run/nbd%20x.sock").unwrap();
        assert_eq!(
            uri.transport,
            NbdTransport::Unix {
                socket: PathBuf::from("/run/nbd x.sock")
            }
        );
        assert_eq!(uri.export, "exp");
        assert_eq!(uri.to_string(), "nbd+unix:///exp?socket=/run/nbd%20x.sock");
        assert_eq!(NbdUri::parse(&uri.to_string()).unwrap(), uri);
        let uri = NbdUri::parse("nbd+unix://?socket=s.sock").unwrap();
        assert_eq!(uri.export, "");
    }

    #[test]
    fn reject_bad_uris() {
        for bad in [
            "/dev/sda",
            "http://host/x",
            "nbds://host/x",
            "nbd+unix:///x",
            "nbd+unix://host/x?socket=/s",
            "nbd://host:notaport/x",
            "nbd://host:70000/x",
            "nbd:///x",
            "nbd://[::1/x",
            "nbd://host/%zz",
            "nbd+unix:///?socket=%00abstract",
        ] {
            assert!(NbdUri::parse(bad).is_err(), "{bad} should be refused");
        }
    }

    /// A scripted server for handshake paths nbdkit cannot show us.
    fn fake_server(
        script: impl FnOnce(&mut UnixStream) + Send + 'static,
    ) -> (PathBuf, std::thread::JoinHandle<()>) {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "cairn-nbd-fake-{}-{}.sock",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let handle = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            script(&mut stream);
        });
        (path, handle)
    }

    fn greet(stream: &mut UnixStream, handshake_flags: u16) {
        stream.write_all(&NBD_MAGIC.to_be_bytes()).unwrap();
        stream.write_all(&IHAVEOPT.to_be_bytes()).unwrap();
        stream.write_all(&handshake_flags.to_be_bytes()).unwrap();
        let client_flags = read_u32(stream).unwrap();
        assert_eq!(
            client_flags & !(CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES),
            0
        );
    }

    fn read_option(stream: &mut UnixStream) -> (u32, Vec<u8>) {
        assert_eq!(read_u64(stream).unwrap(), IHAVEOPT);
        let option = read_u32(stream).unwrap();
        let len = read_u32(stream).unwrap();
        let mut data = vec![0u8; len as usize];
        stream.read_exact(&mut data).unwrap();
        (option, data)
    }

    fn option_reply(stream: &mut UnixStream, option: u32, reply: u32, data: &[u8]) {
        stream.write_all(&OPTION_REPLY_MAGIC.to_be_bytes()).unwrap();
        stream.write_all(&option.to_be_bytes()).unwrap();
        stream.write_all(&reply.to_be_bytes()).unwrap();
        stream
            .write_all(&(data.len() as u32).to_be_bytes())
            .unwrap();
        stream.write_all(data).unwrap();
    }

    /// Serve reads of a zero export until the client disconnects.
    fn serve_zeroes(stream: &mut UnixStream) {
        loop {
            let mut header = [0u8; 28];
            if stream.read_exact(&mut header).is_err() {
                return;
            }
            let command = u16::from_be_bytes([header[6], header[7]]);
            let len = u32::from_be_bytes([header[24], header[25], header[26], header[27]]);
            if command == CMD_DISC {
                return;
            }
            stream.write_all(&SIMPLE_REPLY_MAGIC.to_be_bytes()).unwrap();
            stream.write_all(&0u32.to_be_bytes()).unwrap();
            stream.write_all(&header[8..16]).unwrap();
            if command == CMD_READ {
                stream.write_all(&vec![0u8; len as usize]).unwrap();
            }
        }
    }

    fn quick() -> NbdOptions {
        NbdOptions {
            request_timeout_ms: 2_000,
            connect_timeout_ms: 2_000,
            ..NbdOptions::default()
        }
    }

    #[test]
    fn falls_back_to_export_name_when_go_is_unsupported() {
        let (path, server) = fake_server(|stream| {
            greet(stream, FLAG_FIXED_NEWSTYLE);
            let (option, data) = read_option(stream);
            assert_eq!(option, OPT_GO);
            assert_eq!(&data[4..8], b"disk");
            option_reply(stream, OPT_GO, REP_ERR_UNSUP, b"");
            let (option, data) = read_option(stream);
            assert_eq!(option, OPT_EXPORT_NAME);
            assert_eq!(data, b"disk");
            stream.write_all(&(1u64 << 20).to_be_bytes()).unwrap();
            stream
                .write_all(&(1u16 | TF_SEND_FLUSH).to_be_bytes())
                .unwrap();
            // No NO_ZEROES was offered, so the 124 zero bytes follow.
            stream.write_all(&[0u8; 124]).unwrap();
            serve_zeroes(stream);
        });
        let uri = format!("nbd+unix:///disk?socket={}", path.display());
        let device = NbdDevice::open_with(&uri, quick()).unwrap();
        assert_eq!(device.size_bytes(), 1 << 20);
        let mut buf = vec![1u8; 4096];
        device.read_at(8192, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        device.flush().unwrap();
        drop(device);
        server.join().unwrap();
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn go_info_sets_size_and_block_limits() {
        let (path, server) = fake_server(|stream| {
            greet(stream, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
            let (option, _) = read_option(stream);
            assert_eq!(option, OPT_GO);
            let mut info = Vec::new();
            info.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
            info.extend_from_slice(&4096u32.to_be_bytes());
            info.extend_from_slice(&4096u32.to_be_bytes());
            info.extend_from_slice(&65536u32.to_be_bytes());
            option_reply(stream, OPT_GO, REP_INFO, &info);
            let mut export = Vec::new();
            export.extend_from_slice(&INFO_EXPORT.to_be_bytes());
            export.extend_from_slice(&(8u64 << 20).to_be_bytes());
            export.extend_from_slice(&(1u16 | TF_READ_ONLY).to_be_bytes());
            option_reply(stream, OPT_GO, REP_INFO, &export);
            option_reply(stream, OPT_GO, REP_ACK, b"");
            serve_zeroes(stream);
        });
        let uri = format!("nbd+unix:///?socket={}", path.display());
        let device = NbdDevice::open_with(&uri, quick()).unwrap();
        assert_eq!(device.size_bytes(), 8 << 20);
        assert_eq!(device.alignment_bytes(), 4096);
        assert!(device.is_read_only());
        assert!(matches!(
            device.write_at(0, &[0u8; 4096]),
            Err(DeviceError::Unsupported { .. })
        ));
        assert!(matches!(
            device.read_at(512, &mut [0u8; 512]),
            Err(DeviceError::Unsupported { .. })
        ));
        // A read larger than the 64 KiB payload limit is split.
        let mut big = vec![7u8; 200 << 10];
        device.read_at(0, &mut big).unwrap();
        assert!(big.iter().all(|&b| b == 0));
        assert_eq!(device.stats().requests, 4);
        drop(device);
        server.join().unwrap();
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn refused_export_is_a_clear_open_error() {
        let (path, server) = fake_server(|stream| {
            greet(stream, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
            let (option, _) = read_option(stream);
            assert_eq!(option, OPT_GO);
            option_reply(stream, OPT_GO, REP_ERR_BIT + 6, b"no such export here");
            let (option, _) = read_option(stream);
            assert_eq!(option, OPT_ABORT);
        });
        let uri = format!("nbd+unix:///missing?socket={}", path.display());
        let err = NbdDevice::open_with(&uri, quick())
            .err()
            .expect("open must fail");
        let text = err.to_string();
        assert!(matches!(err, DeviceError::Open { .. }), "{text}");
        assert!(text.contains("nbd+unix:///missing"), "{text}");
        assert!(text.contains("no such export here"), "{text}");
        assert!(text.contains("NBD_REP_ERR_UNKNOWN"), "{text}");
        server.join().unwrap();
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn non_nbd_server_is_refused() {
        let (path, server) = fake_server(|stream| {
            stream
                .write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                .unwrap();
        });
        let uri = format!("nbd+unix:///?socket={}", path.display());
        let err = NbdDevice::open_with(&uri, quick())
            .err()
            .expect("open must fail");
        assert!(err.to_string().contains("not an NBD server"), "{err}");
        server.join().unwrap();
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn silent_server_times_out_at_open() {
        let (path, server) = fake_server(|stream| {
            // Accept, then say nothing until the client gives up.
            let mut sink = [0u8; 1];
            let _ = stream.read(&mut sink);
        });
        let uri = format!("nbd+unix:///?socket={}", path.display());
        let options = NbdOptions {
            connect_timeout_ms: 200,
            ..quick()
        };
        let started = Instant::now();
        let err = NbdDevice::open_with(&uri, options)
            .err()
            .expect("open must fail");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "open took {:?}",
            started.elapsed()
        );
        assert!(matches!(err, DeviceError::Open { .. }), "{err}");
        server.join().unwrap();
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn write_request_handles_partial_writes() {
        /// Accepts at most 5 bytes per call.
        struct Trickle(Vec<u8>);
        impl Write for Trickle {
            fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
                let n = buf.len().min(5);
                self.0.extend_from_slice(&buf[..n]);
                Ok(n)
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let mut sink = Trickle(Vec::new());
        let header = request_header(0, CMD_WRITE, 9, 4096, 13);
        write_request(&mut sink, &header, &[b"hello ", b"", b"world!!"]).unwrap();
        assert_eq!(&sink.0[..28], &header[..]);
        assert_eq!(&sink.0[28..], b"hello world!!");
    }
}
