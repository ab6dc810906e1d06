//! The connection's input buffer: bytes received and not yet parsed.
//! Filled with blocking reads during the handshake and with non-blocking
//! reads, waiting for readiness on the event loop, once transmission
//! starts.

use std::io::{self, Read};
use std::time::Instant;

use super::end::End;
use super::Conn;
use crate::server::listener::Stream;

/// Bytes asked of the kernel per read; several small requests usually
/// arrive in one go.
const READ_CHUNK_BYTES: usize = 64 * 1024;

pub(super) struct InBuf {
    data: Vec<u8>,
    start: usize,
    end: usize,
}

impl InBuf {
    pub(super) fn new() -> Self {
        InBuf {
            data: vec![0u8; READ_CHUNK_BYTES],
            start: 0,
            end: 0,
        }
    }

    pub(super) fn filled(&self) -> &[u8] {
        &self.data[self.start..self.end]
    }

    pub(super) fn len(&self) -> usize {
        self.end - self.start
    }

    pub(super) fn consume(&mut self, n: usize) {
        debug_assert!(n <= self.len());
        self.start += n.min(self.len());
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Drop capacity grown for a large option once negotiation is over.
    pub(super) fn shrink(&mut self) {
        if self.data.len() > READ_CHUNK_BYTES && self.len() <= READ_CHUNK_BYTES {
            self.compact();
            self.data.truncate(READ_CHUNK_BYTES);
            self.data.shrink_to_fit();
        }
    }

    fn compact(&mut self) {
        if self.start > 0 {
            self.data.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }

    /// Room for at least `min_total` bytes from `start`.
    fn make_room(&mut self, min_total: usize) {
        if self.data.len() - self.start < min_total || self.end == self.data.len() {
            self.compact();
        }
        if self.data.len() < min_total {
            self.data.resize(min_total.max(READ_CHUNK_BYTES), 0);
        }
    }

    fn eof(&self) -> End {
        if self.len() == 0 {
            End::ClientClosed
        } else {
            End::MidMessage
        }
    }

    /// Blocking: read until at least `min_total` bytes are buffered (the
    /// caller checked `min_total` against the limits), by `deadline`.
    pub(super) fn fill(
        &mut self,
        stream: &mut Stream,
        min_total: usize,
        deadline: Option<Instant>,
    ) -> Result<(), End> {
        while self.len() < min_total {
            self.make_room(min_total);
            if let Some(deadline) = deadline {
                let now = Instant::now();
                if now >= deadline {
                    return Err(End::HandshakeTimeout);
                }
                // A fresh timeout per read keeps the total bounded even for
                // a client that trickles one byte at a time.
                stream
                    .set_read_timeout(Some(deadline - now))
                    .map_err(End::Io)?;
            }
            match stream.read(&mut self.data[self.end..]) {
                Ok(0) => return Err(self.eof()),
                Ok(n) => self.end += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if deadline.is_some()
                        && matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) =>
                {
                    return Err(End::HandshakeTimeout)
                }
                Err(e) => return Err(End::Io(e)),
            }
        }
        Ok(())
    }

    /// Non-blocking, on the event loop: read until at least `min_total`
    /// bytes are buffered, waiting for the socket to be readable.
    pub(super) async fn fill_async(&mut self, conn: &Conn, min_total: usize) -> Result<(), End> {
        while self.len() < min_total {
            self.make_room(min_total);
            let read = (&conn.stream).read(&mut self.data[self.end..]);
            match read {
                Ok(0) => return Err(self.eof()),
                Ok(n) => self.end += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => conn.readable().await?,
                Err(e) => return Err(End::Io(e)),
            }
        }
        Ok(())
    }

    /// Read `length` payload bytes (already checked against the payload
    /// limit), taking what is buffered first.
    pub(super) async fn read_payload(&mut self, conn: &Conn, length: u64) -> Result<Vec<u8>, End> {
        if length == 0 {
            return Ok(Vec::new());
        }
        let length = length as usize;
        // Not zeroed first: the bytes are copied or received straight into
        // the spare capacity (zeroing and copying 64 KiB payloads were 12%
        // of the daemon's CPU on 64 KiB writes).
        let mut payload = Vec::with_capacity(length);
        let have = self.len().min(length);
        payload.extend_from_slice(&self.filled()[..have]);
        self.consume(have);
        while payload.len() < length {
            let limit = (length - payload.len()) as u64;
            match conn.stream.read_into_vec(&mut payload, limit) {
                // `read_to_end` stops early only at end of stream.
                Ok(_) if payload.len() < length => return Err(End::MidMessage),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => conn.readable().await?,
                Err(e) => return Err(End::Io(e)),
            }
        }
        Ok(payload)
    }

    /// Read and drop `length` bytes of an unwanted payload.
    pub(super) async fn skip(&mut self, conn: &Conn, mut length: u64) -> Result<(), End> {
        while length > 0 {
            if self.len() == 0 {
                self.fill_async(conn, 1).await.map_err(|end| match end {
                    End::ClientClosed => End::MidMessage,
                    other => other,
                })?;
            }
            let take = (self.len() as u64).min(length) as usize;
            self.consume(take);
            length -= take as u64;
        }
        Ok(())
    }
}
