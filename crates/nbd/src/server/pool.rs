//! The worker pool shared by all connections, and the byte budget that
//! bounds buffered payloads.

use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use super::conn::ConnWriter;
use super::{lock, Shared};
use crate::codec::reply::{
    encode_block_status, encode_error, encode_ok, encode_read_prefix, read_prefix_bytes,
    shape_extents,
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

pub(crate) struct Pool {
    sender: SyncSender<Job>,
    workers: Vec<JoinHandle<()>>,
}

impl Pool {
    pub(crate) fn start(count: usize, shared: Arc<Shared>) -> io::Result<Pool> {
        // A short queue: readers are already bounded per connection, and a
        // full queue just makes them wait (more backpressure).
        let (sender, receiver) = sync_channel::<Job>(count * 4);
        let receiver = Arc::new(Mutex::new(receiver));
        let mut workers = Vec::with_capacity(count);
        for i in 0..count {
            let receiver = receiver.clone();
            let shared = shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("nbd-worker-{i}"))
                .spawn(move || worker_loop(&shared, &receiver));
            match handle {
                Ok(h) => workers.push(h),
                Err(e) => {
                    drop(sender);
                    for w in workers {
                        let _ = w.join();
                    }
                    return Err(e);
                }
            }
        }
        Ok(Pool { sender, workers })
    }

    pub(crate) fn sender(&self) -> SyncSender<Job> {
        self.sender.clone()
    }

    /// Close the queue and wait for the workers to finish what is queued.
    pub(crate) fn stop(self) {
        drop(self.sender);
        for w in self.workers {
            if w.join().is_err() {
                tracing::error!("an NBD worker thread panicked");
            }
        }
    }
}

fn worker_loop(shared: &Shared, receiver: &Mutex<Receiver<Job>>) {
    loop {
        // Holding the lock while blocked in recv is fine: the other idle
        // workers would be blocked anyway.
        let job = match lock(receiver).recv() {
            Ok(job) => job,
            Err(_) => return, // every sender is gone: the server is stopping
        };
        execute(shared, job);
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
    let descriptors = shape_extents(
        &extents,
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
    available: Mutex<u64>,
    changed: Condvar,
}

impl ByteBudget {
    pub(crate) fn new(total_bytes: u64) -> Self {
        ByteBudget {
            available: Mutex::new(total_bytes),
            changed: Condvar::new(),
        }
    }

    /// Block until `bytes` are available and take them. `bytes` never
    /// exceeds the total (config validation guarantees it).
    pub(crate) fn acquire(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let mut available = lock(&self.available);
        while *available < bytes {
            available = self
                .changed
                .wait(available)
                .unwrap_or_else(|e| e.into_inner());
        }
        *available -= bytes;
    }

    pub(crate) fn release(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        *lock(&self.available) += bytes;
        self.changed.notify_all();
    }
}
