//! The handshake, with blocking reads and writes and a deadline.

use std::io::Write;
use std::time::{Duration, Instant};

use super::end::End;
use super::input::InBuf;
use crate::codec::{Negotiation, NegotiationStep, Session};
use crate::server::listener::Stream;
use crate::server::Shared;

pub(super) fn negotiate(
    shared: &Shared,
    id: u64,
    stream: &mut Stream,
    input: &mut InBuf,
) -> Result<Session, End> {
    let mut negotiation = Negotiation::with_tls(
        shared.export_info.clone(),
        shared.limits.clone(),
        shared.config.tls,
    );
    stream
        .write_all(&negotiation.greeting())
        .map_err(|_| End::WriteFailed)?;
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
        // An established slot before the reply that enters transmission:
        // without one the client gets no reply, just the closed socket.
        if matches!(step, NegotiationStep::Transmission { .. }) && !shared.admission.establish(id) {
            return Err(End::TooManyConnections);
        }
        if !out.is_empty() {
            stream.write_all(&out).map_err(|_| End::WriteFailed)?;
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
            NegotiationStep::StartTls { bytes } => {
                input.consume(bytes);
                // The codec refuses STARTTLS with bytes behind it.
                assert_eq!(input.len(), 0, "clear text buffered across STARTTLS");
                *stream = start_tls(shared, id, stream, deadline)?;
                negotiation.tls_established();
            }
        }
    }
}

/// The TLS handshake on the client's socket (within the handshake's
/// deadline), then a relay: the rest of the connection runs in plain text
/// on the returned socket, as if TLS were not there.
fn start_tls(
    shared: &Shared,
    id: u64,
    stream: &Stream,
    deadline: Option<Instant>,
) -> Result<Stream, End> {
    let Some(acceptor) = &shared.config.tls_acceptor else {
        // `ServerConfig::validate` pairs a TLS policy with credentials.
        return Err(End::Tls(cairn_tls::TlsError::Setup(
            "STARTTLS accepted without TLS credentials".to_string(),
        )));
    };
    let socket = stream.try_clone().map_err(End::Io)?;
    let left = deadline.map(|d| {
        d.saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    });
    socket.set_read_timeout(left).map_err(End::Io)?;
    socket.set_write_timeout(left).map_err(End::Io)?;
    let (tls, summary) = acceptor.accept(socket).map_err(End::Tls)?;
    shared
        .counters
        .tls_handshakes
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tracing::info!(
        conn = id,
        version = summary.version,
        cipher = %summary.cipher,
        peer = summary.peer.as_deref().unwrap_or("-"),
        "TLS established"
    );
    // The relay's socket is non-blocking from here; its own stall limit
    // stands in for the write timeout.
    tls.get_ref().set_read_timeout(None).map_err(End::Io)?;
    tls.get_ref().set_write_timeout(None).map_err(End::Io)?;
    let stall = match shared.config.write_timeout_ms {
        0 => None,
        ms => Some(Duration::from_millis(ms)),
    };
    let plain = cairn_tls::spawn_relay(tls, format!("nbd-tls-{id}"), stall).map_err(End::Io)?;
    Ok(Stream::Unix(plain))
}
