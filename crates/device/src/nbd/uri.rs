//! NBD URIs: `nbd://host[:port]/export` and `nbd+unix:///export?socket=PATH`,
//! parsed, and printed back in a normalized form.

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
}

impl NbdUri {
    pub fn parse(uri: &str) -> Result<NbdUri, String> {
        let (scheme, rest) = uri
            .split_once("://")
            .ok_or_else(|| format!("{uri:?} is not a URI (expected nbd://host/export or nbd+unix:///export?socket=PATH)"))?;
        let scheme = scheme.to_ascii_lowercase();
        if scheme == "nbds" || scheme == "nbds+unix" {
            return Err(format!("{uri:?}: TLS ({scheme}://) is not supported"));
        }
        if scheme != "nbd" && scheme != "nbd+unix" {
            return Err(format!(
                "{uri:?}: unknown scheme {scheme:?}, expected nbd or nbd+unix"
            ));
        }
        let rest = rest.split_once('#').map_or(rest, |(before, _)| before);
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, path) = match rest.find('/') {
            Some(slash) => (&rest[..slash], &rest[slash..]),
            None => (rest, ""),
        };
        let export = parse_export(uri, path)?;
        let socket = parse_socket_query(uri, query)?;
        let transport = if scheme == "nbd+unix" {
            unix_transport(uri, authority, socket)?
        } else {
            tcp_transport(uri, authority)?
        };
        Ok(NbdUri { transport, export })
    }
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

/// The `socket=` query parameter, percent-decoded (the last one wins).
fn parse_socket_query(uri: &str, query: &str) -> Result<Option<Vec<u8>>, String> {
    let mut socket: Option<Vec<u8>> = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key == "socket" {
            socket = Some(percent_decode(value).map_err(|e| format!("{uri:?}: socket: {e}"))?);
        }
    }
    Ok(socket)
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
    // Userinfo only matters for TLS, which we do not do.
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
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

impl fmt::Display for NbdUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let export = percent_encode(self.export.as_bytes(), b"/");
        match &self.transport {
            NbdTransport::Tcp { host, port } if host.contains(':') => {
                write!(f, "nbd://[{host}]:{port}/{export}")
            }
            NbdTransport::Tcp { host, port } => write!(f, "nbd://{host}:{port}/{export}"),
            NbdTransport::Unix { socket } => write!(
                f,
                "nbd+unix:///{export}?socket={}",
                percent_encode(socket.as_os_str().as_bytes(), b"/")
            ),
        }
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
    fn reject_bad_uris() {
        for bad in [
            "/dev/sda",
            "http://host/x",
            "nbds://host/x",
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
