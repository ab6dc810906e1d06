//! Running one request against the export and encoding its reply.

use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use super::charge::Charge;
use super::output::Reply;
use super::Conn;
use crate::codec::reply::{
    encode_block_status, encode_error, encode_ok, encode_read_prefix, read_prefix_bytes,
    shape_extents, Descriptor,
};
use crate::codec::{Command, Request, BASE_ALLOCATION_ID};
use crate::export::{Export, ExportError};
use crate::proto::{self, errno_to_nbd};

/// A request taken from the client, with what it holds.
pub(super) struct Job {
    pub request: Request,
    /// The write payload (empty for other commands).
    pub payload: Vec<u8>,
    /// Its slot and budget, held by its reply until that has been sent.
    pub charge: Charge,
}

/// The task of one request: run it and queue its reply, which holds the
/// request's slot and budget until it has been sent. A panic in the
/// export becomes an EIO reply.
pub(super) async fn run(conn: Rc<Conn>, job: Job) {
    conn.shared
        .counters
        .requests
        .fetch_add(1, Ordering::Relaxed);
    let to = job.request.reply_to;
    tracing::trace!(
        conn = conn.id,
        cookie = to.cookie,
        command = proto::command_name(to.command),
        offset = to.offset,
        "request started"
    );
    let mode = conn.session.mode;
    let reply = match CatchPanic(std::pin::pin!(execute(&conn, &job))).await {
        Ok(reply) => reply,
        Err(()) => {
            tracing::error!(
                conn = conn.id,
                command = proto::command_name(to.command),
                "export call panicked"
            );
            let mut out = Vec::new();
            encode_error(&mut out, mode, to, proto::NBD_EIO, "internal server error");
            Reply::bytes(out)
        }
    };
    tracing::trace!(conn = conn.id, cookie = to.cookie, "reply queued");
    conn.output.push(reply.charged(job.charge));
}

async fn execute(conn: &Conn, job: &Job) -> Reply {
    let export: &dyn Export = &*conn.export;
    let request = &job.request;
    let to = request.reply_to;
    let mode = conn.session.mode;
    let offset = request.offset;
    let result: Result<Option<Reply>, ExportError> =
        match request.command {
            Command::Read { length_bytes: 0 } => Ok(None),
            Command::Read { length_bytes } => export
                .read_async(offset, length_bytes as u64)
                .await
                .map(|data| {
                    let mut header = Vec::with_capacity(read_prefix_bytes(mode));
                    encode_read_prefix(&mut header, mode, to, length_bytes);
                    Some(Reply::data(header, data))
                }),
            Command::Write {
                length_bytes: 0, ..
            } => Ok(None),
            Command::Write { fua, .. } => export
                .write_async(offset, &job.payload, fua)
                .await
                .map(|()| None),
            Command::Flush => export.flush_async().await.map(|()| None),
            Command::Trim {
                length_bytes: 0, ..
            } => Ok(None),
            Command::Trim { length_bytes, fua } => {
                match export.trim_async(offset, length_bytes).await {
                    Ok(()) if fua => export.flush_async().await.map(|()| None),
                    other => other.map(|()| None),
                }
            }
            Command::WriteZeroes {
                length_bytes: 0, ..
            } => Ok(None),
            Command::WriteZeroes {
                length_bytes,
                fua,
                may_trim,
                fast_only,
            } => match export
                .write_zeroes_async(offset, length_bytes, may_trim, fast_only)
                .await
            {
                Ok(()) if fua => export.flush_async().await.map(|()| None),
                other => other.map(|()| None),
            },
            Command::Cache { length_bytes: 0 } => Ok(None),
            Command::Cache { length_bytes } => export
                .cache_async(offset, length_bytes)
                .await
                .map(|()| None),
            Command::BlockStatus {
                length_bytes,
                req_one,
            } => block_status(conn, request, length_bytes, req_one)
                .await
                .map(|b| Some(Reply::bytes(b))),
        };
    match result {
        Ok(Some(reply)) => reply,
        Ok(None) => {
            let mut out = Vec::with_capacity(40);
            encode_ok(&mut out, mode, to);
            Reply::bytes(out)
        }
        Err(e) => {
            let command = proto::command_name(to.command);
            if e.errno == libc::ENOTSUP {
                tracing::debug!(conn = conn.id, command, offset, error = %e, "export refused");
            } else {
                tracing::warn!(conn = conn.id, command, offset, error = %e, "export operation failed");
            }
            let mut out = Vec::with_capacity(64 + e.message.len());
            encode_error(&mut out, mode, to, errno_to_nbd(e.errno), &e.message);
            Reply::bytes(out)
        }
    }
}

async fn block_status(
    conn: &Conn,
    request: &Request,
    length_bytes: u64,
    req_one: bool,
) -> Result<Vec<u8>, ExportError> {
    let shared = &conn.shared;
    let size = conn.session.size_bytes;
    let min_block = conn.session.block_sizes.min_bytes.max(1) as u64;
    // Answering less than asked is allowed; capping the query bounds the
    // work one request can ask of the export (a full-size 64-bit request
    // is legal with extended headers).
    let cap = (u32::MAX as u64) & !(min_block - 1);
    let query = length_bytes.min(size - request.offset).min(cap);
    let extents = conn
        .export
        .block_status_async(request.offset, query)
        .await?;
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
        conn.session.mode,
        request.reply_to,
        BASE_ALLOCATION_ID,
        &descriptors,
    );
    Ok(out)
}

/// A future whose panic is caught at each poll: `Err(())` instead of
/// unwinding through the event loop.
struct CatchPanic<'a, F>(Pin<&'a mut F>);

impl<F: Future> Future for CatchPanic<'_, F> {
    type Output = Result<F::Output, ()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let future = &mut self.0;
        match catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(Poll::Ready(value)) => Poll::Ready(Ok(value)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(_) => Poll::Ready(Err(())),
        }
    }
}
