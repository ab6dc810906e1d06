//! The worker pool shared by all connections, and the byte budget that
//! bounds buffered payloads.

use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use super::conn::ConnWriter;
use super::{lock, Shared};
use crate::codec::reply::{
    encode_block_status, encode_error, encode_ok, encode_read_prefix, read_prefix_bytes,
    shape_extents, Descriptor,
};
use crate::codec::{Command, ReplyMode, Request, BASE_ALLOCATION_ID};
use crate::export::{Export, ExportError};
use crate::proto::{self, errno_to_nbd};

/// One validated request handed from a reader to a worker.
pub(crate) struct Job {
    pub conn: Arc<ConnWriter>,
    pub request: Request,
    pub mode: ReplyMode,
    /// The write payload (empty for other commands).
    pub payload: Vec<u8>,
    /// Bytes charged to the budget for this job, returned when it is done.
    pub budget_bytes: u64,
}

/// What a reader hands to the pool: one request, or several reads of one
/// connection that arrived together and are served as one batch.
pub(crate) enum Task {
    One(Job),
    Reads(Vec<Job>),
}

pub(crate) struct Pool {
    sender: SyncSender<Task>,
    fan_out: Arc<FanOut>,
    workers: Vec<JoinHandle<()>>,
}

impl Pool {
    pub(crate) fn start(count: usize, shared: Arc<Shared>) -> io::Result<Pool> {
        // A short queue: readers are already bounded per connection, and a
        // full queue just makes them wait (more backpressure).
        let (sender, receiver) = sync_channel::<Task>(count * 4);
        let receiver = Arc::new(Mutex::new(receiver));
        let fan_out = Arc::new(FanOut::new(sender.clone()));
        let mut workers = Vec::with_capacity(count);
        for i in 0..count {
            let receiver = receiver.clone();
            let shared = shared.clone();
            let worker_fan_out = fan_out.clone();
            let handle = std::thread::Builder::new()
                .name(format!("nbd-worker-{i}"))
                .spawn(move || worker_loop(&shared, &receiver, &worker_fan_out));
            match handle {
                Ok(h) => workers.push(h),
                Err(e) => {
                    drop(sender);
                    lock(&fan_out.sender).take();
                    for w in workers {
                        let _ = w.join();
                    }
                    return Err(e);
                }
            }
        }
        Ok(Pool {
            sender,
            fan_out,
            workers,
        })
    }

    pub(crate) fn sender(&self) -> SyncSender<Task> {
        self.sender.clone()
    }

    /// Close the queue and wait for the workers to finish what is queued.
    pub(crate) fn stop(self) {
        drop(self.sender);
        lock(&self.fan_out.sender).take();
        for w in self.workers {
            if w.join().is_err() {
                tracing::error!("an NBD worker thread panicked");
            }
        }
    }
}

fn worker_loop(shared: &Shared, receiver: &Mutex<Receiver<Task>>, fan_out: &FanOut) {
    loop {
        // Holding the lock while blocked in recv is fine: the other idle
        // workers would be blocked anyway.
        let task = match lock(receiver).recv() {
            Ok(task) => task,
            Err(_) => return, // every sender is gone: the server is stopping
        };
        match task {
            Task::One(job) => execute(shared, job),
            Task::Reads(jobs) => execute_reads(shared, jobs, fan_out),
        }
    }
}

/// Run a batch of reads of one connection: the quick ones (for a cache,
/// the cached ones) with one `Export::read_quick_many` call, their replies
/// sent with one write; then the others, each as its own job, handed to a
/// worker through `fan_out` when there is room in the queue, so a slow
/// read neither holds up the quick ones nor the other slow ones. Called by
/// the workers, and inline by the reader when the batch is all that is in
/// flight on its connection.
pub(crate) fn execute_reads(shared: &Shared, jobs: Vec<Job>, fan_out: &FanOut) {
    let Some(first) = jobs.first() else {
        return;
    };
    let conn = first.conn.clone();
    let mode = first.mode;
    let prefix = read_prefix_bytes(mode);
    let mut total_bytes = 0usize;
    for job in &jobs {
        assert!(read_length(job) > 0, "empty reads are not batched");
        assert!(
            Arc::ptr_eq(&job.conn, &conn) && job.mode == mode,
            "one connection per batch"
        );
        total_bytes += prefix + read_length(job) as usize;
    }
    // Every reply is laid out in one buffer: header, data, header, data...
    // so the served replies leave in one write with no copy.
    let mut out = vec![0u8; total_bytes];
    let mut results: Vec<Option<Result<(), ExportError>>> = (0..jobs.len()).map(|_| None).collect();
    let export: &dyn Export = &*shared.export;
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let mut requests: Vec<(u64, &mut [u8])> = Vec::with_capacity(jobs.len());
        let mut rest: &mut [u8] = &mut out;
        for job in &jobs {
            let (reply, tail) =
                std::mem::take(&mut rest).split_at_mut(prefix + read_length(job) as usize);
            rest = tail;
            requests.push((job.request.offset, &mut reply[prefix..]));
        }
        export.read_quick_many(&mut requests, &mut results);
    }));
    if outcome.is_err() {
        fail_reads_after_panic(shared, &conn, mode, &jobs);
        return;
    }
    send_served_replies(&conn, mode, &jobs, &results, &mut out);
    let mut deferred = Vec::new();
    let mut served = 0u64;
    for (job, result) in jobs.into_iter().zip(&results) {
        if result.is_some() {
            served += 1;
            shared.budget.release(job.budget_bytes);
            conn.release_slot();
        } else {
            deferred.push(job);
        }
    }
    drop(out);
    shared
        .counters
        .requests
        .fetch_add(served, Ordering::Relaxed);
    // The rest, one job each: to idle workers if the queue has room (never
    // waiting for it: this may be a worker), else here.
    let mut inline = Vec::new();
    for job in deferred {
        match fan_out.try_send(Task::One(job)) {
            Ok(()) => {}
            Err(Task::One(job)) => inline.push(job),
            Err(Task::Reads(_)) => unreachable!("sent a single job"),
        }
    }
    for job in inline {
        execute(shared, job);
    }
}

/// The length of a job of a read batch.
fn read_length(job: &Job) -> u32 {
    match job.request.command {
        Command::Read { length_bytes } => length_bytes,
        _ => unreachable!("a read batch holds only reads"),
    }
}

/// `read_quick_many` panicked: every read of the batch gets EIO.
fn fail_reads_after_panic(shared: &Shared, conn: &ConnWriter, mode: ReplyMode, jobs: &[Job]) {
    tracing::error!(
        conn = conn.id(),
        reads = jobs.len(),
        "export read_quick_many panicked"
    );
    for job in jobs {
        let mut reply = Vec::new();
        encode_error(
            &mut reply,
            mode,
            job.request.reply_to,
            proto::NBD_EIO,
            "internal server error",
        );
        conn.send(&reply);
    }
    shared
        .counters
        .requests
        .fetch_add(jobs.len() as u64, Ordering::Relaxed);
    for job in jobs {
        shared.budget.release(job.budget_bytes);
        conn.release_slot();
    }
}

/// Send the replies of the reads `read_quick_many` served (its result is
/// `Some`), in one write: the successful ones straight from `out`, where
/// each reply has its header in front of its data.
fn send_served_replies(
    conn: &ConnWriter,
    mode: ReplyMode,
    jobs: &[Job],
    results: &[Option<Result<(), ExportError>>],
    out: &mut [u8],
) {
    let prefix = read_prefix_bytes(mode);
    let mut pieces: Vec<&[u8]> = Vec::with_capacity(jobs.len());
    let mut error_replies: Vec<Vec<u8>> = Vec::new();
    {
        let mut at = 0usize;
        let mut spans: Vec<(usize, usize)> = Vec::with_capacity(jobs.len());
        for (job, result) in jobs.iter().zip(results) {
            let len = prefix + read_length(job) as usize;
            match result {
                Some(Ok(())) => {
                    encode_read_prefix(
                        &mut out[at..at + prefix],
                        mode,
                        job.request.reply_to,
                        read_length(job),
                    );
                    // Adjacent replies are sent as one piece.
                    match spans.last_mut() {
                        Some((_, end)) if *end == at => *end = at + len,
                        _ => spans.push((at, at + len)),
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(conn = conn.id(), command = "READ", offset = job.request.offset, error = %e, "export operation failed");
                    let mut reply = Vec::with_capacity(64 + e.message.len());
                    encode_error(
                        &mut reply,
                        mode,
                        job.request.reply_to,
                        errno_to_nbd(e.errno),
                        &e.message,
                    );
                    error_replies.push(reply);
                }
                None => {}
            }
            at += len;
        }
        for &(start, end) in &spans {
            pieces.push(&out[start..end]);
        }
    }
    for reply in &error_replies {
        pieces.push(reply);
    }
    if !pieces.is_empty() {
        conn.send_all(&pieces);
    }
}

/// A way for a worker (or a reader) to queue jobs without waiting and
/// without keeping the pool alive: the pool drops the sender when it stops.
pub(crate) struct FanOut {
    sender: Mutex<Option<SyncSender<Task>>>,
}

impl FanOut {
    pub(crate) fn new(sender: SyncSender<Task>) -> FanOut {
        FanOut {
            sender: Mutex::new(Some(sender)),
        }
    }

    /// Queue `task` if the pool runs and its queue has room; hand it back
    /// otherwise.
    pub(crate) fn try_send(&self, task: Task) -> Result<(), Task> {
        let guard = lock(&self.sender);
        let Some(sender) = guard.as_ref() else {
            return Err(task);
        };
        sender.try_send(task).map_err(|e| match e {
            TrySendError::Full(task) | TrySendError::Disconnected(task) => task,
        })
    }
}

/// Run one job and send its reply, releasing its budget and slot. Called by
/// the workers, and inline by a connection's reader when the request is the
/// only one in flight (a queue-depth-1 client): two thread hand-offs saved.
pub(crate) fn execute(shared: &Shared, job: Job) {
    let conn = job.conn.clone();
    let budget_bytes = job.budget_bytes;
    let to = job.request.reply_to;
    let mode = job.mode;
    if catch_unwind(AssertUnwindSafe(|| run_job(shared, job))).is_err() {
        tracing::error!(
            conn = conn.id(),
            command = proto::command_name(to.command),
            "export call panicked"
        );
        let mut out = Vec::new();
        encode_error(&mut out, mode, to, proto::NBD_EIO, "internal server error");
        conn.send(&out);
    }
    shared.budget.release(budget_bytes);
    conn.release_slot();
}

fn run_job(shared: &Shared, job: Job) {
    let export: &dyn Export = &*shared.export;
    let Job {
        conn,
        request,
        mode,
        payload,
        ..
    } = job;
    let to = request.reply_to;
    let offset = request.offset;
    shared.counters.requests.fetch_add(1, Ordering::Relaxed);

    let result: Result<Option<Vec<u8>>, ExportError> = match request.command {
        Command::Read { length_bytes: 0 } => Ok(None),
        Command::Read { length_bytes } => {
            let prefix = read_prefix_bytes(mode);
            let mut buf = vec![0u8; prefix + length_bytes as usize];
            match export.read(offset, &mut buf[prefix..]) {
                Ok(()) => {
                    // Header and data leave in one write, no copy.
                    encode_read_prefix(&mut buf[..prefix], mode, to, length_bytes);
                    Ok(Some(buf))
                }
                Err(e) => Err(e),
            }
        }
        Command::Write {
            length_bytes: 0, ..
        } => Ok(None),
        Command::Write { fua, .. } => export.write(offset, &payload, fua).map(|()| None),
        Command::Flush => export.flush().map(|()| None),
        Command::Trim {
            length_bytes: 0, ..
        } => Ok(None),
        Command::Trim { length_bytes, fua } => export
            .trim(offset, length_bytes)
            .and_then(|()| if fua { export.flush() } else { Ok(()) })
            .map(|()| None),
        Command::WriteZeroes {
            length_bytes: 0, ..
        } => Ok(None),
        Command::WriteZeroes {
            length_bytes,
            fua,
            may_trim,
            fast_only,
        } => export
            .write_zeroes(offset, length_bytes, may_trim, fast_only)
            .and_then(|()| if fua { export.flush() } else { Ok(()) })
            .map(|()| None),
        Command::Cache { length_bytes: 0 } => Ok(None),
        Command::Cache { length_bytes } => export.cache(offset, length_bytes).map(|()| None),
        Command::BlockStatus {
            length_bytes,
            req_one,
        } => block_status(shared, mode, &request, length_bytes, req_one).map(Some),
    };

    let reply = match result {
        Ok(Some(bytes)) => bytes,
        Ok(None) => {
            let mut out = Vec::with_capacity(40);
            encode_ok(&mut out, mode, to);
            out
        }
        Err(e) => {
            let command = proto::command_name(to.command);
            if e.errno == libc::ENOTSUP {
                tracing::debug!(conn = conn.id(), command, offset, error = %e, "export refused");
            } else {
                tracing::warn!(conn = conn.id(), command, offset, error = %e, "export operation failed");
            }
            let mut out = Vec::with_capacity(64 + e.message.len());
            encode_error(&mut out, mode, to, errno_to_nbd(e.errno), &e.message);
            out
        }
    };
    conn.send(&reply);
}

fn block_status(
    shared: &Shared,
    mode: ReplyMode,
    request: &Request,
    length_bytes: u64,
    req_one: bool,
) -> Result<Vec<u8>, ExportError> {
    let size = shared.export_info.size_bytes;
    let min_block = shared.export_info.block_sizes.min_bytes.max(1) as u64;
    // Answering less than asked is allowed; capping the query bounds the
    // work one request can ask of the export (a full-size 64-bit request
    // is legal with extended headers).
    let cap = (u32::MAX as u64) & !(min_block - 1);
    let query = length_bytes.min(size - request.offset).min(cap);
    let extents = shared.export.block_status(request.offset, query)?;
    let reported = extents.iter().map(|extent| Descriptor {
        length_bytes: extent.length,
        flags: extent.kind.allocation_flags(),
    });
    let descriptors = shape_extents(
        reported,
        query,
        req_one,
        shared.limits.max_block_status_extents,
    )
    .map_err(ExportError::io)?;
    let mut out = Vec::with_capacity(48 + 16 * descriptors.len());
    encode_block_status(
        &mut out,
        mode,
        request.reply_to,
        BASE_ALLOCATION_ID,
        &descriptors,
    );
    Ok(out)
}

/// A counting semaphore over bytes: readers take what a request's buffers
/// need before queueing it, workers give it back after replying.
pub(crate) struct ByteBudget {
    state: Mutex<Budget>,
    changed: Condvar,
}

struct Budget {
    available: u64,
    /// Readers blocked in `acquire`: only then does `release` notify (a
    /// notify is a system call even with nobody waiting).
    waiters: usize,
}

impl ByteBudget {
    pub(crate) fn new(total_bytes: u64) -> Self {
        ByteBudget {
            state: Mutex::new(Budget {
                available: total_bytes,
                waiters: 0,
            }),
            changed: Condvar::new(),
        }
    }

    /// Block until `bytes` are available and take them. `bytes` never
    /// exceeds the total (config validation guarantees it).
    pub(crate) fn acquire(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let mut state = lock(&self.state);
        while state.available < bytes {
            state.waiters += 1;
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
            state.waiters -= 1;
        }
        state.available -= bytes;
    }

    /// Take `bytes` if they are available now, without waiting.
    pub(crate) fn try_acquire(&self, bytes: u64) -> bool {
        if bytes == 0 {
            return true;
        }
        let mut state = lock(&self.state);
        if state.available < bytes {
            return false;
        }
        state.available -= bytes;
        true
    }

    pub(crate) fn release(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let mut state = lock(&self.state);
        state.available += bytes;
        let wake = state.waiters > 0;
        drop(state);
        if wake {
            self.changed.notify_all();
        }
    }
}
