//! `nbds://`: NBD_OPT_STARTTLS right after the greeting, the TLS
//! handshake (cairn-tls, with libnbd's parameters), then a relay, so the
//! rest of the client (handshake, pipelined reader, writer) runs on a
//! plain socket as it does without TLS.

use std::io;
use std::time::Duration;

use cairn_nbd_proto::proto::{OPT_STARTTLS, REP_ACK};
use cairn_tls::{ClientCredentials, RelayOutcome, TlsConnector};

use super::handshake::{option_error_name, read_option_reply, send_option, Greeting};
use super::transport::Stream;
use super::uri::{NbdTls, NbdTransport, NbdUri};

pub(super) fn start_tls(
    stream: &mut Stream,
    greeting: &Greeting,
    uri: &NbdUri,
    tls: &NbdTls,
    stall_timeout: Duration,
) -> io::Result<RelayOutcome> {
    // Credentials first: a missing key file is named before the server
    // is bothered. Loaded at every connect, so a rotated key is picked up
    // by the next reconnect.
    let connector = TlsConnector::new(&credentials(uri, tls)?)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    if !greeting.fixed {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the server does not speak fixed newstyle, so it cannot do TLS",
        ));
    }
    send_option(stream, OPT_STARTTLS, &[])?;
    let (reply, payload) = read_option_reply(stream, OPT_STARTTLS)?;
    if reply.reply_type != REP_ACK {
        let message = String::from_utf8_lossy(&payload);
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the server refused TLS ({}{}{}); use nbd:// if it serves clear text",
                option_error_name(reply.reply_type),
                if message.is_empty() { "" } else { ": " },
                message
            ),
        ));
    }
    let socket = stream.try_clone()?;
    let (tls_stream, summary) = connector
        .connect(socket)
        .map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e.to_string()))?;
    tracing::debug!(
        version = summary.version,
        cipher = %summary.cipher,
        credentials = connector.description(),
        "TLS to the origin established"
    );
    // The relay makes the socket non-blocking; its stall limit stands in
    // for the write timeout.
    tls_stream.get_ref().set_timeouts(None, None)?;
    // The socket under the relay, kept to reset it (`Stream::abort`). It
    // also keeps the TCP connection open after the relay ends, until the
    // last clone of this stream is dropped (the connection's end).
    let carrier = Box::new(stream.try_clone()?);
    let (plain, outcome) =
        cairn_tls::spawn_relay(tls_stream, "cairn-nbd-tls".into(), Some(stall_timeout))?;
    *stream = Stream::Tls { plain, carrier };
    Ok(outcome)
}

/// A handshake error after TLS, with the reason the TLS session ended if
/// it did (in TLS 1.3 a server refuses a client certificate only after the
/// client finished its handshake, so the refusal arrives as an alert on
/// the first read, and the NBD layer sees just a closed connection).
pub(super) fn explain(error: io::Error, relay: Option<&RelayOutcome>) -> io::Error {
    match relay.and_then(RelayOutcome::error) {
        Some(reason) => io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the server ended the TLS session: {reason} (a server that requires client certificates ends it this way when it refuses the one in tls-certificates=DIR, or finds none)"
            ),
        ),
        None => error,
    }
}

/// libnbd's rules: a PSK file means pre-shared keys (the user from the
/// URI, else the login name); otherwise X.509 against the server's host
/// name (`localhost` on a Unix socket).
fn credentials(uri: &NbdUri, tls: &NbdTls) -> io::Result<ClientCredentials> {
    if let Some(file) = &tls.psk_file {
        let username = match &tls.username {
            Some(user) => user.clone(),
            None => login_name().ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "no TLS user: add tls-username=NAME (or NAME@ before the host) to the URI",
                )
            })?,
        };
        return Ok(ClientCredentials::Psk {
            file: file.clone(),
            username,
        });
    }
    let hostname = tls
        .hostname
        .clone()
        .unwrap_or_else(|| match &uri.transport {
            NbdTransport::Tcp { host, .. } => host.clone(),
            NbdTransport::Unix { .. } => "localhost".to_string(),
        });
    Ok(ClientCredentials::X509 {
        dir: tls.certificates.clone(),
        verify_peer: tls.verify_peer,
        hostname,
    })
}

fn login_name() -> Option<String> {
    ["LOGNAME", "USER"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
}
