//! NBD URIs: `nbd://host[:port]/export` and `nbd+unix:///export?socket=PATH`,
//! and their TLS forms `nbds://` and `nbds+unix://` with libnbd's
//! parameters (`tls-certificates=DIR`, `tls-psk-file=FILE`,
//! `tls-username=NAME` or `NAME@` before the host, `tls-verify-peer=false`,
//! `tls-hostname=NAME`), parsed, and printed back in a normalized form.

use std::ffi::OsString;
use std::fmt;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

use cairn_nbd_proto::proto::DEFAULT_TCP_PORT;

/// Where the server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdTransport {
    Tcp { host: String, port: u16 },
    Unix { socket: PathBuf },
}

/// A parsed NBD URI. `Display` gives the normalized form (explicit port,
/// lowercase host, canonical percent-encoding), used as the device identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    pub transport: NbdTransport,
    pub export: String,
    /// `nbds://` / `nbds+unix://`: STARTTLS is required.
    pub tls: Option<NbdTls>,
}

/// How to do TLS with the server (libnbd's URI parameters).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NbdTls {
    /// `ca-cert.pem` (and `client-cert.pem`, `client-key.pem`) in here.
    pub certificates: Option<PathBuf>,
    /// A psktool key file: authenticate with a pre-shared key.
    pub psk_file: Option<PathBuf>,
    /// The PSK user (`tls-username=` or `USER@` before the host).
    pub username: Option<String>,
    /// Check the server's certificate (default; `tls-verify-peer=false`
    /// turns it off).
    pub verify_peer: bool,
    /// The name the server's certificate must carry (default: the host,
    /// or `localhost` on a Unix socket).
    pub hostname: Option<String>,
}

impl NbdUri {
    pub fn parse(uri: &str) -> Result<NbdUri, String> {
        let (scheme, rest) = uri
            .split_once("://")
            .ok_or_else(|| format!("{uri:?} is not a URI (expected nbd://host/export or nbd+unix:///export?socket=PATH)"))?;
        let scheme = scheme.to_ascii_lowercase();
        let (unix, tls) = match scheme.as_str() {
            "nbd" => (false, false),
            "nbd+unix" => (true, false),
            "nbds" => (false, true),
            "nbds+unix" => (true, true),
            _ => {
                return Err(format!(
                    "{uri:?}: unknown scheme {scheme:?}, expected nbd, nbd+unix, nbds or nbds+unix"
                ))
            }
        };
        let rest = rest.split_once('#').map_or(rest, |(before, _)| before);
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, path) = match rest.find('/') {
            Some(slash) => (&rest[..slash], &rest[slash..]),
            None => (rest, ""),
        };
        let export = parse_export(uri, path)?;
        let query = parse_query(uri, query)?;
        // libnbd takes the PSK user from the authority's userinfo.
        let (user, authority) = match authority.rsplit_once('@') {
            Some((user, rest)) => (Some(user), rest),
            None => (None, authority),
        };
        let transport = if unix {
            unix_transport(uri, authority, query.socket)?
        } else {
            tcp_transport(uri, authority)?
        };
        let mut tls_settings = query.tls;
        if let Some(user) = user.filter(|u| tls && !u.is_empty()) {
            let user = percent_decode(user).map_err(|e| format!("{uri:?}: user: {e}"))?;
            let user =
                String::from_utf8(user).map_err(|_| format!("{uri:?}: the user is not UTF-8"))?;
            tls_settings.username.get_or_insert(user);
        }
        let tls = if tls {
            Some(tls_settings)
        } else if query.tls_parameters {
            return Err(format!(
                "{uri:?}: tls-* parameters need TLS: write nbds:// or nbds+unix://"
            ));
        } else {
            None
        };
        Ok(NbdUri {
            transport,
            export,
            tls,
        })
    }
}

/// What the query string holds.
struct Query {
    socket: Option<Vec<u8>>,
    tls: NbdTls,
    /// Some `tls-*` parameter was given.
    tls_parameters: bool,
}

/// The export name: the path without its leading slash, percent-decoded.
fn parse_export(uri: &str, path: &str) -> Result<String, String> {
    let export_bytes = percent_decode(path.strip_prefix('/').unwrap_or(path))
        .map_err(|e| format!("{uri:?}: export name: {e}"))?;
    let export = String::from_utf8(export_bytes)
        .map_err(|_| format!("{uri:?}: export name is not UTF-8"))?;
    if export.contains('\0') {
        return Err(format!("{uri:?}: export name contains NUL"));
    }
    Ok(export)
}

/// The query parameters, percent-decoded (the last of each wins);
/// others are ignored, as libnbd ignores what it does not know.
fn parse_query(uri: &str, query: &str) -> Result<Query, String> {
    let mut q = Query {
        socket: None,
        tls: NbdTls {
            verify_peer: true,
            ..NbdTls::default()
        },
        tls_parameters: false,
    };
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let bytes = || percent_decode(value).map_err(|e| format!("{uri:?}: {key}: {e}"));
        let text =
            || String::from_utf8(bytes()?).map_err(|_| format!("{uri:?}: {key} is not UTF-8"));
        let path = || bytes().map(|b| PathBuf::from(OsString::from_vec(b)));
        q.tls_parameters |= key.starts_with("tls-");
        match key {
            "socket" => q.socket = Some(bytes()?),
            "tls-certificates" => q.tls.certificates = Some(path()?),
            "tls-psk-file" => q.tls.psk_file = Some(path()?),
            "tls-username" => q.tls.username = Some(text()?),
            "tls-hostname" => q.tls.hostname = Some(text()?),
            "tls-verify-peer" => {
                q.tls.verify_peer = match text()?.as_str() {
                    "true" | "1" | "yes" | "on" => true,
                    "false" | "0" | "no" | "off" => false,
                    other => {
                        return Err(format!(
                            "{uri:?}: tls-verify-peer={other:?}, expected true or false"
                        ))
                    }
                }
            }
            _ => {}
        }
    }
    if q.tls.certificates.is_some() && q.tls.psk_file.is_some() {
        return Err(format!(
            "{uri:?}: give tls-certificates or tls-psk-file, not both"
        ));
    }
    Ok(q)
}

impl NbdTls {
    /// The parameters in a fixed order, for the normalized URI.
    fn query_pairs(&self) -> Vec<(&'static str, String)> {
        let path = |p: &PathBuf| percent_encode(p.as_os_str().as_bytes(), b"/");
        let mut pairs = Vec::new();
        if let Some(dir) = &self.certificates {
            pairs.push(("tls-certificates", path(dir)));
        }
        if let Some(file) = &self.psk_file {
            pairs.push(("tls-psk-file", path(file)));
        }
        if let Some(user) = &self.username {
            pairs.push(("tls-username", percent_encode(user.as_bytes(), b"")));
        }
        if let Some(host) = &self.hostname {
            pairs.push(("tls-hostname", percent_encode(host.as_bytes(), b"")));
        }
        if !self.verify_peer {
            pairs.push(("tls-verify-peer", "false".to_string()));
        }
        pairs
    }
}

fn unix_transport(
    uri: &str,
    authority: &str,
    socket: Option<Vec<u8>>,
) -> Result<NbdTransport, String> {
    if !authority.is_empty() {
        return Err(format!(
            "{uri:?}: nbd+unix URIs take no host (write nbd+unix:///export?socket=PATH)"
        ));
    }
    let socket = socket.ok_or_else(|| format!("{uri:?}: nbd+unix needs ?socket=PATH"))?;
    if socket.is_empty() {
        return Err(format!("{uri:?}: empty socket path"));
    }
    if socket[0] == 0 {
        return Err(format!("{uri:?}: abstract unix sockets are not supported"));
    }
    Ok(NbdTransport::Unix {
        socket: PathBuf::from(OsString::from_vec(socket)),
    })
}

fn tcp_transport(uri: &str, authority: &str) -> Result<NbdTransport, String> {
    let host_port = authority;
    let (host, port) = if let Some(bracketed) = host_port.strip_prefix('[') {
        let (host, after) = bracketed
            .split_once(']')
            .ok_or_else(|| format!("{uri:?}: unterminated [IPv6] host"))?;
        let port = match after.strip_prefix(':') {
            Some(port) => Some(port),
            None if after.is_empty() => None,
            None => return Err(format!("{uri:?}: junk after ]")),
        };
        (host, port)
    } else {
        match host_port.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (host_port, None),
        }
    };
    if host.is_empty() {
        return Err(format!("{uri:?}: nbd:// needs a host"));
    }
    let port = match port {
        None | Some("") => DEFAULT_TCP_PORT,
        Some(port) => port
            .parse::<u16>()
            .map_err(|_| format!("{uri:?}: bad port {port:?}"))?,
    };
    Ok(NbdTransport::Tcp {
        host: host.to_ascii_lowercase(),
        port,
    })
}

/// The normalized URI, also the origin's identity: with the TLS
/// parameters, so a cache reopens its origin from the identity alone.
impl fmt::Display for NbdUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let export = percent_encode(self.export.as_bytes(), b"/");
        let s = if self.tls.is_some() { "s" } else { "" };
        let mut query: Vec<(&str, String)> = Vec::new();
        match &self.transport {
            NbdTransport::Tcp { host, port } if host.contains(':') => {
                write!(f, "nbd{s}://[{host}]:{port}/{export}")?
            }
            NbdTransport::Tcp { host, port } => write!(f, "nbd{s}://{host}:{port}/{export}")?,
            NbdTransport::Unix { socket } => {
                write!(f, "nbd{s}+unix:///{export}")?;
                query.push((
                    "socket",
                    percent_encode(socket.as_os_str().as_bytes(), b"/"),
                ));
            }
        }
        if let Some(tls) = &self.tls {
            query.extend(tls.query_pairs());
        }
        for (i, (key, value)) in query.iter().enumerate() {
            write!(f, "{}{key}={value}", if i == 0 { '?' } else { '&' })?;
        }
        Ok(())
    }
}

fn percent_decode(s: &str) -> Result<Vec<u8>, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent escape in {s:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(out)
}

fn percent_encode(bytes: &[u8], also_keep: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for &b in bytes {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) || also_keep.contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_tcp_uris() {
        let uri = NbdUri::parse("nbd://Example.COM/disk").unwrap();
        assert_eq!(
            uri.transport,
            NbdTransport::Tcp {
                host: "example.com".into(),
                port: 10809
            }
        );
        assert_eq!(uri.export, "disk");
        assert_eq!(uri.to_string(), "nbd://example.com:10809/disk");

        let uri = NbdUri::parse("nbd://127.0.0.1:1234").unwrap();
        assert_eq!(uri.export, "");
        assert_eq!(uri.to_string(), "nbd://127.0.0.1:1234/");

        let uri = NbdUri::parse("nbd://[::1]:99//abs%20name").unwrap();
        assert_eq!(
            uri.transport,
            NbdTransport::Tcp {
                host: "::1".into(),
                port: 99
            }
        );
        assert_eq!(uri.export, "/abs name");
        assert_eq!(uri.to_string(), "nbd://[::1]:99//abs%20name");
        // The normalized form parses back to the same URI.
        assert_eq!(NbdUri::parse(&uri.to_string()).unwrap(), uri);
    }

    #[test]
    fn parse_unix_uris() {
        let uri = NbdUri::parse("nbd+unix:///exp?socket=/run/nbd%20x.sock").unwrap();
        assert_eq!(
            uri.transport,
            NbdTransport::Unix {
                socket: PathBuf::from("/run/nbd x.sock")
            }
        );
        assert_eq!(uri.export, "exp");
        assert_eq!(uri.to_string(), "nbd+unix:///exp?socket=/run/nbd%20x.sock");
        assert_eq!(NbdUri::parse(&uri.to_string()).unwrap(), uri);
        let uri = NbdUri::parse("nbd+unix://?socket=s.sock").unwrap();
        assert_eq!(uri.export, "");
    }

    #[test]
    fn parse_tls_uris() {
        let uri = NbdUri::parse("nbds://alice@Host:99/disk?tls-psk-file=/etc/k%20s.psk").unwrap();
        let tls = uri.tls.clone().unwrap();
        assert_eq!(tls.username.as_deref(), Some("alice"));
        assert_eq!(tls.psk_file, Some(PathBuf::from("/etc/k s.psk")));
        assert!(tls.verify_peer);
        assert_eq!(
            uri.to_string(),
            "nbds://host:99/disk?tls-psk-file=/etc/k%20s.psk&tls-username=alice"
        );
        assert_eq!(NbdUri::parse(&uri.to_string()).unwrap(), uri);

        let uri = NbdUri::parse(
            "nbds+unix:///e?socket=/s&tls-certificates=/pki&tls-verify-peer=false&tls-hostname=srv",
        )
        .unwrap();
        let tls = uri.tls.clone().unwrap();
        assert_eq!(tls.certificates, Some(PathBuf::from("/pki")));
        assert!(!tls.verify_peer);
        assert_eq!(tls.hostname.as_deref(), Some("srv"));
        assert_eq!(NbdUri::parse(&uri.to_string()).unwrap(), uri);
        // No parameters: X.509 with the system's CAs.
        let uri = NbdUri::parse("nbds://h/").unwrap();
        assert_eq!(uri.tls.as_ref().map(|t| t.verify_peer), Some(true));
        assert_eq!(uri.to_string(), "nbds://h:10809/");
        // Plain URIs stay as they were (identities recorded before TLS).
        assert_eq!(
            NbdUri::parse("nbd://u@h/x").unwrap().to_string(),
            "nbd://h:10809/x"
        );
    }

    #[test]
    fn reject_bad_uris() {
        for bad in [
            "/dev/sda",
            "http://host/x",
            "nbd://host/x?tls-psk-file=/k",
            "nbds://host/x?tls-psk-file=/k&tls-certificates=/d",
            "nbds://host/x?tls-verify-peer=maybe",
            "nbd+unix:///x",
            "nbd+unix://host/x?socket=/s",
            "nbd://host:notaport/x",
            "nbd://host:70000/x",
            "nbd:///x",
            "nbd://[::1/x",
            "nbd://host/%zz",
            "nbd+unix:///?socket=%00abstract",
        ] {
            assert!(NbdUri::parse(bad).is_err(), "{bad} should be refused");
        }
    }
}
