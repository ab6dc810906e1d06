//! The transmission phase: the reader task takes requests from the client
//! and starts a task for each; the writer task sends their replies.

use std::rc::Rc;

use super::end::End;
use super::input::InBuf;
use super::output::{self, Reply};
use super::request::{self, Job};
use super::Conn;
use crate::codec::reply::{encode_error, read_prefix_bytes};
use crate::codec::{decode_request, Command, Request, RequestAction, RequestDecode};
use crate::proto;

/// Serve requests until the client leaves, misbehaves or the server stops;
/// then finish the requests in flight and their replies.
pub(super) async fn transmit(conn: Rc<Conn>, mut input: InBuf) -> End {
    let writer = conn.reactor.spawn(output::writer(conn.clone()));
    let end = read_requests(&conn, &mut input).await;
    // Requests taken from the client still get their replies (if it
    // listens), and give back their slots and budget.
    while conn.slots.used() > 0 {
        conn.slots.freed().await;
    }
    conn.output.close();
    writer.await;
    end
}

async fn read_requests(conn: &Rc<Conn>, input: &mut InBuf) -> End {
    loop {
        if conn.output.is_broken() {
            return End::WriteFailed;
        }
        let decoded = match decode_request(input.filled(), &conn.session, &conn.shared.limits) {
            Ok(d) => d,
            Err(e) => return End::Protocol(e),
        };
        let (header_bytes, action) = match decoded {
            RequestDecode::NeedMore { min_total_bytes } => {
                if let Err(end) = input.fill_async(conn, min_total_bytes).await {
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
        let handled = match action {
            RequestAction::Disconnect => return End::Disconnect,
            RequestAction::Reject {
                reply_to,
                errno,
                message,
                discard_bytes,
            } => {
                tracing::debug!(
                    conn = conn.id,
                    command = proto::command_name(reply_to.command),
                    offset = reply_to.offset,
                    errno,
                    message,
                    "request rejected"
                );
                reject(conn, input, reply_to, errno, message, discard_bytes).await
            }
            RequestAction::Execute(request) => start(conn, input, request).await,
        };
        if let Err(end) = handled {
            return end;
        }
    }
}

async fn reject(
    conn: &Conn,
    input: &mut InBuf,
    reply_to: crate::codec::ReplyTo,
    errno: u32,
    message: &'static str,
    discard_bytes: u64,
) -> Result<(), End> {
    input.skip(conn, discard_bytes).await?;
    // An error reply holds a slot until sent too: a client that sends bad
    // requests and never reads would otherwise queue replies without bound.
    let charge = conn.charge(0).await;
    let mut out = Vec::with_capacity(64 + message.len());
    encode_error(&mut out, conn.session.mode, reply_to, errno, message);
    conn.output.push(Reply::bytes(out).charged(charge));
    Ok(())
}

/// Take a slot and budget for `request` (waiting as a task while the
/// connection or the server is at its limit: the client's further
/// requests wait in the socket), read its payload, and start its task.
async fn start(conn: &Rc<Conn>, input: &mut InBuf, request: Request) -> Result<(), End> {
    let payload_bytes = request.payload_bytes();
    let budget_bytes = match request.command {
        Command::Read { length_bytes } => {
            length_bytes as u64 + read_prefix_bytes(conn.session.mode) as u64
        }
        _ => payload_bytes,
    };
    // Given back when its reply has been sent, or here if reading the
    // payload fails (the charge is dropped).
    let charge = conn.charge(budget_bytes).await;
    let payload = input.read_payload(conn, payload_bytes).await?;
    let job = Job {
        request,
        payload,
        charge,
    };
    conn.reactor.spawn_detached(request::run(conn.clone(), job));
    Ok(())
}
