//! TLS for cairn's NBD server and its NBD origins.
//!
//! - [`PskFile`]: the `username:hexkey` file that GnuTLS's `psktool`
//!   writes (nbdkit's `--tls-psk`, libnbd's `tls-psk-file=`).
//! - [`TlsAcceptor`] / [`TlsConnector`]: server and client credentials,
//!   X.509 in the directory layout nbdkit, qemu and libnbd share
//!   (`ca-cert.pem`, `server-cert.pem`, `server-key.pem`,
//!   `client-cert.pem`, `client-key.pem`) or a pre-shared key.
//! - [`LoopChannel`]: TLS driven by an event loop (the server's
//!   connections): OpenSSL over memory, the loop's ring moving ciphertext.
//! - [`spawn_relay`]: after the handshake, a thread moves bytes between
//!   the TLS connection and one end of a socket pair; the other end goes
//!   back to code written for plain blocking sockets (the NBD client's
//!   pipelined reader), which then needs no change.
//!
//! OpenSSL (through the `openssl` crate) because it does both X.509 and
//! external pre-shared keys, in TLS 1.3 and 1.2, and interoperates with
//! the GnuTLS that nbdkit, qemu and libnbd use; rustls has no external PSK.

mod acceptor;
mod connector;
mod context;
mod error;
mod loop_channel;
mod psk_file;
mod relay;

pub use acceptor::{ServerCredentials, TlsAcceptor};
pub use connector::{ClientCredentials, TlsConnector};
pub use error::TlsError;
pub use loop_channel::{LoopChannel, MAX_INCOMING_BYTES};
pub use openssl;
pub use openssl::ssl::SslStream;
pub use psk_file::PskFile;
pub use relay::{spawn_relay, RelayOutcome};

/// A session as it was agreed, for logs and status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionSummary {
    /// "TLSv1.3" and the like.
    pub version: &'static str,
    pub cipher: String,
    /// The PSK identity, or the client certificate's subject, when the
    /// peer authenticated.
    pub peer: Option<String>,
}
