//! The client side: send one request to the daemon serving a cache and
//! hand its replies to the caller.

use std::io::BufReader;
use std::os::unix::net::UnixStream;
use std::path::Path;

use super::{
    decode_reply, read_line, socket_path, write_message, AdminReply, AdminRequest, Envelope,
    ProtocolError, REPLY_LINE_BYTES_MAX,
};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon ran the request and it failed; `advice` is the fix the
    /// daemon named, printed by the CLI after the message.
    #[error("{message}")]
    Daemon {
        message: String,
        advice: Option<String>,
    },
    #[error("talking to the daemon: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("the daemon closed the admin connection early")]
    Closed,
}

/// Ask the daemon serving `cache`, passing every reply before the final
/// `Ok` to `on_reply`; `None` if no daemon serves this cache.
pub fn ask_daemon(
    cache: &Path,
    request: &AdminRequest,
    on_reply: &mut dyn FnMut(AdminReply),
) -> Option<Result<(), ClientError>> {
    let stream = UnixStream::connect(socket_path(cache)).ok()?;
    Some(exchange(stream, request, on_reply))
}

fn exchange(
    stream: UnixStream,
    request: &AdminRequest,
    on_reply: &mut dyn FnMut(AdminReply),
) -> Result<(), ClientError> {
    let mut w = stream.try_clone().map_err(ProtocolError::Io)?;
    write_message(&mut w, &Envelope::new(request)).map_err(ProtocolError::Io)?;
    let mut r = BufReader::new(stream);
    while let Some(line) = read_line(&mut r, REPLY_LINE_BYTES_MAX)? {
        match decode_reply(&line)? {
            AdminReply::Ok => return Ok(()),
            AdminReply::Error { message, advice } => {
                return Err(ClientError::Daemon { message, advice })
            }
            reply => on_reply(reply),
        }
    }
    Err(ClientError::Closed)
}
