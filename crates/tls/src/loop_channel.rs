//! The transport under an `SslStream` that an event loop drives: first a
//! blocking socket (the handshake and the rest of the negotiation run on
//! the connection's thread with blocking reads), then, after
//! [`LoopChannel::go_async`], memory only: the loop receives ciphertext on
//! its ring and [`feed`](LoopChannel::feed)s it in, and sends what
//! [`take_outgoing`](LoopChannel::take_outgoing) hands it. OpenSSL then
//! never touches the socket and never blocks: it answers WANT_READ when
//! it needs ciphertext the loop has not received yet.

use std::io::{self, Read, Write};

/// Ciphertext held for OpenSSL at most before the loop stops receiving
/// (it receives only when OpenSSL asks, so this is one receive's worth).
pub const MAX_INCOMING_BYTES: usize = 256 * 1024;

pub struct LoopChannel<S> {
    /// The socket while blocking; `None` once the loop drives I/O.
    socket: Option<S>,
    incoming: Vec<u8>,
    incoming_start: usize,
    incoming_eof: bool,
    outgoing: Vec<u8>,
}

impl<S: Read + Write> LoopChannel<S> {
    /// Blocking I/O on `socket` (with whatever timeouts it has).
    pub fn blocking(socket: S) -> LoopChannel<S> {
        LoopChannel {
            socket: Some(socket),
            incoming: Vec::new(),
            incoming_start: 0,
            incoming_eof: false,
            outgoing: Vec::new(),
        }
    }

    /// The socket, while blocking.
    pub fn socket(&self) -> Option<&S> {
        self.socket.as_ref()
    }

    /// From now on the loop moves the bytes; the socket handle is dropped.
    pub fn go_async(&mut self) {
        self.socket = None;
    }

    /// Whether OpenSSL has no received ciphertext left to read.
    pub fn incoming_is_empty(&self) -> bool {
        self.incoming_start == self.incoming.len()
    }

    /// Ciphertext the loop received.
    pub fn feed(&mut self, bytes: &[u8]) {
        if self.incoming_is_empty() {
            self.incoming.clear();
            self.incoming_start = 0;
        }
        assert!(
            self.incoming.len() - self.incoming_start + bytes.len() <= MAX_INCOMING_BYTES,
            "ciphertext fed beyond what OpenSSL asked for"
        );
        self.incoming.extend_from_slice(bytes);
    }

    /// The peer closed its end (a receive returned 0).
    pub fn feed_eof(&mut self) {
        self.incoming_eof = true;
    }

    pub fn has_outgoing(&self) -> bool {
        !self.outgoing.is_empty()
    }

    /// Ciphertext to send, in order.
    pub fn take_outgoing(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.outgoing)
    }
}

impl<S: Read + Write> Read for LoopChannel<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if !self.incoming_is_empty() {
            let have = &self.incoming[self.incoming_start..];
            let n = have.len().min(buf.len());
            buf[..n].copy_from_slice(&have[..n]);
            self.incoming_start += n;
            return Ok(n);
        }
        match &mut self.socket {
            Some(socket) => socket.read(buf),
            None if self.incoming_eof => Ok(0),
            None => Err(io::ErrorKind::WouldBlock.into()),
        }
    }
}

impl<S: Read + Write> Write for LoopChannel<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &mut self.socket {
            Some(socket) => socket.write(buf),
            None => {
                self.outgoing.extend_from_slice(buf);
                Ok(buf.len())
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match &mut self.socket {
            Some(socket) => socket.flush(),
            None => Ok(()),
        }
    }
}
