//! The connection's replies: queued by the request tasks as they finish,
//! in any order, and written by one writer task with `sendmsg`, as many as
//! are ready at once: first a non-blocking one made at once, then, for what
//! the socket did not take, one through the ring that waits for room. A
//! reply is never split by another. The socket is non-blocking; a client
//! that stops reading gets `write_timeout_ms` before the connection is
//! dropped.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::io;
use std::net::Shutdown;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use cairn_io::{Deadline, LocalNotify};

use super::charge::Charge;
use super::tls::LoopTls;
use super::Conn;
use crate::export::ReadBuffer;

/// Most buffers in one `writev` (the kernel's IOV_MAX is 1024).
const IOVECS_MAX: usize = 1024;

/// One reply, and what its request holds until it has been sent.
pub(super) struct Reply {
    body: Body,
    /// Given back when the reply is dropped: sent, or dropped unsent.
    _charge: Option<Charge>,
}

/// A reply's bytes, or a read reply's header and data.
enum Body {
    Bytes(Vec<u8>),
    Data { header: Vec<u8>, data: ReadBuffer },
}

impl Reply {
    pub(super) fn bytes(bytes: Vec<u8>) -> Reply {
        Reply {
            body: Body::Bytes(bytes),
            _charge: None,
        }
    }

    pub(super) fn data(header: Vec<u8>, data: ReadBuffer) -> Reply {
        Reply {
            body: Body::Data { header, data },
            _charge: None,
        }
    }

    /// The reply holds `charge` (its request's slot and budget) until it
    /// has been sent.
    pub(super) fn charged(self, charge: Charge) -> Reply {
        Reply {
            body: self.body,
            _charge: Some(charge),
        }
    }

    pub(super) fn pieces(&self) -> [&[u8]; 2] {
        match &self.body {
            Body::Bytes(bytes) => [bytes, &[]],
            Body::Data { header, data } => [header, (**data).as_ref()],
        }
    }

    fn len(&self) -> usize {
        self.pieces().iter().map(|p| p.len()).sum()
    }
}

#[derive(Default)]
pub(super) struct Output {
    queue: RefCell<VecDeque<Reply>>,
    /// Bytes of the front reply already written.
    front_written: Cell<usize>,
    changed: LocalNotify,
    broken: Cell<bool>,
    closing: Cell<bool>,
}

impl Output {
    /// Queue a reply (dropped if the connection is broken).
    pub(super) fn push(&self, reply: Reply) {
        if self.broken.get() {
            return;
        }
        self.queue.borrow_mut().push_back(reply);
        self.changed.notify_all();
    }

    pub(super) fn is_broken(&self) -> bool {
        self.broken.get()
    }

    /// Wake the writer: TLS has ciphertext of its own to send.
    pub(super) fn wake(&self) {
        self.changed.notify_all();
    }

    /// No more replies will come: the writer ends once the queue is empty.
    pub(super) fn close(&self) {
        self.closing.set(true);
        self.changed.notify_all();
    }

    /// Drop what is queued and refuse more: the socket failed.
    fn fail(&self, conn: &Conn, why: &str) {
        if !self.broken.replace(true) {
            tracing::debug!(conn = conn.id, "{why}; closing connection");
        }
        self.queue.borrow_mut().clear();
        conn.stream.shutdown(Shutdown::Both);
    }

    /// Take every queued reply (TLS encrypts them into one buffer).
    fn take_all(&self) -> Vec<Reply> {
        debug_assert_eq!(self.front_written.get(), 0);
        self.queue.borrow_mut().drain(..).collect()
    }

    /// Take the queued replies (up to what one `sendmsg` carries) to send.
    fn take_batch(&self) -> ReplyBatch {
        let mut queue = self.queue.borrow_mut();
        let count = queue.len().min(IOVECS_MAX / 2);
        ReplyBatch {
            replies: queue.drain(..count).collect(),
            skip: self.front_written.replace(0),
        }
    }

    /// `sent` bytes of `batch` left: put back the replies not fully sent,
    /// in order, at the front of the queue.
    fn requeue(&self, batch: ReplyBatch, sent: usize) {
        let mut left = sent + batch.skip;
        let mut queue = self.queue.borrow_mut();
        let mut unsent = Vec::new();
        let mut front_written = 0;
        for reply in batch.replies {
            let len = reply.len();
            if left >= len {
                left -= len;
                continue;
            }
            if unsent.is_empty() {
                front_written = left;
                left = 0;
            }
            unsent.push(reply);
        }
        for reply in unsent.into_iter().rev() {
            queue.push_front(reply);
        }
        self.front_written.set(front_written);
    }
}

/// Replies being sent together; the first `skip` bytes went out already.
struct ReplyBatch {
    replies: Vec<Reply>,
    skip: usize,
}

impl ReplyBatch {
    /// The bytes of the batch not sent yet.
    fn unsent_bytes(&self) -> usize {
        self.replies.iter().map(Reply::len).sum::<usize>() - self.skip
    }
}

// SAFETY: every piece is heap memory owned by the batch (a reply's header
// Vec, its data buffer's allocation), not moved or changed while it lives.
unsafe impl cairn_io::StableBufs for ReplyBatch {
    fn iovecs(&self) -> Vec<libc::iovec> {
        let mut skip = self.skip;
        let mut iovecs = Vec::with_capacity(self.replies.len() * 2);
        for reply in &self.replies {
            for piece in reply.pieces() {
                if skip >= piece.len() {
                    skip -= piece.len();
                    continue;
                }
                iovecs.push(libc::iovec {
                    iov_base: piece[skip..].as_ptr() as *mut libc::c_void,
                    iov_len: piece.len() - skip,
                });
                skip = 0;
            }
        }
        iovecs
    }
}

/// The writer task: write replies as they are queued until the output is
/// closed and empty, or the socket fails.
pub(super) async fn writer(conn: Rc<Conn>) {
    let output = &conn.output;
    // One timer for all the sends (a timer per send was two more ring
    // operations per send, a measurable share of a busy connection's CPU).
    let mut deadline = match conn.shared.config.write_timeout_ms {
        0 => None,
        ms => Some(Deadline::new(
            conn.reactor.clone(),
            Duration::from_millis(ms),
        )),
    };
    if let Some(tls) = &conn.tls {
        return tls_writer(&conn, tls, deadline).await;
    }
    loop {
        if output.broken.get() {
            return;
        }
        if output.queue.borrow().is_empty() {
            if output.closing.get() {
                return;
            }
            output.changed.notified().await;
            continue;
        }
        let batch = output.take_batch();
        tracing::trace!(
            conn = conn.id,
            replies = batch.replies.len(),
            bytes = batch.unsent_bytes(),
            "sending replies"
        );
        let rest = match send_at_once(&conn, batch) {
            Sent::All => continue,
            Sent::Rest(rest) => rest,
            Sent::Failed => return,
        };
        if !send_on_ring(&conn, rest, &mut deadline).await {
            return;
        }
    }
}

/// What a send left of a batch.
enum Sent {
    All,
    Rest(ReplyBatch),
    Failed,
}

/// Everything queued in one send tried at once: the socket usually has
/// room, and then the replies are out without a ring operation and a loop
/// turn to reap it (at one request in flight, one `io_uring_enter` per
/// request fewer).
fn send_at_once(conn: &Conn, batch: ReplyBatch) -> Sent {
    let output = &conn.output;
    let total = batch.unsent_bytes();
    let outcome = cairn_io::send_now(conn.stream.raw_fd(), &batch);
    if !matches!(outcome, Ok(sent) if sent == total) {
        conn.shared
            .counters
            .reply_sends_short
            .fetch_add(1, Ordering::Relaxed);
    }
    match outcome {
        Ok(sent) if sent == total => {
            output.requeue(batch, sent);
            Sent::All
        }
        Ok(sent) => {
            output.requeue(batch, sent);
            Sent::Rest(output.take_batch())
        }
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
            ) =>
        {
            Sent::Rest(batch)
        }
        Err(e) => {
            output.fail(conn, &format!("reply write failed: {e}"));
            Sent::Failed
        }
    }
}

/// The rest as one ring send, which waits for room in the socket (within
/// the write timeout); what it did not take goes back to the queue's
/// front. False if the connection failed.
async fn send_on_ring(conn: &Conn, batch: ReplyBatch, deadline: &mut Option<Deadline>) -> bool {
    let output = &conn.output;
    let total = batch.unsent_bytes();
    tracing::trace!(
        conn = conn.id,
        replies = batch.replies.len(),
        bytes = total,
        "replies left to the ring"
    );
    conn.shared
        .counters
        .reply_send_waits
        .fetch_add(1, Ordering::Relaxed);
    let send = conn.reactor.send_owned(conn.stream.raw_fd(), batch);
    let outcome = match deadline {
        None => Some(send.await),
        Some(deadline) => deadline.run(send).await,
    };
    match outcome {
        None => {
            output.fail(conn, "the client stopped reading replies (write timeout)");
            false
        }
        Some((Ok(0), _)) if total > 0 => {
            output.fail(conn, "the client's socket took no bytes");
            false
        }
        Some((Ok(sent), batch)) => {
            tracing::trace!(conn = conn.id, sent, "ring send done");
            output.requeue(batch, sent);
            true
        }
        Some((Err(e), batch))
            if matches!(
                e.kind(),
                io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
            ) =>
        {
            output.requeue(batch, 0);
            true
        }
        Some((Err(e), _)) => {
            output.fail(conn, &format!("reply write failed: {e}"));
            false
        }
    }
}

/// The writer of a TLS connection: every queued reply encrypted into one
/// buffer, sent whole before the next batch (ciphertext must leave in the
/// order it was made); close_notify at the end.
async fn tls_writer(conn: &Rc<Conn>, tls: &LoopTls, mut deadline: Option<Deadline>) {
    let output = &conn.output;
    loop {
        if output.broken.get() {
            return;
        }
        // The replies encrypted are kept (with their charges) until their
        // ciphertext has been sent.
        let mut held = Vec::new();
        let cipher = if output.queue.borrow().is_empty() {
            if tls.has_outgoing() {
                tls.take_outgoing()
            } else if output.closing.get() {
                // Best effort: the client may be gone already.
                let _ = send_cipher(conn, tls.close(), &mut deadline).await;
                return;
            } else {
                output.changed.notified().await;
                continue;
            }
        } else {
            held = output.take_all();
            match tls.encrypt(&held) {
                Ok(cipher) => cipher,
                Err(e) => {
                    output.fail(conn, &format!("TLS encryption failed: {e}"));
                    return;
                }
            }
        };
        if let Err(why) = send_cipher(conn, cipher, &mut deadline).await {
            output.fail(conn, &why);
            return;
        }
        drop(held);
    }
}

/// Send all of `bytes` on the ring, within the write timeout.
async fn send_cipher(
    conn: &Conn,
    bytes: Vec<u8>,
    deadline: &mut Option<Deadline>,
) -> Result<(), String> {
    let mut pending = Cipher { bytes, sent: 0 };
    while pending.sent < pending.bytes.len() {
        let send = conn.reactor.send_owned(conn.stream.raw_fd(), pending);
        let outcome = match deadline {
            None => Some(send.await),
            Some(deadline) => deadline.run(send).await,
        };
        match outcome {
            None => return Err("the client stopped reading replies (write timeout)".into()),
            Some((Ok(0), _)) => return Err("the client's socket took no bytes".into()),
            Some((Ok(n), back)) => {
                pending = back;
                pending.sent += n;
            }
            Some((Err(e), back))
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
                ) =>
            {
                pending = back
            }
            Some((Err(e), _)) => return Err(format!("reply write failed: {e}")),
        }
    }
    Ok(())
}

/// Ciphertext being sent; the first `sent` bytes are out.
struct Cipher {
    bytes: Vec<u8>,
    sent: usize,
}

// SAFETY: the bytes are the Vec's heap buffer, owned by the value and not
// changed while it lives.
unsafe impl cairn_io::StableBufs for Cipher {
    fn iovecs(&self) -> Vec<libc::iovec> {
        vec![libc::iovec {
            iov_base: self.bytes[self.sent..].as_ptr() as *mut libc::c_void,
            iov_len: self.bytes.len() - self.sent,
        }]
    }
}
