//! One connection: the reader thread's loop, and the writer half that
//! workers reply through.

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::listener::Stream;
use super::pool::Job;
use super::{lock, Shared};
use crate::codec::reply::{encode_error, read_prefix_bytes};
use crate::codec::{
    decode_request, Command, Negotiation, NegotiationStep, ProtocolError, RequestAction,
    RequestDecode, Session,
};
use crate::proto;

/// Bytes asked of the kernel per read; several small requests usually
/// arrive in one go.
const READ_CHUNK_BYTES: usize = 64 * 1024;

/// The reply side of a connection, shared by its reader and the workers.
pub(crate) struct ConnWriter {
    id: u64,
    writer: Mutex<Stream>,
    broken: AtomicBool,
    in_flight: Mutex<usize>,
    in_flight_changed: Condvar,
}

impl ConnWriter {
    fn new(id: u64, writer: Stream) -> Self {
        ConnWriter {
            id,
            writer: Mutex::new(writer),
            broken: AtomicBool::new(false),
            in_flight: Mutex::new(0),
            in_flight_changed: Condvar::new(),
        }
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Write one whole message. After any failure the connection is dead:
    /// both directions are shut so the reader wakes up and ends.
    pub(crate) fn send(&self, bytes: &[u8]) -> bool {
        if self.broken.load(Ordering::SeqCst) {
            return false;
        }
        let mut w = lock(&self.writer);
        if self.broken.load(Ordering::SeqCst) {
            return false;
        }
        match w.write_all(bytes) {
            Ok(()) => true,
            Err(e) => {
                self.broken.store(true, Ordering::SeqCst);
                tracing::debug!(conn = self.id, error = %e, "reply write failed; closing connection");
                w.shutdown(Shutdown::Both);
                false
            }
        }
    }

    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    /// Take an in-flight slot, waiting while the connection is at its
    /// limit. The reader does not read meanwhile: that is the backpressure.
    fn acquire_slot(&self, max: usize) {
        let mut n = lock(&self.in_flight);
        while *n >= max {
            n = self
                .in_flight_changed
                .wait(n)
                .unwrap_or_else(|e| e.into_inner());
        }
        *n += 1;
    }

    pub(crate) fn in_flight(&self) -> usize {
        *lock(&self.in_flight)
    }

    pub(crate) fn release_slot(&self) {
        let mut n = lock(&self.in_flight);
        debug_assert!(*n > 0);
        *n = n.saturating_sub(1);
        drop(n);
        self.in_flight_changed.notify_all();
    }

    fn wait_idle(&self) {
        let mut n = lock(&self.in_flight);
        while *n > 0 {
            n = self
                .in_flight_changed
                .wait(n)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Why a connection ended.
#[derive(Debug)]
enum End {
    /// EOF between messages.
    ClientClosed,
    /// NBD_CMD_DISC.
    Disconnect,
    /// NBD_OPT_ABORT.
    Aborted,
    /// EOF inside a message (header or payload).
    MidMessage,
    Protocol(ProtocolError),
    HandshakeTimeout,
    WriteFailed,
    Io(io::Error),
    /// The worker pool is gone (server stopping).
    Stopping,
}

/// Serve one client until it leaves, misbehaves, or the server stops.
pub(crate) fn run(shared: &Arc<Shared>, id: u64, mut stream: Stream, jobs: SyncSender<Job>) {
    let peer = stream.peer();
    let writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(conn = id, error = %e, "cannot clone client socket");
            return;
        }
    };
    if shared.config.write_timeout_ms > 0 {
        let t = Duration::from_millis(shared.config.write_timeout_ms);
        if let Err(e) = writer.set_write_timeout(Some(t)) {
            tracing::warn!(conn = id, error = %e, "cannot set write timeout");
        }
    }
    let conn = Arc::new(ConnWriter::new(id, writer));
    tracing::info!(conn = id, %peer, "client connected");

    let mut input = InBuf::new();
    let end = match negotiate(shared, &conn, &mut stream, &mut input) {
        Ok(session) => {
            tracing::debug!(conn = id, ?session, "entered transmission");
            if let Err(e) = stream.set_read_timeout(None) {
                tracing::warn!(conn = id, error = %e, "cannot clear read timeout");
            }
            input.shrink();
            transmit(shared, &conn, &mut stream, &mut input, &session, &jobs)
        }
        Err(end) => end,
    };
    drop(jobs);

    match &end {
        End::Protocol(e) => {
            shared
                .counters
                .protocol_errors
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(conn = id, %peer, error = %e, "protocol violation; disconnecting client");
        }
        End::HandshakeTimeout => {
            tracing::warn!(conn = id, %peer, "handshake timed out; disconnecting client");
        }
        End::Io(e) => tracing::warn!(conn = id, %peer, error = %e, "connection I/O error"),
        End::MidMessage => {
            tracing::info!(conn = id, "client disconnected in the middle of a message")
        }
        other => tracing::info!(conn = id, reason = ?other, "client disconnected"),
    }
    // Finish what is in flight (their replies still go out if the client
    // is listening), then close.
    conn.wait_idle();
    stream.shutdown(Shutdown::Both);
}

fn negotiate(
    shared: &Shared,
    conn: &ConnWriter,
    stream: &mut Stream,
    input: &mut InBuf,
) -> Result<Session, End> {
    let mut negotiation = Negotiation::new(shared.export_info.clone(), shared.limits.clone());
    if !conn.send(&negotiation.greeting()) {
        return Err(End::WriteFailed);
    }
    let deadline = match shared.config.handshake_timeout_ms {
        0 => None,
        ms => Some(Instant::now() + Duration::from_millis(ms)),
    };
    let mut out = Vec::new();
    loop {
        out.clear();
        let step = negotiation
            .step(input.filled(), &mut out)
            .map_err(End::Protocol)?;
        if !out.is_empty() && !conn.send(&out) {
            return Err(End::WriteFailed);
        }
        match step {
            NegotiationStep::NeedMore { min_total_bytes } => {
                input.fill(stream, min_total_bytes, deadline)?
            }
            NegotiationStep::Consumed { bytes } => input.consume(bytes),
            NegotiationStep::Transmission { bytes, session } => {
                input.consume(bytes);
                return Ok(session);
            }
            NegotiationStep::Aborted { .. } => return Err(End::Aborted),
        }
    }
}

fn transmit(
    shared: &Shared,
    conn: &Arc<ConnWriter>,
    stream: &mut Stream,
    input: &mut InBuf,
    session: &Session,
    jobs: &SyncSender<Job>,
) -> End {
    let max_in_flight = shared.config.max_in_flight_per_connection;
    loop {
        if conn.is_broken() {
            return End::WriteFailed;
        }
        let decoded = match decode_request(input.filled(), session, &shared.limits) {
            Ok(d) => d,
            Err(e) => return End::Protocol(e),
        };
        let (header_bytes, action) = match decoded {
            RequestDecode::NeedMore { min_total_bytes } => {
                if let Err(end) = input.fill(stream, min_total_bytes, None) {
                    return end;
                }
                continue;
            }
            RequestDecode::Request {
                header_bytes,
                action,
            } => (header_bytes, action),
        };
        input.consume(header_bytes);
        match action {
            RequestAction::Disconnect => return End::Disconnect,
            RequestAction::Reject {
                reply_to,
                errno,
                message,
                discard_bytes,
            } => {
                tracing::debug!(
                    conn = conn.id(),
                    command = proto::command_name(reply_to.command),
                    offset = reply_to.offset,
                    errno,
                    message,
                    "request rejected"
                );
                if let Err(end) = input.skip(stream, discard_bytes) {
                    return end;
                }
                let mut out = Vec::with_capacity(64 + message.len());
                encode_error(&mut out, session.mode, reply_to, errno, message);
                if !conn.send(&out) {
                    return End::WriteFailed;
                }
            }
            RequestAction::Execute(request) => {
                conn.acquire_slot(max_in_flight);
                let payload_bytes = request.payload_bytes();
                let budget_bytes = match request.command {
                    Command::Read { length_bytes } => {
                        length_bytes as u64 + read_prefix_bytes(session.mode) as u64
                    }
                    _ => payload_bytes,
                };
                shared.budget.acquire(budget_bytes);
                let payload = match input.read_payload(stream, payload_bytes) {
                    Ok(p) => p,
                    Err(end) => {
                        shared.budget.release(budget_bytes);
                        conn.release_slot();
                        return end;
                    }
                };
                let job = Job {
                    conn: conn.clone(),
                    request,
                    mode: session.mode,
                    payload,
                    budget_bytes,
                };
                // Nothing else in flight and nothing more pipelined: the
                // client is waiting for this reply, so run it here instead
                // of handing it to a worker and back.
                if conn.in_flight() == 1 && input.len() == 0 {
                    super::pool::execute(shared, job);
                    continue;
                }
                if jobs.send(job).is_err() {
                    shared.budget.release(budget_bytes);
                    conn.release_slot();
                    return End::Stopping;
                }
            }
        }
    }
}

/// The reader's input buffer: bytes `start..end` of `data` are unparsed.
struct InBuf {
    data: Vec<u8>,
    start: usize,
    end: usize,
}

impl InBuf {
    fn new() -> Self {
        InBuf {
            data: vec![0u8; READ_CHUNK_BYTES],
            start: 0,
            end: 0,
        }
    }

    fn filled(&self) -> &[u8] {
        &self.data[self.start..self.end]
    }

    fn len(&self) -> usize {
        self.end - self.start
    }

    fn consume(&mut self, n: usize) {
        debug_assert!(n <= self.len());
        self.start += n.min(self.len());
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Drop capacity grown for a large option once negotiation is over.
    fn shrink(&mut self) {
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

    /// Read until at least `min_total` bytes are buffered. The caller has
    /// checked `min_total` against the limits.
    fn fill(
        &mut self,
        stream: &mut Stream,
        min_total: usize,
        deadline: Option<Instant>,
    ) -> Result<(), End> {
        while self.len() < min_total {
            if self.data.len() - self.start < min_total || self.end == self.data.len() {
                self.compact();
            }
            if self.data.len() < min_total {
                self.data.resize(min_total.max(READ_CHUNK_BYTES), 0);
            }
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
                Ok(0) => {
                    return Err(if self.len() == 0 {
                        End::ClientClosed
                    } else {
                        End::MidMessage
                    })
                }
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

    /// Read `length` payload bytes (already checked against the payload
    /// limit), taking what is buffered first.
    fn read_payload(&mut self, stream: &mut Stream, length: u64) -> Result<Vec<u8>, End> {
        if length == 0 {
            return Ok(Vec::new());
        }
        let length = length as usize;
        let mut payload = vec![0u8; length];
        let have = self.len().min(length);
        payload[..have].copy_from_slice(&self.filled()[..have]);
        self.consume(have);
        let mut done = have;
        while done < length {
            match stream.read(&mut payload[done..]) {
                Ok(0) => return Err(End::MidMessage),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(End::Io(e)),
            }
        }
        Ok(payload)
    }

    /// Read and drop `length` bytes of an unwanted payload.
    fn skip(&mut self, stream: &mut Stream, mut length: u64) -> Result<(), End> {
        while length > 0 {
            if self.len() == 0 {
                self.fill(stream, 1, None).map_err(|end| match end {
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
