//! One connection: the reader thread's loop, and the writer half that
//! workers reply through.

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::listener::Stream;
use super::pool::{FanOut, Job, Task};
use super::{lock, Shared};
use crate::codec::reply::{encode_error, read_prefix_bytes};
use crate::codec::{
    decode_request, Command, Negotiation, NegotiationStep, ProtocolError, Request, RequestAction,
    RequestDecode, Session,
};
use crate::proto;

/// Bytes asked of the kernel per read; several small requests usually
/// arrive in one go.
const READ_CHUNK_BYTES: usize = 64 * 1024;

/// Most reads served as one batch (one `Export::read_quick_many` call, one
/// reply write). The per-connection in-flight limit bounds it too.
const READ_BATCH_MAX: usize = 64;

/// The reply side of a connection, shared by its reader and the workers.
pub(crate) struct ConnWriter {
    id: u64,
    writer: Mutex<Stream>,
    broken: AtomicBool,
    in_flight: Mutex<Slots>,
    in_flight_changed: Condvar,
}

impl ConnWriter {
    fn new(id: u64, writer: Stream) -> Self {
        ConnWriter {
            id,
            writer: Mutex::new(writer),
            broken: AtomicBool::new(false),
            in_flight: Mutex::new(Slots::default()),
            in_flight_changed: Condvar::new(),
        }
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Write one whole message. After any failure the connection is dead:
    /// both directions are shut so the reader wakes up and ends.
    pub(crate) fn send(&self, bytes: &[u8]) -> bool {
        self.write_with(|w| w.write_all(bytes))
    }

    /// Write several pieces as one message (one system call when the
    /// socket takes it all), with [`ConnWriter::send`]'s failure handling.
    pub(crate) fn send_all(&self, pieces: &[&[u8]]) -> bool {
        if pieces.len() == 1 {
            return self.send(pieces[0]);
        }
        self.write_with(|w| write_all_vectored(w, pieces))
    }

    /// Run one write under the writer lock. A failed write marks the
    /// connection broken and shuts the socket, so later replies fail fast.
    fn write_with(&self, write: impl FnOnce(&mut Stream) -> io::Result<()>) -> bool {
        if self.broken.load(Ordering::SeqCst) {
            return false;
        }
        let mut w = lock(&self.writer);
        if self.broken.load(Ordering::SeqCst) {
            return false;
        }
        match write(&mut w) {
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
        let mut slots = lock(&self.in_flight);
        while slots.used >= max {
            slots.waiters += 1;
            slots = self
                .in_flight_changed
                .wait(slots)
                .unwrap_or_else(|e| e.into_inner());
            slots.waiters -= 1;
        }
        slots.used += 1;
    }

    /// Take an in-flight slot if one is free now, without waiting.
    fn try_acquire_slot(&self, max: usize) -> bool {
        let mut slots = lock(&self.in_flight);
        if slots.used >= max {
            return false;
        }
        slots.used += 1;
        true
    }

    pub(crate) fn in_flight(&self) -> usize {
        lock(&self.in_flight).used
    }

    pub(crate) fn release_slot(&self) {
        let mut slots = lock(&self.in_flight);
        debug_assert!(slots.used > 0);
        slots.used = slots.used.saturating_sub(1);
        // A notify is a system call even with nobody waiting: only wake
        // when someone is (the reader at its limit, or at the end).
        let wake = slots.waiters > 0;
        drop(slots);
        if wake {
            self.in_flight_changed.notify_all();
        }
    }

    fn wait_idle(&self) {
        let mut slots = lock(&self.in_flight);
        while slots.used > 0 {
            slots.waiters += 1;
            slots = self
                .in_flight_changed
                .wait(slots)
                .unwrap_or_else(|e| e.into_inner());
            slots.waiters -= 1;
        }
    }
}

/// In-flight requests of a connection, and threads waiting for one to end.
#[derive(Default)]
struct Slots {
    used: usize,
    waiters: usize,
}

/// `write_all` for several buffers, with `writev` (at most 1024 at a time).
fn write_all_vectored(w: &mut Stream, pieces: &[&[u8]]) -> io::Result<()> {
    let mut index = 0usize; // first piece not completely written
    let mut skip = 0usize; // bytes of it already written
    while index < pieces.len() {
        let mut slices: Vec<io::IoSlice<'_>> = Vec::with_capacity((pieces.len() - index).min(1024));
        slices.push(io::IoSlice::new(&pieces[index][skip..]));
        for piece in pieces[index + 1..].iter().take(1023) {
            slices.push(io::IoSlice::new(piece));
        }
        let mut written = match w.write_vectored(&slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        while index < pieces.len() && written >= pieces[index].len() - skip {
            written -= pieces[index].len() - skip;
            index += 1;
            skip = 0;
        }
        if index < pieces.len() {
            skip += written;
        }
    }
    Ok(())
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
pub(crate) fn run(shared: &Arc<Shared>, id: u64, mut stream: Stream, jobs: SyncSender<Task>) {
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
    jobs: &SyncSender<Task>,
) -> End {
    // Reads already parsed but not yet handed on: every read the client
    // pipelined that is already in our buffer joins one batch, served with
    // one export call and answered with one write.
    let mut reads: Vec<Job> = Vec::new();
    let fan_out = FanOut::new(jobs.clone());
    let batches = Batches {
        enabled: shared.export.has_quick_reads(),
        fan_out: &fan_out,
    };
    let end = transmit_loop(
        shared, conn, stream, input, session, jobs, &batches, &mut reads,
    );
    // Whatever ended the loop, reads taken from the client still get their
    // replies (or at least release their slots and budget).
    if dispatch_reads(shared, conn, input, jobs, &batches, &mut reads).is_err() {
        return End::Stopping;
    }
    end
}

/// Whether this connection batches reads, and how a batch run by the
/// reader hands its slow reads to the workers.
struct Batches<'a> {
    enabled: bool,
    fan_out: &'a FanOut,
}

// long: one loop that decodes, batches and dispatches requests; it goes
// away with the event-loop transmission of issue 14.
#[allow(clippy::too_many_arguments)]
fn transmit_loop(
    shared: &Shared,
    conn: &Arc<ConnWriter>,
    stream: &mut Stream,
    input: &mut InBuf,
    session: &Session,
    jobs: &SyncSender<Task>,
    batches: &Batches<'_>,
    reads: &mut Vec<Job>,
) -> End {
    let max_in_flight = shared.config.max_in_flight_per_connection;
    let stopping = |_| End::Stopping;
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
                // Nothing more is buffered: hand on the batch before
                // waiting for the client, unless more requests are already
                // on their way (then read them first: a bigger batch).
                let more_coming =
                    !reads.is_empty() && reads.len() < READ_BATCH_MAX && stream.pending_bytes() > 0;
                if !more_coming {
                    if let Err(end) =
                        dispatch_reads(shared, conn, input, jobs, batches, reads).map_err(stopping)
                    {
                        return end;
                    }
                }
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
        let batchable = batches.enabled
            && matches!(
                action,
                RequestAction::Execute(Request {
                    command: Command::Read { length_bytes },
                    ..
                }) if length_bytes > 0
            );
        if !batchable {
            // Anything else is handled in arrival order after the reads
            // before it.
            if let Err(end) =
                dispatch_reads(shared, conn, input, jobs, batches, reads).map_err(stopping)
            {
                return end;
            }
        }
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
                // Never wait for a slot or budget while holding a batch:
                // its own slots may be what we are waiting for.
                if !conn.try_acquire_slot(max_in_flight) {
                    if let Err(end) =
                        dispatch_reads(shared, conn, input, jobs, batches, reads).map_err(stopping)
                    {
                        return end;
                    }
                    conn.acquire_slot(max_in_flight);
                }
                let payload_bytes = request.payload_bytes();
                let budget_bytes = match request.command {
                    Command::Read { length_bytes } => {
                        length_bytes as u64 + read_prefix_bytes(session.mode) as u64
                    }
                    _ => payload_bytes,
                };
                if !shared.budget.try_acquire(budget_bytes) {
                    if let Err(end) =
                        dispatch_reads(shared, conn, input, jobs, batches, reads).map_err(stopping)
                    {
                        conn.release_slot();
                        return end;
                    }
                    shared.budget.acquire(budget_bytes);
                }
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
                if batchable {
                    reads.push(job);
                    if reads.len() >= READ_BATCH_MAX {
                        if let Err(end) = dispatch_reads(shared, conn, input, jobs, batches, reads)
                            .map_err(stopping)
                        {
                            return end;
                        }
                    }
                    continue;
                }
                // Nothing else in flight and nothing more pipelined (not in
                // our buffer, nor in the socket): the client is waiting for
                // this reply, so run it here instead of handing it to a
                // worker and back. A client that pipelines (a stream of
                // writes) goes to the workers, so the reader keeps reading
                // while they run; checking only our buffer ran every write
                // of a queue-depth-8 stream here, one at a time.
                if conn.in_flight() == 1 && input.len() == 0 && stream.pending_bytes() == 0 {
                    super::pool::execute(shared, job);
                    continue;
                }
                if let Err(mpsc::SendError(task)) = jobs.send(Task::One(job)) {
                    release_task(shared, task);
                    return End::Stopping;
                }
            }
        }
    }
}

/// Hand the pending reads on: run them here when they are all that is in
/// flight on this connection and nothing more is buffered (the client is
/// waiting for them, so a hand-off to a worker and back would only add two
/// context switches; measured: 2x the daemon CPU per read and no more
/// IOPS), otherwise queue them for a worker as one task. Fails only when
/// the pool is gone (the server is stopping); the reads' slots and budget
/// are released then.
fn dispatch_reads(
    shared: &Shared,
    conn: &ConnWriter,
    input: &InBuf,
    jobs: &SyncSender<Task>,
    batches: &Batches<'_>,
    reads: &mut Vec<Job>,
) -> Result<(), ()> {
    if reads.is_empty() {
        return Ok(());
    }
    let batch = std::mem::take(reads);
    let inline = conn.in_flight() == batch.len() && input.len() == 0;
    if inline {
        super::pool::execute_reads(shared, batch, batches.fan_out);
        return Ok(());
    }
    match jobs.send(Task::Reads(batch)) {
        Ok(()) => Ok(()),
        Err(mpsc::SendError(task)) => {
            release_task(shared, task);
            Err(())
        }
    }
}

/// Give back the slots and budget of a task that will never run.
fn release_task(shared: &Shared, task: Task) {
    let jobs = match task {
        Task::One(job) => vec![job],
        Task::Reads(jobs) => jobs,
    };
    for job in jobs {
        shared.budget.release(job.budget_bytes);
        job.conn.release_slot();
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
        // Not zeroed first: the bytes are copied or received straight into
        // the spare capacity (zeroing and copying 64 KiB payloads were 12%
        // of the daemon's CPU on 64 KiB writes).
        let mut payload = Vec::with_capacity(length);
        let have = self.len().min(length);
        payload.extend_from_slice(&self.filled()[..have]);
        self.consume(have);
        if have < length {
            stream
                .read_into_vec(&mut payload, (length - have) as u64)
                .map_err(End::Io)?;
            if payload.len() < length {
                return Err(End::MidMessage);
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
