//! Opening a loop's own connection (see [`super::loop_channel`]): the same
//! session and handshake as the main connection's, on a thread of its own,
//! and a check that the server shows the same export on it.

use std::io;
use std::time::Duration;

use super::handshake::{handshake, open_session, NegotiatedExport};
use super::options::NbdOptions;
use super::transport::Stream;
use super::uri::NbdUri;

/// What it takes to open one more connection to the export the main
/// connection serves.
#[derive(Clone)]
pub(super) struct LoopDial {
    pub uri: NbdUri,
    pub options: NbdOptions,
    /// The main connection's export: another connection must see the same.
    pub expected: NegotiatedExport,
}

impl LoopDial {
    /// Connect and negotiate, blocking (within the connect timeout).
    pub fn dial(&self) -> io::Result<Stream> {
        let connect_timeout = Duration::from_millis(self.options.connect_timeout_ms.max(1));
        let request_timeout = Duration::from_millis(self.options.request_timeout_ms.max(1));
        let (mut stream, greeting) = open_session(&self.uri, connect_timeout, request_timeout)?;
        let info = handshake(&mut stream, &greeting, &self.uri.export)?;
        if info != self.expected {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the server shows the export differently on a second connection \
                     ({info:?}, the first has {:?})",
                    self.expected
                ),
            ));
        }
        // The loop's ring waits for replies; each request keeps its own
        // deadline, so the socket itself never times out.
        stream.set_timeouts(None, None)?;
        Ok(stream)
    }
}
