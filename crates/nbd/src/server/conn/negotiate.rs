//! The handshake, with blocking reads and writes and a deadline.

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

use cairn_tls::LoopChannel;

use super::end::End;
use super::input::{InBuf, TimedRead};
use super::tls::TlsLink;
use crate::codec::{Negotiation, NegotiationStep, Session};
use crate::server::exports::Attachment;
use crate::server::listener::Stream;
use crate::server::Shared;

/// The negotiation's transport: the client's socket, then, after
/// STARTTLS, TLS over it (still blocking, on this thread).
pub(super) enum NegotiationIo<'a> {
    Plain(&'a mut Stream),
    Tls(Box<TlsLink>),
}

impl NegotiationIo<'_> {
    fn write_all(&mut self, bytes: &[u8]) -> Result<(), End> {
        let written = match self {
            NegotiationIo::Plain(stream) => stream.write_all(bytes),
            NegotiationIo::Tls(tls) => tls.write_all(bytes),
        };
        written.map_err(|_| End::WriteFailed)
    }

    /// Another handle on the client's socket, to shut it down from
    /// elsewhere (a forced removal of its export).
    fn control(&self) -> io::Result<Stream> {
        match self {
            NegotiationIo::Plain(stream) => stream.try_clone(),
            NegotiationIo::Tls(tls) => match tls.get_ref().socket() {
                Some(socket) => socket.try_clone(),
                None => Err(io::Error::other("the TLS link has no socket")),
            },
        }
    }
}

/// What a successful negotiation ends in.
pub(super) struct Negotiated {
    pub session: Session,
    /// The TLS link, if STARTTLS was negotiated.
    pub tls: Option<Box<TlsLink>>,
    /// The connection's hold on its export.
    pub attachment: Attachment,
}

impl Read for NegotiationIo<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            NegotiationIo::Plain(stream) => stream.read(buf),
            NegotiationIo::Tls(tls) => tls.read(buf),
        }
    }
}

impl TimedRead for NegotiationIo<'_> {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            NegotiationIo::Plain(stream) => stream.set_read_timeout(timeout),
            NegotiationIo::Tls(tls) => match tls.get_ref().socket() {
                Some(socket) => socket.set_read_timeout(timeout),
                None => Ok(()),
            },
        }
    }
}

/// Negotiate: the session agreed, its TLS link if STARTTLS was, and the
/// connection's hold on the export it chose.
pub(super) fn negotiate(
    shared: &Shared,
    id: u64,
    stream: &mut Stream,
    input: &mut InBuf,
) -> Result<Negotiated, End> {
    let mut negotiation = Negotiation::with_catalog(
        shared.catalog.clone(),
        shared.limits.clone(),
        shared.config.tls,
        shared.config.extended_headers,
    );
    let deadline = match shared.config.handshake_timeout_ms {
        0 => None,
        ms => Some(Instant::now() + Duration::from_millis(ms)),
    };
    let mut io = NegotiationIo::Plain(stream);
    io.write_all(&negotiation.greeting())?;
    let mut out = Vec::new();
    loop {
        out.clear();
        let step = negotiation
            .step(input.filled(), &mut out)
            .map_err(End::Protocol)?;
        // An established slot, and a hold on the export, before the reply
        // that enters transmission: without them the client gets no
        // reply, just the closed socket.
        let mut attachment = None;
        if let NegotiationStep::Transmission { session, .. } = &step {
            if !shared.admission.establish(id) {
                return Err(End::TooManyConnections);
            }
            let control = io.control().map_err(End::Io)?;
            attachment = Some(
                shared
                    .exports
                    .attach(session.export_id, control)
                    .ok_or(End::ExportGone)?,
            );
        }
        if !out.is_empty() {
            io.write_all(&out)?;
        }
        match step {
            NegotiationStep::NeedMore { min_total_bytes } => {
                input.fill(&mut io, min_total_bytes, deadline)?
            }
            NegotiationStep::Consumed { bytes } => input.consume(bytes),
            NegotiationStep::Transmission { bytes, session } => {
                input.consume(bytes);
                let tls = match io {
                    NegotiationIo::Plain(_) => None,
                    NegotiationIo::Tls(tls) => Some(tls),
                };
                let Some(attachment) = attachment else {
                    // Taken above for every Transmission step.
                    return Err(End::ExportGone);
                };
                return Ok(Negotiated {
                    session,
                    tls,
                    attachment,
                });
            }
            NegotiationStep::Aborted { .. } => return Err(End::Aborted),
            NegotiationStep::StartTls { bytes } => {
                input.consume(bytes);
                // The codec refuses STARTTLS with bytes behind it.
                assert_eq!(input.len(), 0, "clear text buffered across STARTTLS");
                let NegotiationIo::Plain(socket) = &io else {
                    // The codec accepts STARTTLS once.
                    return Err(End::Protocol(crate::codec::ProtocolError::AfterEnd));
                };
                io = NegotiationIo::Tls(start_tls(shared, id, socket, deadline)?);
                negotiation.tls_established();
            }
        }
    }
}

/// The TLS handshake on the client's socket (blocking, within the
/// handshake's deadline). The rest of the negotiation runs through it on
/// this thread; transmission then drives it from the connection's loop.
fn start_tls(
    shared: &Shared,
    id: u64,
    stream: &Stream,
    deadline: Option<Instant>,
) -> Result<Box<TlsLink>, End> {
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
    let (tls, summary) = acceptor
        .accept(LoopChannel::blocking(socket))
        .map_err(End::Tls)?;
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
    Ok(Box::new(tls))
}
