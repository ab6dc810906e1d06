//! One connection: the handshake, with blocking reads on the connection's
//! own thread, then transmission on an event loop of its own (a
//! `cairn_io::Reactor`): every request is a task, so a read waiting for a
//! slow origin or a flush waiting for its barrier holds no thread, and the
//! connection keeps taking requests meanwhile (up to its in-flight limit).
//! Replies leave in the order the requests finish.

mod charge;
mod end;
mod input;
mod negotiate;
mod output;
mod request;
mod slots;
mod tls;
mod transmit;

use std::net::Shutdown;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use cairn_io::{IoBackend, Reactor, ReactorOptions};

use super::listener::Stream;
use super::Shared;
use crate::codec::{ProtocolError, Session};
use crate::export::Export;
use charge::Charge;
use end::End;
use input::InBuf;
use output::Output;
use slots::Slots;

/// What the tasks of one connection share (they all run on its thread).
pub(super) struct Conn {
    id: u64,
    shared: Arc<Shared>,
    session: Session,
    /// The export the client chose, for the connection's life.
    export: Arc<dyn Export>,
    /// Receives and sends go through the reactor's ring.
    stream: Stream,
    reactor: Reactor,
    /// Requests taken and not yet answered (their replies sent).
    slots: Rc<Slots>,
    output: Output,
    /// TLS, when the client negotiated STARTTLS.
    tls: Option<tls::LoopTls>,
}

impl Conn {
    /// Take an in-flight slot and `budget_bytes` of the server's payload
    /// budget, waiting (as a task) while the connection is at its limit
    /// (that is the backpressure on the client) or the server is out of
    /// budget. Both come back when the returned charge is dropped, which
    /// the request's reply does once it has been sent.
    async fn charge(&self, budget_bytes: u64) -> Charge {
        let max = self.shared.config.max_in_flight_per_connection;
        let max_bytes = connection_share_bytes(self.shared.config.max_buffered_bytes);
        if !self.slots.try_take(max, budget_bytes, max_bytes) {
            self.shared
                .counters
                .in_flight_limit_waits
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            while !self.slots.try_take(max, budget_bytes, max_bytes) {
                self.slots.freed().await;
            }
        }
        // The slot is taken; if this task were dropped while it waits for
        // the budget, the slot would be given back with nothing acquired.
        let slot = SlotGuard(&self.slots, budget_bytes);
        self.shared.budget.acquire(budget_bytes).await;
        std::mem::forget(slot);
        Charge::new(self.slots.clone(), self.shared.clone(), budget_bytes)
    }
}

/// The share of the server's payload budget one connection may hold, in
/// requests running and replies not yet sent: a quarter, so a client that
/// stops reading cannot keep every other client waiting for budget.
fn connection_share_bytes(max_buffered_bytes: u64) -> u64 {
    max_buffered_bytes / 4
}

/// Gives back a slot taken for `.1` bytes if dropped before a charge owns it.
struct SlotGuard<'a>(&'a Slots, u64);

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        self.0.release(self.1);
    }
}

/// Serve one client until it leaves, misbehaves, or the server stops.
pub(crate) fn run(shared: &Arc<Shared>, id: u64, mut stream: Stream) {
    let peer = stream.peer();
    if shared.config.write_timeout_ms > 0 {
        let t = Duration::from_millis(shared.config.write_timeout_ms);
        if let Err(e) = stream.set_write_timeout(Some(t)) {
            tracing::warn!(conn = id, error = %e, "cannot set write timeout");
        }
    }
    tracing::info!(conn = id, %peer, "client connected");
    let mut input = InBuf::new();
    let end = match negotiate::negotiate(shared, id, &mut stream, &mut input) {
        Ok(negotiated) => {
            let negotiate::Negotiated {
                session,
                tls,
                attachment,
            } = negotiated;
            tracing::debug!(conn = id, ?session, "entered transmission");
            input.shrink();
            let export = attachment.export().clone();
            let end =
                serve_transmission(shared, id, stream.try_clone(), session, input, tls, export);
            if attachment.removed() {
                tracing::info!(
                    conn = id,
                    export = attachment.name(),
                    "export removed; connection closed"
                );
            }
            // Every request of the connection is done: it no longer
            // counts as a user of the export.
            drop(attachment);
            end
        }
        Err(end) => end,
    };
    report_end(shared, id, &peer, &end);
    stream.shutdown(Shutdown::Both);
}

/// Run the transmission phase on a reactor created for this connection.
fn serve_transmission(
    shared: &Arc<Shared>,
    id: u64,
    stream: std::io::Result<Stream>,
    session: Session,
    input: InBuf,
    tls: Option<Box<tls::TlsLink>>,
    export: Arc<dyn Export>,
) -> End {
    let setup = stream.and_then(|stream| {
        // Blocking: every receive and send from here on is a ring
        // operation, which never blocks the thread (the kernel waits for
        // the socket itself).
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(None)?;
        let reactor = Reactor::new(&ring_options(shared.config.max_in_flight_per_connection))?;
        Ok((stream, reactor))
    });
    let (stream, reactor) = match setup {
        Ok(parts) => parts,
        Err(e) => {
            tracing::error!(conn = id, error = %e, "cannot set up the connection's event loop");
            return End::Io(e);
        }
    };
    let conn = Rc::new(Conn {
        id,
        shared: shared.clone(),
        session,
        export,
        stream,
        reactor: reactor.clone(),
        slots: Rc::new(Slots::default()),
        output: Output::default(),
        tls: tls.map(tls::LoopTls::new),
    });
    reactor.run(transmit::transmit(conn, input))
}

fn report_end(shared: &Shared, id: u64, peer: &str, end: &End) {
    match end {
        End::Protocol(e @ ProtocolError::DataAfterStartTls { .. }) => {
            tls_refused(shared, id, peer, e)
        }
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
        End::ExportGone => tracing::info!(
            conn = id,
            %peer,
            "the export chosen was removed during the handshake; closing the connection"
        ),
        End::TooManyConnections => {
            shared
                .counters
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                conn = id,
                %peer,
                max = shared.config.max_connections,
                "too many connections; closing this one at the end of its handshake"
            );
        }
        End::Tls(e) => tls_refused(shared, id, peer, e),
        End::Io(e) => tracing::warn!(conn = id, %peer, error = %e, "connection I/O error"),
        End::MidMessage => {
            tracing::info!(conn = id, "client disconnected in the middle of a message")
        }
        other => tracing::info!(conn = id, reason = ?other, "client disconnected"),
    }
}

/// A client that did not get TLS: counted as a failed TLS handshake.
fn tls_refused(shared: &Shared, id: u64, peer: &str, why: &dyn std::fmt::Display) {
    shared
        .counters
        .tls_handshake_failures
        .fetch_add(1, Ordering::Relaxed);
    tracing::warn!(conn = id, %peer, error = %why, "TLS refused; disconnecting client");
}

/// A ring with room for every request in flight to have a cache or origin
/// read and its reply's send outstanding at once, besides the receive and
/// the timers (more operations wait for room; they never fail).
fn ring_options(max_in_flight: usize) -> ReactorOptions {
    let wanted = max_in_flight.saturating_mul(2).saturating_add(16);
    let defaults = ReactorOptions::default();
    ReactorOptions {
        ring_entries: u32::try_from(wanted)
            .unwrap_or(u32::MAX)
            .max(defaults.ring_entries),
        // A bad value was refused when the cache was opened; `auto` then.
        backend: IoBackend::from_env().unwrap_or_default(),
    }
}
