//! TLS on the connection's event loop: after the blocking handshake (see
//! `negotiate`), OpenSSL works on memory only (`cairn_tls::LoopChannel`)
//! and the loop's ring receives and sends the ciphertext, so a TLS
//! connection is served like a clear-text one: no extra thread, no extra
//! copy through a socket pair, requests still in flight while the next
//! ones are decrypted. The reader decrypts (`read`), the writer encrypts
//! whole batches of replies (`encrypt`); ciphertext leaves only through
//! the writer, in the order OpenSSL produced it.

use std::cell::RefCell;
use std::io;
use std::mem::MaybeUninit;

use cairn_tls::openssl::ssl::ErrorCode;
use cairn_tls::{LoopChannel, SslStream, MAX_INCOMING_BYTES};

use super::end::End;
use super::output::Reply;
use super::Conn;
use crate::server::listener::Stream;

/// The TLS session of a connection (its channel holds the socket while
/// negotiation blocks on it).
pub(crate) type TlsLink = SslStream<LoopChannel<Stream>>;

/// Ciphertext asked of the kernel per receive: several records.
const CIPHER_RECEIVE_BYTES: usize = 64 * 1024;

// OpenSSL asks for ciphertext only once it took all it was given, so one
// receive is all the channel ever holds.
const _: () = assert!(CIPHER_RECEIVE_BYTES <= MAX_INCOMING_BYTES);

/// The most plaintext given to one TLS write: one record.
const RECORD_BYTES: usize = 16 * 1024;

pub(super) struct LoopTls {
    link: RefCell<Box<TlsLink>>,
    /// The receive buffer, reused (lent to the ring while a receive runs).
    receive_buffer: RefCell<Option<Vec<u8>>>,
}

impl LoopTls {
    pub(super) fn new(mut link: Box<TlsLink>) -> LoopTls {
        link.get_mut().go_async();
        LoopTls {
            link: RefCell::new(link),
            receive_buffer: RefCell::new(None),
        }
    }

    /// Ciphertext is waiting to be sent (the writer sends it).
    pub(super) fn has_outgoing(&self) -> bool {
        self.link.borrow().get_ref().has_outgoing()
    }

    /// Decrypted bytes into `dst`; 0 when the client closed. Receives
    /// ciphertext on the ring when OpenSSL has none left to decrypt.
    pub(super) async fn read(&self, conn: &Conn, dst: &mut [u8]) -> Result<usize, End> {
        // SAFETY: `ssl_read_uninit` never de-initialises the buffer, so
        // initialised bytes seen as possibly uninitialised stay valid.
        let dst = unsafe { &mut *(dst as *mut [u8] as *mut [MaybeUninit<u8>]) };
        self.read_uninit(conn, dst).await
    }

    /// [`LoopTls::read`] into spare capacity; the first `n` bytes are
    /// initialised when it returns `Ok(n)`.
    pub(super) async fn read_uninit(
        &self,
        conn: &Conn,
        dst: &mut [MaybeUninit<u8>],
    ) -> Result<usize, End> {
        // Each round either decrypts, or receives bytes first; a peer can
        // make at most one empty receive (EOF ends it).
        loop {
            let result = self.link.borrow_mut().ssl_read_uninit(dst);
            if self.has_outgoing() {
                // Reading can make TLS answer (a key update): the writer
                // sends it.
                conn.output.wake();
            }
            match result {
                Ok(n) => return Ok(n),
                Err(e) => match e.code() {
                    ErrorCode::ZERO_RETURN => return Ok(0),
                    ErrorCode::WANT_READ => self.receive(conn).await?,
                    ErrorCode::SYSCALL if e.io_error().is_none() => return Ok(0),
                    _ => return Err(tls_failure(e)),
                },
            }
        }
    }

    async fn receive(&self, conn: &Conn) -> Result<(), End> {
        let buffer = self
            .receive_buffer
            .borrow_mut()
            .take()
            .unwrap_or_else(|| vec![0u8; CIPHER_RECEIVE_BYTES]);
        let (received, buffer) = conn.reactor.recv(conn.stream.raw_fd(), buffer).await;
        let outcome = match received {
            Ok(0) => {
                self.link.borrow_mut().get_mut().feed_eof();
                Ok(())
            }
            Ok(n) => {
                self.link.borrow_mut().get_mut().feed(&buffer[..n]);
                Ok(())
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(End::Io(e)),
        };
        *self.receive_buffer.borrow_mut() = Some(buffer);
        outcome
    }

    /// Encrypt `replies` in order; the ciphertext to send (with anything
    /// TLS had queued before it). Replies are packed into full records
    /// (a 4 KiB read's 16-byte header and its data would otherwise be two
    /// records, and the client pays for each record it decrypts).
    pub(super) fn encrypt(&self, replies: &[Reply]) -> io::Result<Vec<u8>> {
        let mut link = self.link.borrow_mut();
        let mut staging: Vec<u8> = Vec::with_capacity(RECORD_BYTES);
        for reply in replies {
            for piece in reply.pieces() {
                let mut rest = piece;
                while !rest.is_empty() {
                    if staging.is_empty() && rest.len() >= RECORD_BYTES {
                        // A whole record straight from the reply.
                        write_record(&mut link, &rest[..RECORD_BYTES])?;
                        rest = &rest[RECORD_BYTES..];
                        continue;
                    }
                    let take = (RECORD_BYTES - staging.len()).min(rest.len());
                    staging.extend_from_slice(&rest[..take]);
                    rest = &rest[take..];
                    if staging.len() == RECORD_BYTES {
                        write_record(&mut link, &staging)?;
                        staging.clear();
                    }
                }
            }
        }
        if !staging.is_empty() {
            write_record(&mut link, &staging)?;
        }
        Ok(link.get_mut().take_outgoing())
    }

    /// close_notify, to send before the socket closes.
    pub(super) fn close(&self) -> Vec<u8> {
        let mut link = self.link.borrow_mut();
        let _ = link.shutdown();
        link.get_mut().take_outgoing()
    }

    /// Ciphertext TLS queued by itself (answers made while reading).
    pub(super) fn take_outgoing(&self) -> Vec<u8> {
        self.link.borrow_mut().get_mut().take_outgoing()
    }
}

/// One TLS write of at most a record; memory never blocks, so it takes
/// all of it (in pieces if OpenSSL says so).
fn write_record(link: &mut TlsLink, mut bytes: &[u8]) -> io::Result<()> {
    debug_assert!(bytes.len() <= RECORD_BYTES);
    while !bytes.is_empty() {
        let n = link
            .ssl_write(bytes)
            .map_err(|e| io::Error::other(format!("TLS: {e}")))?;
        bytes = &bytes[n..];
    }
    Ok(())
}

fn tls_failure(e: cairn_tls::openssl::ssl::Error) -> End {
    let message = match e.ssl_error() {
        Some(stack) => stack.to_string(),
        None => e.to_string(),
    };
    End::Io(io::Error::new(
        io::ErrorKind::InvalidData,
        format!("TLS: {message}"),
    ))
}
