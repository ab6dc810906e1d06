use std::io;
use std::path::PathBuf;

/// What can go wrong setting up or running TLS. Messages name the file or
/// the peer, and what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    #[error("{}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("{}:{line}: {reason} (expected `username:hexkey` lines, as `psktool -u NAME -p {}` writes them)", path.display(), path.display())]
    PskFileSyntax {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("{}: no keys in the file (make one with `psktool -u NAME -p {}`)", path.display(), path.display())]
    PskFileEmpty { path: PathBuf },
    #[error("{}: no key for user {username:?}", path.display())]
    PskUnknownUser { path: PathBuf, username: String },
    #[error("{}: {what} is missing; {fix}", dir.display())]
    MissingFile {
        dir: PathBuf,
        what: &'static str,
        fix: &'static str,
    },
    #[error("{}: cannot use it as {what}: {reason}", path.display())]
    BadCredential {
        path: PathBuf,
        what: &'static str,
        reason: String,
    },
    #[error("TLS setup: {0}")]
    Setup(String),
    #[error("TLS handshake failed: {0}")]
    Handshake(String),
    #[error("TLS handshake timed out")]
    HandshakeTimeout,
}

impl TlsError {
    pub(crate) fn setup(e: openssl::error::ErrorStack) -> TlsError {
        TlsError::Setup(e.to_string())
    }
}
