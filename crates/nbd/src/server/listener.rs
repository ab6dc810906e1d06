//! Listening sockets (unix, TCP, systemd socket activation) and the
//! connected stream type.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use super::ServerError;

/// The first file descriptor systemd passes (SD_LISTEN_FDS_START).
const SD_LISTEN_FDS_START: RawFd = 3;

/// fd 3 may be adopted once per process: two owners would double-close it.
static SYSTEMD_FD_TAKEN: AtomicBool = AtomicBool::new(false);

/// A socket the server accepts NBD clients on.
#[derive(Debug)]
pub struct Listener {
    kind: ListenerKind,
    /// Set when we created the socket file, so we remove it (only if it is
    /// still ours) when the listener goes away.
    owned_path: Option<OwnedSocketPath>,
    description: String,
}

#[derive(Debug)]
enum ListenerKind {
    Unix(UnixListener),
    Tcp(TcpListener),
}

#[derive(Debug)]
struct OwnedSocketPath {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl Listener {
    /// Listen on a unix socket at `path`.
    ///
    /// A socket file left by a dead server is replaced; a path where a live
    /// server answers is refused with [`ServerError::SocketInUse`]; a path
    /// holding anything but a socket is never touched. The socket is bound
    /// under a temporary name and renamed into place once it is listening,
    /// so clients never see a path that refuses connections.
    pub fn bind_unix(path: impl AsRef<Path>) -> Result<Listener, ServerError> {
        Self::bind_unix_with(path, &SocketAccess::default())
    }

    /// [`Listener::bind_unix`] with the socket file's mode and group set
    /// before clients can see it: under its temporary name, before the
    /// rename puts it in place.
    pub fn bind_unix_with(
        path: impl AsRef<Path>,
        access: &SocketAccess,
    ) -> Result<Listener, ServerError> {
        let path = path.as_ref();
        check_existing_socket(path)?;
        let listener = match bind_via_rename(path, access) {
            Ok(l) => l,
            // A long path may leave no room for the temporary name; fall
            // back to binding in place (the stale file, if any, goes first).
            Err(e)
                if e.raw_os_error() == Some(libc::ENAMETOOLONG)
                    || e.kind() == io::ErrorKind::InvalidInput =>
            {
                if *access != SocketAccess::default() {
                    // Bound in place, the socket would accept clients
                    // under the umask's mode before its own is set.
                    return Err(ServerError::Bind {
                        what: path.display().to_string(),
                        source: io::Error::new(
                            io::ErrorKind::InvalidInput,
                            "the socket path is too long to set its mode and group before clients see it; use a shorter path",
                        ),
                    });
                }
                remove_stale(path)?;
                UnixListener::bind(path).map_err(|source| ServerError::Bind {
                    what: path.display().to_string(),
                    source,
                })?
            }
            Err(source) => {
                return Err(ServerError::Bind {
                    what: path.display().to_string(),
                    source,
                })
            }
        };
        let meta = std::fs::symlink_metadata(path).map_err(|source| ServerError::Bind {
            what: path.display().to_string(),
            source,
        })?;
        Ok(Listener {
            kind: ListenerKind::Unix(listener),
            owned_path: Some(OwnedSocketPath {
                path: path.to_path_buf(),
                dev: meta.dev(),
                ino: meta.ino(),
            }),
            description: format!("unix:{}", path.display()),
        })
    }

    /// Listen on TCP. Use a loopback address unless you mean to export the
    /// device to the network, and then require TLS (`ServerConfig::tls`):
    /// clear-text NBD has no authentication.
    pub fn bind_tcp(addr: impl ToSocketAddrs) -> Result<Listener, ServerError> {
        let listener = TcpListener::bind(addr).map_err(|source| ServerError::Bind {
            what: "TCP address".to_string(),
            source,
        })?;
        let description = match listener.local_addr() {
            Ok(a) => format!("tcp:{a}"),
            Err(_) => "tcp".to_string(),
        };
        Ok(Listener {
            kind: ListenerKind::Tcp(listener),
            owned_path: None,
            description,
        })
    }

    /// Adopt the listening socket passed by systemd-style socket activation
    /// (`LISTEN_PID` = our pid, `LISTEN_FDS` >= 1, socket on fd 3), as done
    /// by `nbdinfo -- cmd` and libnbd's `connect_systemd_socket_activation`.
    ///
    /// Returns `Ok(None)` when the environment does not activate this
    /// process. Only the first passed socket is used.
    pub fn from_systemd() -> Result<Option<Listener>, ServerError> {
        let Some(fds) = systemd_listen_fds()? else {
            return Ok(None);
        };
        if fds > 1 {
            tracing::warn!(
                fds,
                "socket activation passed several sockets; using only fd 3"
            );
        }
        if SYSTEMD_FD_TAKEN.swap(true, Ordering::SeqCst) {
            return Err(ServerError::SocketActivation(
                "the activation socket was already adopted".to_string(),
            ));
        }
        let fd = SD_LISTEN_FDS_START;
        let family = check_listening_socket(fd)?;
        // SAFETY: `fd` is a listening socket (checked above) that the
        // activation protocol hands to this process, and the atomic flag
        // guarantees we wrap it exactly once, so the new owner is unique.
        let kind = unsafe {
            match family {
                libc::AF_UNIX => ListenerKind::Unix(UnixListener::from_raw_fd(fd)),
                _ => ListenerKind::Tcp(TcpListener::from_raw_fd(fd)),
            }
        };
        // Keep it from leaking into anything we might exec.
        // SAFETY: fcntl on an fd we now own, with valid arguments.
        unsafe {
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        }
        Ok(Some(Listener {
            kind,
            owned_path: None,
            description: "socket-activation:fd3".to_string(),
        }))
    }

    /// Where this listener listens, for logs ("unix:/run/x.sock", "tcp:...").
    pub fn description(&self) -> &str {
        &self.description
    }

    /// The bound TCP address (useful after binding port 0).
    pub fn tcp_local_addr(&self) -> Option<SocketAddr> {
        match &self.kind {
            ListenerKind::Tcp(l) => l.local_addr().ok(),
            ListenerKind::Unix(_) => None,
        }
    }

    pub(crate) fn set_nonblocking(&self) -> io::Result<()> {
        match &self.kind {
            ListenerKind::Unix(l) => l.set_nonblocking(true),
            ListenerKind::Tcp(l) => l.set_nonblocking(true),
        }
    }

    pub(crate) fn raw_fd(&self) -> RawFd {
        match &self.kind {
            ListenerKind::Unix(l) => l.as_raw_fd(),
            ListenerKind::Tcp(l) => l.as_raw_fd(),
        }
    }

    /// Accept one connection. The returned stream is blocking, with
    /// TCP_NODELAY set for TCP.
    pub(crate) fn accept(&self) -> io::Result<Stream> {
        match &self.kind {
            ListenerKind::Unix(l) => {
                let (s, _) = l.accept()?;
                s.set_nonblocking(false)?;
                Ok(Stream::Unix(s))
            }
            ListenerKind::Tcp(l) => {
                let (s, peer) = l.accept()?;
                s.set_nonblocking(false)?;
                // Replies are often a small header then data; Nagle would
                // hold the header back waiting for an ACK.
                s.set_nodelay(true)?;
                tracing::debug!(%peer, "tcp connection");
                Ok(Stream::Tcp(s))
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let Some(owned) = &self.owned_path else {
            return;
        };
        // Remove the socket file only if it is still the one we created; a
        // newer server may have replaced it.
        match std::fs::symlink_metadata(&owned.path) {
            Ok(meta) if meta.dev() == owned.dev && meta.ino() == owned.ino => {
                if let Err(e) = std::fs::remove_file(&owned.path) {
                    tracing::warn!(path = %owned.path.display(), error = %e, "cannot remove socket file");
                }
            }
            _ => {}
        }
    }
}

fn check_existing_socket(path: &Path) -> Result<(), ServerError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(ServerError::Bind {
                what: path.display().to_string(),
                source,
            })
        }
    };
    if !meta.file_type().is_socket() {
        return Err(ServerError::NotASocket {
            path: path.to_path_buf(),
        });
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(ServerError::SocketInUse {
            path: path.to_path_buf(),
        }),
        // Nobody listening: a stale file from a server that died.
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            tracing::info!(path = %path.display(), "replacing stale socket file");
            Ok(())
        }
        Err(source) => Err(ServerError::Bind {
            what: path.display().to_string(),
            source,
        }),
    }
}

fn remove_stale(path: &Path) -> Result<(), ServerError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(ServerError::Bind {
            what: path.display().to_string(),
            source,
        }),
    }
}

/// Who may open the Unix socket: its file mode and group (the owner is
/// the daemon's user). `None` keeps what bind made (the umask's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SocketAccess {
    pub mode: Option<u32>,
    pub gid: Option<u32>,
}

impl SocketAccess {
    fn apply(&self, path: &Path) -> io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        if let Some(gid) = self.gid {
            std::os::unix::fs::lchown(path, None, Some(gid))?;
        }
        if let Some(mode) = self.mode {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
        }
        Ok(())
    }
}

fn bind_via_rename(path: &Path, access: &SocketAccess) -> io::Result<UnixListener> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(".cairn.{}.{n}", std::process::id()));
    let listener = UnixListener::bind(&tmp)?;
    if let Err(e) = access.apply(&tmp) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(listener)
}

fn systemd_listen_fds() -> Result<Option<u32>, ServerError> {
    let Ok(pid) = std::env::var("LISTEN_PID") else {
        return Ok(None);
    };
    let Ok(pid) = pid.trim().parse::<u32>() else {
        return Err(ServerError::SocketActivation(format!(
            "LISTEN_PID={pid:?} is not a pid"
        )));
    };
    if pid != std::process::id() {
        // Meant for another process (we inherited the environment).
        return Ok(None);
    }
    let fds = std::env::var("LISTEN_FDS").unwrap_or_default();
    match fds.trim().parse::<u32>() {
        Ok(0) => Ok(None),
        Ok(n) => Ok(Some(n)),
        Err(_) => Err(ServerError::SocketActivation(format!(
            "LISTEN_FDS={fds:?} is not a count"
        ))),
    }
}

/// Check that `fd` is a listening stream socket; return its address family.
fn check_listening_socket(fd: RawFd) -> Result<i32, ServerError> {
    let fail = |what: &str| {
        ServerError::SocketActivation(format!("fd {fd} {what}: {}", io::Error::last_os_error()))
    };
    let mut accepting: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `accepting`, a
    // c_int we own; a bad fd only makes it fail with EBADF/ENOTSOCK.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ACCEPTCONN,
            (&mut accepting as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(fail("is not a socket"));
    }
    if accepting == 0 {
        return Err(ServerError::SocketActivation(format!(
            "fd {fd} is not listening"
        )));
    }
    // SAFETY: sockaddr_storage is plain data; all-zero is a valid value.
    let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut addr_len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: getsockname writes at most `addr_len` bytes into `addr`.
    let rc = unsafe {
        libc::getsockname(
            fd,
            (&mut addr as *mut libc::sockaddr_storage).cast(),
            &mut addr_len,
        )
    };
    if rc != 0 {
        return Err(fail("has no address"));
    }
    match addr.ss_family as i32 {
        f @ (libc::AF_UNIX | libc::AF_INET | libc::AF_INET6) => Ok(f),
        other => Err(ServerError::SocketActivation(format!(
            "fd {fd} has unsupported address family {other}"
        ))),
    }
}

/// A connected client socket.
#[derive(Debug)]
pub(crate) enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    pub(crate) fn raw_fd(&self) -> RawFd {
        match self {
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
        }
    }

    pub(crate) fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
        })
    }

    pub(crate) fn shutdown(&self, how: Shutdown) {
        // ENOTCONN after the peer left is expected and harmless.
        let _ = match self {
            Stream::Unix(s) => s.shutdown(how),
            Stream::Tcp(s) => s.shutdown(how),
        };
    }

    pub(crate) fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Tcp(s) => s.set_read_timeout(t),
        }
    }

    pub(crate) fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_write_timeout(t),
            Stream::Tcp(s) => s.set_write_timeout(t),
        }
    }

    pub(crate) fn peer(&self) -> String {
        match self {
            Stream::Unix(_) => "unix".to_string(),
            Stream::Tcp(s) => s
                .peer_addr()
                .map(|a| a.to_string())
                .unwrap_or_else(|_| "tcp".to_string()),
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        self.raw_fd()
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).read(buf),
            Stream::Tcp(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).write(buf),
            Stream::Tcp(s) => (&*s).write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).write_vectored(bufs),
            Stream::Tcp(s) => (&*s).write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write_vectored(bufs),
            Stream::Tcp(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
