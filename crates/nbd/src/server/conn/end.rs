//! Why a connection ended.

use std::io;

use crate::codec::ProtocolError;

#[derive(Debug)]
pub(super) enum End {
    /// EOF between messages.
    ClientClosed,
    /// NBD_CMD_DISC.
    Disconnect,
    /// NBD_OPT_ABORT.
    Aborted,
    /// EOF inside a message (header or payload).
    MidMessage,
    Protocol(ProtocolError),
    HandshakeTimeout,
    /// The handshake ended with every established slot taken.
    TooManyConnections,
    /// The export the client chose was removed before it could be served.
    ExportGone,
    WriteFailed,
    /// The TLS handshake after STARTTLS failed.
    Tls(cairn_tls::TlsError),
    Io(io::Error),
}
