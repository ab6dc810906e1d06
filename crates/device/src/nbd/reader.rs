//! The table of requests in flight on one connection, and the reader
//! thread that completes them: it matches each reply to its request by
//! cookie, and fails whatever is left when the connection ends.

use std::collections::HashMap;
use std::io::{self, Read};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::Waker;

use cairn_nbd_proto::codec::reply::decode_simple_reply;
use cairn_nbd_proto::codec::wire::SIMPLE_REPLY_BYTES;
use cairn_nbd_proto::codec::ReplyError;
use cairn_nbd_proto::proto::{nbd_to_errno, NBD_ESHUTDOWN, STRUCTURED_REPLY_MAGIC};

use super::batch::Batch;
use super::transport::Stream;

/// Where the reply to one request goes.
pub(super) struct Pending {
    pub batch: Arc<Batch>,
    pub index: usize,
    /// Bytes of data that follow a successful reply (reads only).
    pub read_len: usize,
}

pub(super) struct ConnState {
    /// Why the connection is unusable; `None` while it works.
    pub dead: Option<String>,
    /// Closed on purpose while it worked (a disconnect request is sent):
    /// shut down gracefully, so the request reaches the server. Any other
    /// end resets the connection (`Stream::abort`).
    pub closing: bool,
    pub pending: HashMap<u64, Pending>,
    pub in_flight: usize,
    /// Tasks waiting for a free slot in the window.
    pub window_waiters: Vec<Waker>,
}

/// What the callers of a connection and its reader thread share.
pub(super) struct ConnShared {
    state: Mutex<ConnState>,
    /// Signalled when a request leaves flight or the connection dies.
    pub window: Condvar,
}

impl ConnShared {
    pub fn new() -> ConnShared {
        ConnShared {
            state: Mutex::new(ConnState {
                dead: None,
                closing: false,
                pending: HashMap::new(),
                in_flight: 0,
                window_waiters: Vec::new(),
            }),
            window: Condvar::new(),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, ConnState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot left the window (or the connection died): wake the threads
    /// and the tasks waiting for one.
    pub fn window_changed(&self, all: bool) {
        let waiters = std::mem::take(&mut self.lock().window_waiters);
        if all {
            self.window.notify_all();
        } else {
            self.window.notify_one();
        }
        for waker in waiters {
            waker.wake();
        }
    }
}

pub(super) fn nbd_error(error: u32) -> io::Error {
    // Kept as a raw OS error so callers can tell ENOSPC from EIO.
    io::Error::from_raw_os_error(nbd_to_errno(error))
}

/// The reader thread: complete requests until the connection ends, then
/// fail the ones still in flight.
pub(super) fn reader_loop(mut stream: Stream, shared: Arc<ConnShared>) {
    let reason = loop {
        if let Err(reason) = read_reply(&mut stream, &shared) {
            break reason;
        }
    };
    if fail_in_flight(&shared, reason) {
        stream.shutdown();
    } else {
        // A broken reply, a lost server or a kill: nothing still queued to
        // send may reach it later.
        if let Err(e) = stream.abort() {
            tracing::warn!(error = %e, "resetting a failed NBD connection failed: requests not yet sent may still reach the server");
        }
    }
}

/// Read one reply and complete its request; `Err` with the reason when the
/// connection cannot go on.
fn read_reply(stream: &mut Stream, shared: &ConnShared) -> Result<(), String> {
    let mut header = [0u8; SIMPLE_REPLY_BYTES];
    if let Err(err) = stream.read_exact(&mut header) {
        return Err(format!("connection lost: {err}"));
    }
    let reply = match decode_simple_reply(&header) {
        Ok(reply) => reply,
        Err(ReplyError::BadReplyMagic {
            magic: STRUCTURED_REPLY_MAGIC,
        }) => return Err("protocol error: structured reply that was never negotiated".to_string()),
        Err(err) => return Err(format!("protocol error: {err}")),
    };
    let cookie = reply.cookie;
    let pending = {
        let mut state = shared.lock();
        let pending = state.pending.remove(&cookie);
        if pending.is_some() {
            state.in_flight -= 1;
        }
        pending
    };
    shared.window_changed(false);
    let Some(pending) = pending else {
        // We cannot know how much data would follow: the stream is lost.
        return Err(format!("protocol error: reply for unknown cookie {cookie}"));
    };
    if reply.error != 0 {
        pending
            .batch
            .complete(pending.index, Err(nbd_error(reply.error)));
        if reply.error == NBD_ESHUTDOWN {
            return Err("the server is shutting down".to_string());
        }
        return Ok(());
    }
    if pending.read_len == 0 {
        pending.batch.complete(pending.index, Ok(None));
        return Ok(());
    }
    let mut data = vec![0u8; pending.read_len];
    match stream.read_exact(&mut data) {
        Ok(()) => {
            pending.batch.complete(pending.index, Ok(Some(data)));
            Ok(())
        }
        Err(err) => {
            let reason = format!("connection lost during a read reply: {err}");
            pending.batch.complete(
                pending.index,
                Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    reason.clone(),
                )),
            );
            Err(reason)
        }
    }
}

/// Mark the connection dead (keeping an earlier reason) and fail every
/// request still in flight with that reason. Returns whether it was closed
/// on purpose (then it ends gracefully).
fn fail_in_flight(shared: &ConnShared, reason: String) -> bool {
    let (orphans, closing): (Vec<Pending>, bool) = {
        let mut state = shared.lock();
        let reason = state.dead.get_or_insert(reason).clone();
        tracing::debug!("nbd connection closed: {reason}");
        state.in_flight = 0;
        (
            state.pending.drain().map(|(_, p)| p).collect(),
            state.closing,
        )
    };
    shared.window_changed(true);
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
    closing
}
