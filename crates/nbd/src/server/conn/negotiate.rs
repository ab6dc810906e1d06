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
    let mut negotiation = Negotiation::new(shared.export_info.clone(), shared.limits.clone());
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
        }
    }
}
