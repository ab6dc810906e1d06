//! The connection's input buffer: bytes received and not yet parsed.
//! Filled with blocking reads during the handshake; once transmission
//! starts, with ring receives on the event loop, and with a non-blocking
//! `recv` tried first where the bytes are most likely there already.

use std::io::{self, Read};
use std::time::{Duration, Instant};

use super::end::End;
use super::Conn;
use crate::server::listener::Stream;

/// Bytes asked of the kernel per read; several small requests usually
/// arrive in one go.
const READ_CHUNK_BYTES: usize = 64 * 1024;

/// A payload at least this large makes the next header be received on its
/// own: a client streaming large writes sends header, payload, header,
/// payload, and a full-chunk receive for a header takes most of the next
/// payload into this buffer, from where it has to be copied again (7.6%
/// of the daemon's CPU on 64 KiB writes at QD8). Received alone, the
/// header is followed by a receive straight into the payload's buffer:
/// the same two receives per request, one copy less.
const LARGE_PAYLOAD_BYTES: u64 = 16 * 1024;

/// A blocking reader whose reads can be given a timeout (the client's
/// socket, or TLS over it during the negotiation).
pub(super) trait TimedRead: Read {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
}

impl TimedRead for Stream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        Stream::set_read_timeout(self, timeout)
    }
}

pub(super) struct InBuf {
    data: Vec<u8>,
    start: usize,
    end: usize,
    /// The last request carried a large payload: receive only what the
    /// next header needs (see [`LARGE_PAYLOAD_BYTES`]).
    header_alone: bool,
}

impl InBuf {
    pub(super) fn new() -> Self {
        InBuf {
            data: vec![0u8; READ_CHUNK_BYTES],
            start: 0,
            end: 0,
            header_alone: false,
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
        stream: &mut impl TimedRead,
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

    /// On the event loop: receive until at least `min_total` bytes are
    /// buffered. The receive is a ring operation: the task sleeps until
    /// the client's bytes are in, and they arrive with the completion.
    /// After a large payload, a non-blocking `recv` is tried first (see
    /// [`receive`]).
    pub(super) async fn fill_async(&mut self, conn: &Conn, min_total: usize) -> Result<(), End> {
        if let Some(tls) = &conn.tls {
            while self.len() < min_total {
                self.make_room(min_total);
                let end = self.end;
                match tls.read(conn, &mut self.data[end..]).await? {
                    0 => return Err(self.eof()),
                    n => self.end += n,
                }
            }
            return Ok(());
        }
        let header_alone = std::mem::take(&mut self.header_alone);
        while self.len() < min_total {
            self.make_room(min_total);
            let room = self.data.len() - self.end;
            let want = if header_alone {
                min_total - self.len()
            } else {
                room
            };
            debug_assert!(want > 0 && want <= room);
            let tail = Tail {
                data: std::mem::take(&mut self.data),
                start: self.end,
                len: want,
            };
            // After a large payload the client is streaming writes and
            // its next header is most likely in the socket already; a
            // small request's next one is usually not, and trying would
            // cost a failed system call per request (W1 at QD1).
            let (received, tail) = receive(conn, tail, header_alone).await;
            self.data = tail.data;
            match received {
                Ok(0) => return Err(self.eof()),
                Ok(n) => self.end += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
                    ) => {}
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
        self.header_alone = length >= LARGE_PAYLOAD_BYTES;
        let length = length as usize;
        // Not zeroed first: the bytes are copied or received straight into
        // the spare capacity (zeroing and copying 64 KiB payloads were 12%
        // of the daemon's CPU on 64 KiB writes).
        let mut payload = Vec::with_capacity(length);
        let have = self.len().min(length);
        payload.extend_from_slice(&self.filled()[..have]);
        self.consume(have);
        if let Some(tls) = &conn.tls {
            while payload.len() < length {
                let want = length - payload.len();
                let n = tls
                    .read_uninit(conn, &mut payload.spare_capacity_mut()[..want])
                    .await?;
                if n == 0 {
                    return Err(End::MidMessage);
                }
                assert!(payload.len() + n <= length, "received past the request");
                // SAFETY: the TLS read initialised `n` bytes of the spare
                // capacity right after the initialised prefix.
                unsafe { payload.set_len(payload.len() + n) };
            }
            return Ok(payload);
        }
        while payload.len() < length {
            let spare = Spare {
                vec: payload,
                want: length,
            };
            // Its header has just arrived: the payload most likely too.
            let (received, spare) = receive(conn, spare, true).await;
            payload = spare.vec;
            match received {
                Ok(0) => return Err(End::MidMessage),
                Ok(n) => {
                    assert!(payload.len() + n <= length, "received past the request");
                    // SAFETY: the kernel wrote `n` bytes into the spare
                    // capacity right after the initialised prefix.
                    unsafe { payload.set_len(payload.len() + n) };
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
                    ) => {}
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

/// Receive into `buf` from the client: with one non-blocking `recv` first
/// when `bytes_likely` (see `cairn_io::recv_now`), through the ring if
/// nothing is there yet. The direct try is made only with io_uring:
/// without it, the loop's receive is itself a non-blocking `recv` tried at
/// once (then a wait for readiness), and a second would be a wasted call.
async fn receive<B: cairn_io::StableBufMut + 'static>(
    conn: &Conn,
    mut buf: B,
    bytes_likely: bool,
) -> (io::Result<usize>, B) {
    let fd = conn.stream.raw_fd();
    if bytes_likely && conn.reactor.uses_io_uring() {
        match cairn_io::recv_now(fd, &mut buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            done => return (done, buf),
        }
    }
    conn.reactor.recv(fd, buf).await
}

/// `len` bytes of the free end of the input buffer, lent to a receive.
struct Tail {
    data: Vec<u8>,
    start: usize,
    len: usize,
}

// SAFETY: the bytes live on the heap (the Vec's buffer, not moved while
// lent); the range starts inside it and is cut to what it holds.
unsafe impl cairn_io::StableBuf for Tail {
    fn stable_ptr(&self) -> *const u8 {
        self.data[self.start..].as_ptr()
    }
    fn stable_len(&self) -> usize {
        self.len.min(self.data.len() - self.start)
    }
}

// SAFETY: as above, and the range is writable (initialised bytes of the Vec).
unsafe impl cairn_io::StableBufMut for Tail {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.data[self.start..].as_mut_ptr()
    }
}

/// The spare capacity of a payload being received, up to `want` bytes.
struct Spare {
    vec: Vec<u8>,
    want: usize,
}

// SAFETY: the spare capacity is on the heap and not moved while lent;
// `want <= capacity` (the Vec was made with that capacity).
unsafe impl cairn_io::StableBuf for Spare {
    fn stable_ptr(&self) -> *const u8 {
        // SAFETY: `len <= capacity`, so the pointer stays in the allocation.
        unsafe { self.vec.as_ptr().add(self.vec.len()) }
    }
    fn stable_len(&self) -> usize {
        debug_assert!(self.want <= self.vec.capacity());
        self.want - self.vec.len()
    }
}

// SAFETY: the spare capacity may be written (it is uninitialised memory
// of the allocation; the receive only writes, never reads it).
unsafe impl cairn_io::StableBufMut for Spare {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: as above.
        unsafe { self.vec.as_mut_ptr().add(self.vec.len()) }
    }
}
