//! What server and client contexts share: protocol floor, write modes,
//! cipher lists, and the rendering of sessions and failures.

use std::path::{Path, PathBuf};

use openssl::ssl::{
    Error as SslError, SslContextBuilder, SslFiletype, SslMode, SslOptions, SslRef, SslVersion,
};

use crate::{SessionSummary, TlsError};

/// TLS 1.2 suites for a PSK-only context, forward-secret ones first
/// (GnuTLS clients offer ECDHE-PSK, DHE-PSK and PSK); TLS 1.3 uses its
/// own suites and negotiates (EC)DHE with the key.
pub(crate) const PSK_CIPHERS: &str = "ECDHE-PSK:DHE-PSK:PSK:!NULL:!eNULL:!3DES:!RC4";

const TLS13_SUITES: &str =
    "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256";

pub(crate) fn configure_common(builder: &mut SslContextBuilder) -> Result<(), TlsError> {
    builder
        .set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(TlsError::setup)?;
    // AES-GCM first: with AES-NI it is several times faster than
    // ChaCha20, and SHA-256 suites first because an external PSK is bound
    // to SHA-256.
    builder
        .set_ciphersuites(TLS13_SUITES)
        .map_err(TlsError::setup)?;
    // The relay writes at most one record per call and retries from a
    // buffer that may have moved (it compacts).
    builder.set_mode(SslMode::ENABLE_PARTIAL_WRITE | SslMode::ACCEPT_MOVING_WRITE_BUFFER);
    builder.set_options(
        SslOptions::NO_COMPRESSION
            | SslOptions::NO_RENEGOTIATION
            | SslOptions::CIPHER_SERVER_PREFERENCE,
    );
    Ok(())
}

pub(crate) fn summarize(
    ssl: &SslRef,
    identity: Option<openssl::ex_data::Index<openssl::ssl::Ssl, String>>,
) -> SessionSummary {
    let psk_user = identity.and_then(|index| ssl.ex_data(index).cloned());
    let certificate = ssl.peer_certificate().map(|cert| {
        cert.subject_name()
            .entries()
            .map(|entry| {
                let key = entry.object().nid().short_name().unwrap_or("?");
                let value = entry.data().to_string().unwrap_or_default();
                format!("{key}={value}")
            })
            .collect::<Vec<_>>()
            .join(",")
    });
    SessionSummary {
        version: ssl.version_str(),
        cipher: ssl
            .current_cipher()
            .map(|c| c.name().to_string())
            .unwrap_or_default(),
        peer: psk_user.or(certificate),
    }
}

/// Most times a handshake is resumed after a signal interrupted its
/// socket (a socket with a timeout is not restarted by SA_RESTART).
const MAX_HANDSHAKE_INTERRUPTS: usize = 1000;

/// Finish a blocking handshake: resumed when a signal interrupted it, a
/// timeout (the socket's) reported as such.
pub(crate) fn finish_handshake<S: std::io::Read + std::io::Write>(
    mut result: Result<openssl::ssl::SslStream<S>, openssl::ssl::HandshakeError<S>>,
) -> Result<openssl::ssl::SslStream<S>, TlsError> {
    use openssl::ssl::HandshakeError;
    for _ in 0..MAX_HANDSHAKE_INTERRUPTS {
        match result {
            Ok(stream) => return Ok(stream),
            Err(HandshakeError::SetupFailure(e)) => return Err(TlsError::setup(e)),
            Err(HandshakeError::WouldBlock(_)) => return Err(TlsError::HandshakeTimeout),
            Err(HandshakeError::Failure(mid)) => {
                let interrupted = mid
                    .error()
                    .io_error()
                    .is_some_and(|e| e.kind() == std::io::ErrorKind::Interrupted);
                if !interrupted {
                    return Err(handshake_error(mid.error(), mid.ssl()));
                }
                result = mid.handshake();
            }
        }
    }
    Err(TlsError::Handshake(
        "interrupted by signals too many times".to_string(),
    ))
}

pub(crate) fn handshake_error(error: &SslError, ssl: &SslRef) -> TlsError {
    use openssl::x509::X509VerifyResult;
    let verify = ssl.verify_result();
    let mut message = match error.ssl_error() {
        Some(stack) => stack.to_string(),
        None => match error.io_error() {
            Some(io) if io.kind() == std::io::ErrorKind::WouldBlock => {
                return TlsError::HandshakeTimeout
            }
            Some(io) => io.to_string(),
            None => "the peer closed the connection".to_string(),
        },
    };
    if verify != X509VerifyResult::OK {
        message.push_str(&format!(" (certificate: {})", verify.error_string()));
    }
    TlsError::Handshake(message)
}

pub(crate) fn required(
    dir: &Path,
    name: &'static str,
    fix: &'static str,
) -> Result<PathBuf, TlsError> {
    let path = dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(TlsError::MissingFile {
            dir: dir.to_path_buf(),
            what: name,
            fix,
        })
    }
}

pub(crate) fn bad(path: &Path, what: &'static str, e: openssl::error::ErrorStack) -> TlsError {
    TlsError::BadCredential {
        path: path.to_path_buf(),
        what,
        reason: e.to_string(),
    }
}

/// A certificate chain and its key, checked to belong together.
pub(crate) fn load_identity(
    builder: &mut SslContextBuilder,
    cert: &Path,
    key: &Path,
) -> Result<(), TlsError> {
    builder
        .set_certificate_chain_file(cert)
        .map_err(|e| bad(cert, "a certificate chain (PEM)", e))?;
    builder
        .set_private_key_file(key, SslFiletype::PEM)
        .map_err(|e| bad(key, "a private key (PEM)", e))?;
    builder
        .check_private_key()
        .map_err(|e| bad(key, "the key of its certificate (they do not match)", e))
}
