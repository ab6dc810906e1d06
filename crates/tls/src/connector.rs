//! The client side (cairn reading an `nbds://` origin): credentials named
//! as libnbd names its URI parameters, and the handshake.

use std::fmt;
use std::io::{Read, Write};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use openssl::ssl::{Ssl, SslContext, SslContextBuilder, SslMethod, SslStream, SslVerifyMode};

use crate::context::{
    bad, configure_common, finish_handshake, load_identity, required, summarize, PSK_CIPHERS,
};
use crate::{PskFile, SessionSummary, TlsError};

/// Debian's bundle of the system's trusted CAs.
const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// How the client checks the server and proves itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientCredentials {
    /// Trust `DIR/ca-cert.pem` (the system's CAs without a directory) and
    /// present `DIR/client-cert.pem` + `DIR/client-key.pem` when they are
    /// there. `verify_peer: false` skips checking the server (libnbd's
    /// `tls-verify-peer=false`); `hostname` is the name its certificate
    /// must carry.
    X509 {
        dir: Option<PathBuf>,
        verify_peer: bool,
        hostname: String,
    },
    /// A `psktool` key file and the user whose key to use.
    Psk { file: PathBuf, username: String },
}

pub struct TlsConnector {
    context: SslContext,
    /// Checked against the server's certificate (X.509 with verification).
    verify_hostname: Option<String>,
    description: String,
}

impl fmt::Debug for TlsConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConnector")
            .field("credentials", &self.description)
            .finish()
    }
}

impl TlsConnector {
    pub fn new(credentials: &ClientCredentials) -> Result<TlsConnector, TlsError> {
        let mut builder =
            SslContextBuilder::new(SslMethod::tls_client()).map_err(TlsError::setup)?;
        configure_common(&mut builder)?;
        let (verify_hostname, description) = match credentials {
            ClientCredentials::X509 {
                dir,
                verify_peer,
                hostname,
            } => {
                load_x509(&mut builder, dir.as_deref(), *verify_peer)?;
                let description = match dir {
                    Some(dir) => format!("X.509 from {}", dir.display()),
                    None => "X.509, the system's CAs".to_string(),
                };
                (verify_peer.then(|| hostname.clone()), description)
            }
            ClientCredentials::Psk { file, username } => {
                let keys = PskFile::load(file)?;
                let Some(key) = keys.key(username.as_bytes()).map(<[u8]>::to_vec) else {
                    return Err(TlsError::PskUnknownUser {
                        path: file.clone(),
                        username: username.clone(),
                    });
                };
                let key = Arc::new(key);
                let identity = username.clone();
                builder.set_psk_client_callback(move |_ssl, _hint, identity_out, psk_out| {
                    // The identity is a C string: its bytes and a NUL.
                    if identity.len() + 1 > identity_out.len() || key.len() > psk_out.len() {
                        return Ok(0);
                    }
                    identity_out[..identity.len()].copy_from_slice(identity.as_bytes());
                    identity_out[identity.len()] = 0;
                    psk_out[..key.len()].copy_from_slice(&key);
                    Ok(key.len())
                });
                builder
                    .set_cipher_list(PSK_CIPHERS)
                    .map_err(TlsError::setup)?;
                (
                    None,
                    format!("pre-shared key of {username:?} from {}", file.display()),
                )
            }
        };
        Ok(TlsConnector {
            context: builder.build(),
            verify_hostname,
            description,
        })
    }

    pub fn description(&self) -> &str {
        &self.description
    }

    /// Run the client's handshake on `stream` (blocking; a timeout set on
    /// the socket bounds it).
    pub fn connect<S: Read + Write>(
        &self,
        stream: S,
    ) -> Result<(SslStream<S>, SessionSummary), TlsError> {
        let mut ssl = Ssl::new(&self.context).map_err(TlsError::setup)?;
        if let Some(host) = &self.verify_hostname {
            match host.parse::<IpAddr>() {
                Ok(ip) => ssl.param_mut().set_ip(ip).map_err(TlsError::setup)?,
                Err(_) => {
                    ssl.param_mut().set_host(host).map_err(TlsError::setup)?;
                    ssl.set_hostname(host).map_err(TlsError::setup)?;
                }
            }
        }
        let stream = finish_handshake(ssl.connect(stream))?;
        let summary = summarize(stream.ssl(), None);
        Ok((stream, summary))
    }
}

fn load_x509(
    builder: &mut SslContextBuilder,
    dir: Option<&Path>,
    verify_peer: bool,
) -> Result<(), TlsError> {
    let ca = dir.map(|d| d.join("ca-cert.pem")).filter(|p| p.is_file());
    match &ca {
        Some(ca) => builder
            .set_ca_file(ca)
            .map_err(|e| bad(ca, "the CA certificate", e))?,
        None if verify_peer => {
            builder
                .set_default_verify_paths()
                .map_err(TlsError::setup)?;
            if Path::new(SYSTEM_CA_BUNDLE).is_file() {
                builder
                    .set_ca_file(SYSTEM_CA_BUNDLE)
                    .map_err(|e| bad(Path::new(SYSTEM_CA_BUNDLE), "the system's CAs", e))?;
            }
        }
        None => {}
    }
    builder.set_verify(if verify_peer {
        SslVerifyMode::PEER
    } else {
        SslVerifyMode::NONE
    });
    if let Some(dir) = dir {
        let cert = dir.join("client-cert.pem");
        if cert.is_file() {
            let key = required(
                dir,
                "client-key.pem",
                "client-cert.pem needs its private key beside it",
            )?;
            load_identity(builder, &cert, &key)?;
        }
    }
    Ok(())
}
