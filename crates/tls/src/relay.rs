//! A thread that moves bytes between a TLS connection and one end of a
//! socket pair, so code written for blocking plain sockets runs over TLS
//! unchanged: the NBD client's pipelined reader and writers (an `nbds://`
//! origin). The server does TLS in its event loop instead
//! (`LoopChannel`): the relay's thread and copies cost it half its
//! throughput.
//!
//! Costs: one thread per TLS connection and one extra copy each way (the
//! pair). Both directions are bounded by a fixed buffer, so a peer that
//! stops reading stops the other side (the kernel's socket buffers, then
//! ours, fill), and memory never grows with what a peer sends.

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use openssl::ssl::{ErrorCode, SslStream};

/// Plaintext buffered per direction.
const RELAY_BUFFER_BYTES: usize = 256 * 1024;
/// The most plaintext given to one TLS write: one full record.
const RECORD_BYTES: usize = 16 * 1024;

/// Start relaying `tls` on a thread named `name`; returns the socket the
/// caller reads and writes plaintext on. Shutting down its writes sends
/// close_notify (TLS 1.3 half-close); the TLS peer's close shuts down
/// the socket's reads; the relay ends when both directions are closed,
/// or a write to a side that went away fails.
/// A TLS peer that takes no bytes for `stall_timeout` while some wait for
/// it ends the relay (it would otherwise hold the thread forever).
pub fn spawn_relay<S>(
    tls: SslStream<S>,
    name: String,
    stall_timeout: Option<Duration>,
) -> io::Result<(UnixStream, RelayOutcome)>
where
    S: Read + Write + AsRawFd + Send + 'static,
{
    let (ours, theirs) = UnixStream::pair()?;
    ours.set_nonblocking(true)?;
    set_nonblocking(tls.get_ref().as_raw_fd())?;
    let outcome = RelayOutcome::default();
    let record = outcome.clone();
    std::thread::Builder::new().name(name).spawn(move || {
        let mut relay = Relay::new(tls, ours, stall_timeout);
        match relay.run() {
            Ok(()) => tracing::debug!("TLS relay finished"),
            Err(e) => {
                tracing::debug!(error = %e, "TLS relay ended");
                *record.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(e.to_string());
            }
        }
        // The plain end closes only now: whoever sees it close finds the
        // reason already recorded.
        drop(relay);
    })?;
    Ok((theirs, outcome))
}

/// Why a relay ended, once it has: what the plain side cannot see in an
/// EOF (a TLS alert from the peer, such as "certificate required").
#[derive(Clone, Default, Debug)]
pub struct RelayOutcome(Arc<Mutex<Option<String>>>);

impl RelayOutcome {
    /// The error the relay ended with; `None` while it runs or after a
    /// clean close.
    pub fn error(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor owned by the stream we hold, with
    // valid commands; a bad fd only makes it fail.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Bytes waiting to go one way.
struct Pending {
    data: Box<[u8]>,
    start: usize,
    end: usize,
}

impl Pending {
    fn new() -> Pending {
        Pending {
            data: vec![0u8; RELAY_BUFFER_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    fn is_empty(&self) -> bool {
        self.start == self.end
    }

    fn filled(&self) -> &[u8] {
        &self.data[self.start..self.end]
    }

    fn consume(&mut self, n: usize) {
        assert!(n <= self.end - self.start, "consumed more than buffered");
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Free room at the end, compacting first when the front is free.
    fn room(&mut self) -> &mut [u8] {
        if self.end == self.data.len() && self.start > 0 {
            self.data.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        &mut self.data[self.end..]
    }

    fn has_room(&self) -> bool {
        self.end < self.data.len() || self.start > 0
    }

    fn added(&mut self, n: usize) {
        assert!(self.end + n <= self.data.len(), "filled past the buffer");
        self.end += n;
    }
}

/// What a pass found blocking, so the poll waits for the right events.
#[derive(Default)]
struct Interest {
    tls_read: bool,
    tls_write: bool,
    plain_read: bool,
    plain_write: bool,
}

struct Relay<S> {
    tls: SslStream<S>,
    plain: UnixStream,
    /// Decrypted from the TLS peer, for the plain side.
    to_plain: Pending,
    /// From the plain side, to encrypt.
    to_tls: Pending,
    /// Length of a TLS write that must be retried as it was.
    retry_write_bytes: Option<usize>,
    tls_eof: bool,
    plain_eof: bool,
    plain_write_shut: bool,
    stall_timeout: Option<Duration>,
    /// Since when bytes have waited for the TLS peer without it taking any.
    tls_write_blocked_since: Option<Instant>,
    /// close_notify was sent; since then (or the last progress) the TLS
    /// peer has this long to finish (the stall limit, else `LINGER`).
    tls_closing_since: Option<Instant>,
}

/// How long a relay whose plain side finished waits for a TLS peer that
/// neither closes nor sends, when no stall limit was given.
const LINGER: Duration = Duration::from_secs(30);

/// How one TLS call ended when it made no progress.
enum Blocked {
    Read,
    Write,
    Closed,
    /// A signal interrupted the call: make it again.
    Interrupted,
}

impl<S: Read + Write + AsRawFd> Relay<S> {
    fn new(tls: SslStream<S>, plain: UnixStream, stall_timeout: Option<Duration>) -> Relay<S> {
        Relay {
            tls,
            plain,
            to_plain: Pending::new(),
            to_tls: Pending::new(),
            retry_write_bytes: None,
            tls_eof: false,
            plain_eof: false,
            plain_write_shut: false,
            stall_timeout,
            tls_write_blocked_since: None,
            tls_closing_since: None,
        }
    }

    fn run(&mut self) -> io::Result<()> {
        loop {
            let mut interest = Interest::default();
            let mut progress = self.decrypt(&mut interest)?;
            progress |= self.deliver(&mut interest)?;
            progress |= self.collect(&mut interest)?;
            progress |= self.encrypt(&mut interest)?;
            if self.tls_eof && self.to_plain.is_empty() && !self.plain_write_shut {
                // The TLS peer is done sending: tell the plain side.
                let _ = self.plain.shutdown(Shutdown::Write);
                self.plain_write_shut = true;
                progress = true;
            }
            if self.plain_eof && self.to_tls.is_empty() && self.tls_closing_since.is_none() {
                // The plain side is done sending and everything it sent is
                // out: close_notify, a half-close in TLS 1.3. What the TLS
                // peer still sends is delivered until it closes too (or,
                // when the plain side closed for good, fails to deliver).
                let _ = self.tls.shutdown();
                self.tls_closing_since = Some(Instant::now());
                progress = true;
            }
            if self.tls_closing_since.is_some() && self.tls_eof && self.to_plain.is_empty() {
                let _ = self.plain.shutdown(Shutdown::Both);
                return Ok(());
            }
            if progress && self.tls_closing_since.is_some() {
                self.tls_closing_since = Some(Instant::now());
            }
            if !progress {
                self.wait(&interest)?;
            }
        }
    }

    /// TLS → `to_plain`.
    fn decrypt(&mut self, interest: &mut Interest) -> io::Result<bool> {
        let mut progress = false;
        while !self.tls_eof && self.to_plain.has_room() {
            match self.tls.ssl_read(self.to_plain.room()) {
                Ok(0) => self.tls_eof = true,
                Ok(n) => {
                    self.to_plain.added(n);
                    progress = true;
                }
                Err(e) => match classify(e)? {
                    Blocked::Read => {
                        interest.tls_read = true;
                        break;
                    }
                    Blocked::Write => {
                        interest.tls_write = true;
                        break;
                    }
                    Blocked::Closed => {
                        self.tls_eof = true;
                        progress = true;
                    }
                    Blocked::Interrupted => {}
                },
            }
        }
        Ok(progress)
    }

    /// `to_plain` → the plain socket.
    fn deliver(&mut self, interest: &mut Interest) -> io::Result<bool> {
        let mut progress = false;
        while !self.to_plain.is_empty() {
            match (&self.plain).write(self.to_plain.filled()) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.to_plain.consume(n);
                    progress = true;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    interest.plain_write = true;
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(progress)
    }

    /// The plain socket → `to_tls`.
    fn collect(&mut self, interest: &mut Interest) -> io::Result<bool> {
        let mut progress = false;
        while !self.plain_eof && self.to_tls.has_room() {
            match (&self.plain).read(self.to_tls.room()) {
                Ok(0) => {
                    self.plain_eof = true;
                    progress = true;
                }
                Ok(n) => {
                    self.to_tls.added(n);
                    progress = true;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    interest.plain_read = true;
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(progress)
    }

    /// `to_tls` → TLS, a record at a time.
    fn encrypt(&mut self, interest: &mut Interest) -> io::Result<bool> {
        let mut progress = false;
        while !self.to_tls.is_empty() {
            // A write that returned WANT_* must be retried with the same
            // length; the bytes stay at the front of `to_tls`.
            let length = self
                .retry_write_bytes
                .unwrap_or_else(|| self.to_tls.filled().len().min(RECORD_BYTES));
            match self.tls.ssl_write(&self.to_tls.filled()[..length]) {
                Ok(n) => {
                    self.retry_write_bytes = None;
                    self.tls_write_blocked_since = None;
                    self.to_tls.consume(n);
                    progress = true;
                }
                Err(e) => {
                    self.retry_write_bytes = Some(length);
                    self.tls_write_blocked_since
                        .get_or_insert_with(Instant::now);
                    match classify(e)? {
                        Blocked::Read => interest.tls_read = true,
                        Blocked::Write => interest.tls_write = true,
                        Blocked::Closed => {
                            return Err(io::Error::new(
                                io::ErrorKind::BrokenPipe,
                                "the TLS peer closed the connection",
                            ))
                        }
                        Blocked::Interrupted => continue,
                    }
                    break;
                }
            }
        }
        Ok(progress)
    }

    fn wait(&self, interest: &Interest) -> io::Result<()> {
        let mut fds = [
            libc::pollfd {
                fd: self.tls.get_ref().as_raw_fd(),
                events: events(interest.tls_read, interest.tls_write),
                revents: 0,
            },
            libc::pollfd {
                fd: self.plain.as_raw_fd(),
                events: events(interest.plain_read, interest.plain_write),
                revents: 0,
            },
        ];
        if fds.iter().all(|p| p.events == 0) {
            // Every pass ends blocked on something or finished; nothing
            // to wait for would be a relay bug, and waiting forever the
            // worst way to show it.
            return Err(io::Error::other("TLS relay has nothing to wait for"));
        }
        loop {
            let blocked =
                self.stall_timeout
                    .zip(self.tls_write_blocked_since)
                    .map(|(stall, since)| {
                        (
                            stall.saturating_sub(since.elapsed()),
                            "the TLS peer stopped reading",
                        )
                    });
            let closing = self.tls_closing_since.map(|since| {
                let limit = self.stall_timeout.unwrap_or(LINGER);
                (
                    limit.saturating_sub(since.elapsed()),
                    "the TLS peer did not close after close_notify",
                )
            });
            let nearest = match (blocked, closing) {
                (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
                (a, b) => a.or(b),
            };
            let timeout_ms = match nearest {
                Some((left, why)) if left.is_zero() => {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, why))
                }
                Some((left, _)) => left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int,
                None => -1,
            };
            // SAFETY: `fds` is a valid array of two pollfd for the call.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
            if rc > 0 {
                return Ok(());
            }
            if rc == 0 {
                // Timed out: the check at the top of the loop decides.
                continue;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

fn events(read: bool, write: bool) -> libc::c_short {
    let mut events = 0;
    if read {
        events |= libc::POLLIN;
    }
    if write {
        events |= libc::POLLOUT;
    }
    events
}

/// A TLS call that did not go through: blocked on a direction, the peer
/// closed, or a real error.
fn classify(e: openssl::ssl::Error) -> io::Result<Blocked> {
    match e.code() {
        ErrorCode::WANT_READ => Ok(Blocked::Read),
        ErrorCode::WANT_WRITE => Ok(Blocked::Write),
        ErrorCode::ZERO_RETURN => Ok(Blocked::Closed),
        // EOF without close_notify: the peer went away.
        ErrorCode::SYSCALL if e.io_error().is_none() => Ok(Blocked::Closed),
        ErrorCode::SYSCALL
            if e.io_error()
                .is_some_and(|io| io.kind() == io::ErrorKind::Interrupted) =>
        {
            Ok(Blocked::Interrupted)
        }
        _ => Err(match e.into_io_error() {
            Ok(io) => io,
            Err(e) => io::Error::other(e.to_string()),
        }),
    }
}
