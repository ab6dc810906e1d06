//! `serve`'s options for who may connect and how many at once, shared
//! with the demo (which takes the defaults).

use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use cairn_nbd::codec::TlsPolicy;
use cairn_nbd::{ServerConfig, SocketAccess};
use cairn_tls::{ServerCredentials, TlsAcceptor};

const DEFAULT_MAX_CONNECTIONS: u32 = 32;
const DEFAULT_MAX_HANDSHAKES: u32 = 64;
const DEFAULT_MAX_HANDSHAKES_PER_PEER: u32 = 16;
const DEFAULT_HANDSHAKE_TIMEOUT_SECS: u32 = 5;
const DEFAULT_MAX_IN_FLIGHT_PER_CONNECTION: u32 =
    cairn_nbd::DEFAULT_MAX_IN_FLIGHT_PER_CONNECTION as u32;

#[derive(clap::Args, Debug, Clone)]
pub struct ConnectionArgs {
    /// Clients served at once (connections past the NBD handshake). One
    /// more that finishes its handshake is closed and counted as refused.
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_connections: u32,
    /// Connections still in the handshake at once, counted apart from the
    /// clients being served. A new one beyond this closes the oldest, so
    /// connections that never finish their handshake cannot lock real
    /// clients out.
    #[arg(long, default_value_t = DEFAULT_MAX_HANDSHAKES, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_handshakes: u32,
    /// Handshakes of one peer at once (an IP address over TCP, a user id on
    /// the Unix socket); a new one beyond this closes that peer's oldest.
    #[arg(long, default_value_t = DEFAULT_MAX_HANDSHAKES_PER_PEER, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_handshakes_per_peer: u32,
    /// A client that has not finished the handshake after this long is
    /// disconnected.
    #[arg(long, default_value_t = DEFAULT_HANDSHAKE_TIMEOUT_SECS, value_name = "SECONDS", value_parser = clap::value_parser!(u32).range(1..=3600))]
    pub handshake_timeout_secs: u32,
    /// Requests one client may have running or answered but not yet sent
    /// at once; beyond this cairn stops reading that client's socket until
    /// a reply has gone out (counted as `in_flight_limit_waits`). Their
    /// payloads also count against the server's buffer budget, of which one
    /// client may hold a quarter. Deeper queues let a fast cache device
    /// serve more reads at once; a smaller one bounds what one client can
    /// hold.
    #[arg(long, default_value_t = DEFAULT_MAX_IN_FLIGHT_PER_CONNECTION, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub max_in_flight_per_connection: u32,
    /// Serve the volume read-only: clients see the read-only flag and every
    /// write, trim or zeroing is refused with EPERM. Write-back of data
    /// already in the cache goes on.
    #[arg(long)]
    pub read_only: bool,
    /// File mode of the Unix socket, in octal (e.g. 0660): who may connect.
    /// Set before the socket appears, so no client connects under a wider
    /// mode. [default: what the umask gives]
    #[arg(long, value_name = "OCTAL", value_parser = parse_mode)]
    pub socket_mode: Option<u32>,
    /// Group of the Unix socket (a name or a number), so that group's
    /// members may connect under --socket-mode 0660.
    #[arg(long, value_name = "GROUP")]
    pub socket_group: Option<String>,
    /// With --listen: accept TCP clients only from this network (CIDR, e.g.
    /// 192.168.1.0/24 or fd00::/8; a bare address is one host). Repeat for
    /// several; others are closed at once, before the handshake. Without
    /// it every address that reaches the port is served.
    #[arg(long, value_name = "CIDR", value_parser = parse_cidr)]
    pub allow: Vec<ipnet::IpNet>,
    /// TLS, as nbdkit's --tls: `off`; `on` (clients may upgrade with
    /// STARTTLS or stay in clear text); `require` (nothing but STARTTLS is
    /// answered before TLS: no export name, size or data in clear text).
    /// [default: require when credentials are given, else off]
    #[arg(long, value_enum, value_name = "MODE")]
    pub tls: Option<TlsMode>,
    /// X.509 credentials: a directory with server-cert.pem and
    /// server-key.pem (and ca-cert.pem for --tls-verify-peer), laid out as
    /// for nbdkit --tls-certificates and qemu's tls-creds-x509.
    #[arg(long, value_name = "DIR", conflicts_with = "tls_psk")]
    pub tls_certificates: Option<PathBuf>,
    /// With --tls-certificates: clients must present a certificate signed
    /// by ca-cert.pem (authentication by certificate).
    #[arg(long, requires = "tls_certificates")]
    pub tls_verify_peer: bool,
    /// Pre-shared keys: a file of `username:hexkey` lines, as
    /// `psktool -u NAME -p FILE` writes it; a client must know one user's
    /// key. Authentication without a PKI.
    #[arg(long, value_name = "FILE")]
    pub tls_psk: Option<PathBuf>,
}

/// `--tls`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    Off,
    On,
    Require,
}

fn parse_mode(value: &str) -> Result<u32, String> {
    let digits = value.strip_prefix("0o").unwrap_or(value);
    match u32::from_str_radix(digits, 8) {
        Ok(mode) if mode <= 0o777 => Ok(mode),
        _ => Err(format!(
            "{value:?} is not an octal file mode from 0 to 0777 (e.g. 0660)"
        )),
    }
}

fn parse_cidr(value: &str) -> Result<ipnet::IpNet, String> {
    if let Ok(net) = value.parse::<ipnet::IpNet>() {
        return Ok(net.trunc());
    }
    value
        .parse::<std::net::IpAddr>()
        .map(ipnet::IpNet::from)
        .map_err(|_| format!("{value:?} is not a network (e.g. 10.0.0.0/8) or an address"))
}

/// A group name or number, as its id.
fn group_id(group: &str) -> Result<u32> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    let name = CString::new(group).context("the group name has a NUL byte")?;
    let mut grp: libc::group = unsafe_zeroed_group();
    let mut buf = vec![0u8; 16 << 10];
    let mut result: *mut libc::group = std::ptr::null_mut();
    // SAFETY: getgrnam_r fills `grp` with pointers into `buf`, both live
    // across the call; `result` is an out-parameter.
    let rc = unsafe {
        libc::getgrnam_r(
            name.as_ptr(),
            &mut grp,
            buf.as_mut_ptr() as *mut libc::c_char,
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() {
        bail!("--socket-group {group}: no such group");
    }
    // SAFETY: on success `grp.gr_name` points at a NUL-terminated name in `buf`.
    let found = unsafe { CStr::from_ptr(grp.gr_name) };
    tracing::debug!(group = %found.to_string_lossy(), gid = grp.gr_gid, "socket group");
    Ok(grp.gr_gid)
}

fn unsafe_zeroed_group() -> libc::group {
    // SAFETY: libc::group is a plain C struct of pointers and integers, for
    // which all zeroes is a valid (empty) value.
    unsafe { std::mem::zeroed() }
}

impl Default for ConnectionArgs {
    fn default() -> Self {
        ConnectionArgs {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_handshakes: DEFAULT_MAX_HANDSHAKES,
            max_handshakes_per_peer: DEFAULT_MAX_HANDSHAKES_PER_PEER,
            handshake_timeout_secs: DEFAULT_HANDSHAKE_TIMEOUT_SECS,
            max_in_flight_per_connection: DEFAULT_MAX_IN_FLIGHT_PER_CONNECTION,
            read_only: false,
            socket_mode: None,
            socket_group: None,
            allow: Vec::new(),
            tls: None,
            tls_certificates: None,
            tls_verify_peer: false,
            tls_psk: None,
        }
    }
}

impl ConnectionArgs {
    /// Put these limits into the server's configuration, loading the TLS
    /// credentials.
    pub fn apply(&self, config: &mut ServerConfig) -> Result<()> {
        let (policy, acceptor) = self.tls_setup()?;
        config.tls = policy;
        config.tls_acceptor = acceptor;
        config.max_connections = self.max_connections as usize;
        config.max_handshakes = self.max_handshakes as usize;
        config.max_handshakes_per_peer = self.max_handshakes_per_peer as usize;
        config.handshake_timeout_ms = u64::from(self.handshake_timeout_secs) * 1000;
        config.max_in_flight_per_connection = self.max_in_flight_per_connection as usize;
        config.read_only = self.read_only;
        config.allow = self.allow.clone();
        Ok(())
    }

    fn tls_setup(&self) -> Result<(TlsPolicy, Option<Arc<TlsAcceptor>>)> {
        let credentials = match (&self.tls_certificates, &self.tls_psk) {
            (Some(dir), None) => Some(ServerCredentials::X509 {
                dir: dir.clone(),
                verify_peer: self.tls_verify_peer,
            }),
            (None, Some(file)) => Some(ServerCredentials::Psk { file: file.clone() }),
            (None, None) => None,
            (Some(_), Some(_)) => bail!("give either --tls-certificates or --tls-psk, not both"),
        };
        let policy = match (self.tls, credentials.is_some()) {
            (None, false) | (Some(TlsMode::Off), false) => TlsPolicy::Off,
            (Some(TlsMode::Off), true) => {
                bail!("--tls=off with TLS credentials: drop --tls-certificates/--tls-psk, or use --tls=on or --tls=require")
            }
            (Some(TlsMode::On | TlsMode::Require), false) => {
                bail!("--tls needs credentials: --tls-certificates=DIR (X.509) or --tls-psk=FILE (pre-shared keys, from psktool)")
            }
            (Some(TlsMode::On), true) => TlsPolicy::Offered,
            (None | Some(TlsMode::Require), true) => TlsPolicy::Required,
        };
        let Some(credentials) = credentials else {
            return Ok((policy, None));
        };
        let acceptor = TlsAcceptor::new(&credentials).context("loading the TLS credentials")?;
        tracing::info!(credentials = acceptor.description(), ?policy, "TLS");
        Ok((policy, Some(Arc::new(acceptor))))
    }

    /// The Unix socket's mode and group, checked against how the daemon
    /// listens (`tcp`: --listen; `activated`: a socket from systemd).
    pub fn socket_access(&self, tcp: bool, activated: bool) -> Result<SocketAccess> {
        let wants_access = self.socket_mode.is_some() || self.socket_group.is_some();
        if activated && wants_access {
            bail!("under socket activation the socket's mode and group come from the .socket unit (SocketMode=, SocketGroup=); drop --socket-mode and --socket-group");
        }
        if tcp && wants_access {
            bail!("--socket-mode and --socket-group apply to the Unix socket, not to --listen");
        }
        if !tcp && !activated && !self.allow.is_empty() {
            bail!("--allow applies to TCP clients (--listen); the Unix socket is governed by --socket-mode and --socket-group");
        }
        Ok(SocketAccess {
            mode: self.socket_mode,
            gid: self.socket_group.as_deref().map(group_id).transpose()?,
        })
    }
}
