//! The connection's replies: queued by the request tasks as they finish,
//! in any order, and written by one writer task with `writev`, as many as
//! are ready at once. A reply is never split by another. The socket is
//! non-blocking; a client that stops reading gets `write_timeout_ms` before
//! the connection is dropped.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::io::{self, Write};
use std::net::Shutdown;
use std::rc::Rc;
use std::time::Duration;

use cairn_io::LocalNotify;

use super::Conn;
use crate::export::ReadBuffer;

/// Most buffers in one `writev` (the kernel's IOV_MAX is 1024).
const IOVECS_MAX: usize = 1024;

/// One reply: its bytes, or a read reply's header and data.
pub(super) enum Reply {
    Bytes(Vec<u8>),
    Data { header: Vec<u8>, data: ReadBuffer },
}

impl Reply {
    fn pieces(&self) -> [&[u8]; 2] {
        match self {
            Reply::Bytes(bytes) => [bytes, &[]],
            Reply::Data { header, data } => [header, (**data).as_ref()],
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

    /// Write what is queued, as much as the socket takes; `Ok(false)` when
    /// it is full.
    fn write_some(&self, conn: &Conn) -> io::Result<bool> {
        let written = {
            let queue = self.queue.borrow();
            self.write_queued(conn, &queue)
        };
        match written {
            Ok(Some(n)) => {
                self.advance(n);
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(e),
        }
    }

    /// One `writev` of what is queued: the bytes it took, or `None` when
    /// the socket is full.
    fn write_queued(&self, conn: &Conn, queue: &VecDeque<Reply>) -> io::Result<Option<usize>> {
        let mut slices: Vec<io::IoSlice<'_>> = Vec::with_capacity(queue.len().min(IOVECS_MAX) * 2);
        let mut skip = self.front_written.get();
        'gather: for reply in queue.iter() {
            for piece in reply.pieces() {
                if skip >= piece.len() {
                    skip -= piece.len();
                    continue;
                }
                slices.push(io::IoSlice::new(&piece[skip..]));
                skip = 0;
                if slices.len() == IOVECS_MAX {
                    break 'gather;
                }
            }
        }
        match (&conn.stream).write_vectored(&slices) {
            Ok(0) => Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `written` more bytes left: drop the replies fully written.
    fn advance(&self, mut written: usize) {
        let mut queue = self.queue.borrow_mut();
        let mut front = self.front_written.get();
        while let Some(reply) = queue.front() {
            let left = reply.len() - front;
            if written < left {
                front += written;
                break;
            }
            written -= left;
            front = 0;
            queue.pop_front();
        }
        self.front_written.set(front);
    }
}

/// The writer task: write replies as they are queued until the output is
/// closed and empty, or the socket fails.
pub(super) async fn writer(conn: Rc<Conn>) {
    let output = &conn.output;
    let timeout = match conn.shared.config.write_timeout_ms {
        0 => None,
        ms => Some(Duration::from_millis(ms)),
    };
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
        match output.write_some(&conn) {
            Ok(true) => {}
            Ok(false) => {
                if !conn.writable(timeout).await {
                    output.fail(&conn, "the client stopped reading replies (write timeout)");
                    return;
                }
            }
            Err(e) => {
                output.fail(&conn, &format!("reply write failed: {e}"));
                return;
            }
        }
    }
}
