//! The server side: credentials from nbdkit's option names, and the
//! handshake on an accepted socket.

use std::fmt;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use openssl::ssl::{
    Ssl, SslContext, SslContextBuilder, SslMethod, SslRef, SslStream, SslVerifyMode,
};
use openssl::x509::X509Name;

use crate::context::{
    bad, configure_common, finish_handshake, load_identity, required, summarize, PSK_CIPHERS,
};
use crate::{PskFile, SessionSummary, TlsError};

/// How the server proves itself and, optionally, checks its clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerCredentials {
    /// `DIR/server-cert.pem` and `DIR/server-key.pem`; with `verify_peer`,
    /// clients must present a certificate signed by `DIR/ca-cert.pem`.
    X509 { dir: PathBuf, verify_peer: bool },
    /// A `psktool` key file: a client must know one user's key.
    Psk { file: PathBuf },
}

/// A server TLS context, made once and used for every connection.
pub struct TlsAcceptor {
    context: SslContext,
    description: String,
}

impl fmt::Debug for TlsAcceptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsAcceptor")
            .field("credentials", &self.description)
            .finish()
    }
}

/// Where the PSK identity a client authenticated with is kept on its
/// connection, for the session summary.
pub(crate) fn identity_index() -> Result<openssl::ex_data::Index<Ssl, String>, TlsError> {
    static INDEX: OnceLock<openssl::ex_data::Index<Ssl, String>> = OnceLock::new();
    if let Some(index) = INDEX.get() {
        return Ok(*index);
    }
    let index = Ssl::new_ex_index::<String>().map_err(TlsError::setup)?;
    Ok(*INDEX.get_or_init(|| index))
}

impl TlsAcceptor {
    pub fn new(credentials: &ServerCredentials) -> Result<TlsAcceptor, TlsError> {
        let mut builder =
            SslContextBuilder::new(SslMethod::tls_server()).map_err(TlsError::setup)?;
        configure_common(&mut builder)?;
        let description = match credentials {
            ServerCredentials::X509 { dir, verify_peer } => {
                load_x509(&mut builder, dir, *verify_peer)?;
                format!(
                    "X.509 from {}{}",
                    dir.display(),
                    if *verify_peer {
                        ", client certificates required"
                    } else {
                        ""
                    }
                )
            }
            ServerCredentials::Psk { file } => {
                let keys = Arc::new(PskFile::load(file)?);
                let index = identity_index()?;
                builder.set_psk_server_callback(move |ssl, identity, psk| {
                    Ok(server_psk(&keys, index, ssl, identity, psk))
                });
                builder
                    .set_cipher_list(PSK_CIPHERS)
                    .map_err(TlsError::setup)?;
                format!("pre-shared keys from {}", file.display())
            }
        };
        Ok(TlsAcceptor {
            context: builder.build(),
            description,
        })
    }

    /// "X.509 from DIR" or "pre-shared keys from FILE", for logs.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Run the server's handshake on `stream` (blocking; a read or write
    /// timeout set on the socket bounds it).
    pub fn accept<S: Read + Write>(
        &self,
        stream: S,
    ) -> Result<(SslStream<S>, SessionSummary), TlsError> {
        let ssl = Ssl::new(&self.context).map_err(TlsError::setup)?;
        let stream = finish_handshake(ssl.accept(stream))?;
        let summary = summarize(stream.ssl(), identity_index().ok());
        Ok((stream, summary))
    }
}

/// The key for `identity`, written into `psk`; 0 refuses the client.
fn server_psk(
    keys: &PskFile,
    index: openssl::ex_data::Index<Ssl, String>,
    ssl: &mut SslRef,
    identity: Option<&[u8]>,
    psk: &mut [u8],
) -> usize {
    let identity = identity.unwrap_or_default();
    let shown = String::from_utf8_lossy(&identity[..identity.len().min(128)]).into_owned();
    match keys.key(identity) {
        Some(key) if key.len() <= psk.len() => {
            psk[..key.len()].copy_from_slice(key);
            ssl.set_ex_data(index, shown);
            key.len()
        }
        Some(_) => {
            tracing::warn!(user = %shown, "pre-shared key longer than TLS allows; refusing");
            0
        }
        None => {
            tracing::warn!(user = %shown, file = %keys.path().display(), "TLS client named a user with no key; refusing");
            0
        }
    }
}

fn load_x509(
    builder: &mut SslContextBuilder,
    dir: &Path,
    verify_peer: bool,
) -> Result<(), TlsError> {
    let cert = required(
        dir,
        "server-cert.pem",
        "put the server's certificate there (PEM), as for nbdkit --tls-certificates",
    )?;
    let key = required(
        dir,
        "server-key.pem",
        "put the server certificate's private key there (PEM)",
    )?;
    load_identity(builder, &cert, &key)?;
    if verify_peer {
        let ca = required(
            dir,
            "ca-cert.pem",
            "--tls-verify-peer checks client certificates against the CA certificate there",
        )?;
        builder
            .set_ca_file(&ca)
            .map_err(|e| bad(&ca, "the CA certificate", e))?;
        let names = X509Name::load_client_ca_file(&ca).map_err(|e| bad(&ca, "the CA list", e))?;
        builder.set_client_ca_list(names);
        builder.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
    }
    Ok(())
}
