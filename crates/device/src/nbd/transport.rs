//! Sockets to the server: TCP or unix, connected within a deadline, and
//! written with vectored writes.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::io::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use super::uri::{NbdTransport, NbdUri};

/// A connected socket to the server.
pub(super) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
    /// `nbds://`: plaintext to and from the TLS relay thread, and the
    /// socket the relay carries it over, kept so that `abort` can reset it.
    Tls {
        plain: UnixStream,
        carrier: Box<Stream>,
    },
}

impl Stream {
    pub(super) fn connect(uri: &NbdUri, timeout: Duration) -> io::Result<Stream> {
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

    pub(super) fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tls { plain, carrier } => Stream::Tls {
                plain: plain.try_clone()?,
                carrier: Box::new(carrier.try_clone()?),
            },
        })
    }

    /// Shut the connection down gracefully (over TLS, the relay then sends
    /// close_notify and whatever it still holds).
    pub(super) fn shutdown(&self) {
        // Errors only mean it is already shut down or disconnected.
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            Stream::Unix(s) | Stream::Tls { plain: s, .. } => s.shutdown(Shutdown::Both),
        };
    }

    /// End a connection that must not end gracefully (it failed, or it
    /// is closed busy): shut it down (the reader's read returns at once)
    /// and reset the TCP connection under it, directly or under the TLS
    /// relay, which drops whatever the kernel and the relay still hold to
    /// send. Returns the reset's error, if the kernel refused it.
    ///
    /// Why: a graceful shutdown queues its FIN behind unsent data, and the
    /// kernel keeps retransmitting both for many minutes. After a network
    /// partition that data (a write request cairn already reported failed
    /// and has since retried, or superseded with newer data over a new
    /// connection) would reach the server once the network heals and
    /// overwrite the newer data. A reset discards it. What the server has
    /// already received is beyond any client's reach (NBD cannot cancel).
    pub(super) fn abort(&self) -> io::Result<()> {
        self.shutdown();
        match self {
            Stream::Tcp(s) => reset(s),
            Stream::Unix(_) => Ok(()),
            // The relay holds plaintext it has not sent yet, and the
            // kernel ciphertext: reset the socket under it, and the relay
            // ends on its next write.
            Stream::Tls { carrier, .. } => carrier.abort(),
        }
    }

    pub(super) fn set_timeouts(
        &self,
        read: Option<Duration>,
        write: Option<Duration>,
    ) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
            Stream::Unix(s) | Stream::Tls { plain: s, .. } => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> std::os::unix::io::RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) | Stream::Tls { plain: s, .. } => s.as_raw_fd(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) | Stream::Tls { plain: s, .. } => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) | Stream::Tls { plain: s, .. } => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write_vectored(bufs),
            Stream::Unix(s) | Stream::Tls { plain: s, .. } => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Reset a TCP connection now: connect(2) to AF_UNSPEC dissolves it, and
/// Linux sends a reset and purges the send queue (`tcp_disconnect`),
/// whoever else holds the descriptor. Some 6.6-era kernels refuse (EBUSY)
/// while a thread waits on the socket.
fn reset(socket: &TcpStream) -> io::Result<()> {
    // SAFETY: an all-zero sockaddr is a valid value of this C struct; the
    // call reads `size_of::<sockaddr>()` bytes of it.
    let mut unspec: libc::sockaddr = unsafe { std::mem::zeroed() };
    unspec.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
    // SAFETY: a valid descriptor we own and a valid address.
    let rc = unsafe {
        libc::connect(
            socket.as_raw_fd(),
            &unspec,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
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

/// Write the header and payload with as few syscalls as the socket allows.
pub(super) fn write_request(
    w: &mut impl Write,
    header: &[u8],
    payload: &[&[u8]],
) -> io::Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_nbd_proto::codec::RequestHeader;
    use cairn_nbd_proto::proto::CMD_WRITE;

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
        let header = RequestHeader {
            flags: 0,
            command: CMD_WRITE,
            cookie: 9,
            offset: 4096,
            length_bytes: 13,
        }
        .to_compact();
        write_request(&mut sink, &header, &[b"hello ", b"", b"world!!"]).unwrap();
        assert_eq!(&sink.0[..28], &header[..]);
        assert_eq!(&sink.0[28..], b"hello world!!");
    }
}
