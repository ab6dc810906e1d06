//! One connection: the handshake, with blocking reads on the connection's
//! own thread, then transmission on an event loop of its own (a
//! `cairn_io::Reactor`): every request is a task, so a read waiting for a
//! slow origin or a flush waiting for its barrier holds no thread, and the
//! connection keeps taking requests meanwhile (up to its in-flight limit).
//! Replies leave in the order the requests finish.

mod end;
mod input;
mod negotiate;
mod output;
mod request;
mod tls;
mod transmit;

use std::cell::Cell;
use std::net::Shutdown;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use cairn_io::{LocalNotify, Reactor, ReactorOptions};

use super::listener::Stream;
use super::Shared;
use crate::codec::{ProtocolError, Session};
use crate::export::Export;
use end::End;
use input::InBuf;
use output::Output;

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
    in_flight: Cell<usize>,
    slot_freed: LocalNotify,
    output: Output,
    /// TLS, when the client negotiated STARTTLS.
    tls: Option<tls::LoopTls>,
}

impl Conn {
    /// Take an in-flight slot, waiting (as a task) while the connection is
    /// at its limit: that is the backpressure on the client.
    async fn acquire_slot(&self) {
        let max = self.shared.config.max_in_flight_per_connection;
        if self.in_flight.get() >= max {
            self.shared
                .counters
                .in_flight_limit_waits
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        while self.in_flight.get() >= max {
            self.slot_freed.notified().await;
        }
        self.in_flight.set(self.in_flight.get() + 1);
    }

    fn release_slot(&self) {
        debug_assert!(self.in_flight.get() > 0);
        self.in_flight.set(self.in_flight.get().saturating_sub(1));
        self.slot_freed.notify_all();
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
        in_flight: Cell::new(0),
        slot_freed: LocalNotify::default(),
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
    }
}
