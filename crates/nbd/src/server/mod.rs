//! The NBD server.
//!
//! Threads: one acceptor, and one thread per connection that negotiates
//! with blocking reads and then runs the connection as an event loop of
//! its own (a `cairn_io::Reactor` with its own io_uring): a reader task
//! parses requests and starts a task for each, a writer task sends the
//! replies. A request waiting for I/O is a suspended task, not a blocked
//! thread. Nothing spins: an idle connection sleeps in the kernel.
//!
//! Memory is bounded: a request holds an in-flight slot and its payload
//! budget from when it is read until its reply has been sent (or dropped),
//! so replies a client does not read count too. Each connection has at
//! most `max_in_flight_per_connection` such requests and a quarter of the
//! budget (the reader stops taking requests when either is full; a request
//! on an idle connection is always taken), and all connections together
//! hold at most `max_buffered_bytes` of read/write payload buffers.
//!
//! Exports: [`serve`] offers one; [`serve_exports`] offers an [`Exports`]
//! set, which may change while the server runs. A connection picks its
//! export in the handshake and keeps it for its life.

mod admission;
mod budget;
mod catalog;
mod conn;
mod exports;
mod listener;

pub use exports::{ExportOptions, ExportStatus, Exports, ExportsError, RemovedExport};
pub use listener::{Listener, SocketAccess};

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::codec::{BlockSizes, Limits, TlsPolicy};
use crate::export::{Export, ExportError};
use admission::{Admission, AdmissionLimits, PeerKey};
use budget::ByteBudget;
use cairn_tls::TlsAcceptor;
use catalog::ServerCatalog;
use listener::Stream;

/// Requests queued or running per connection by default: the Linux NBD
/// driver's queue depth, so its queue never waits in the socket while the
/// cache device has room for more.
pub const DEFAULT_MAX_IN_FLIGHT_PER_CONNECTION: usize = 128;

/// Server limits and behaviour. `Default` suits a 2-core machine.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// [`serve`]'s one export: its canonical name (the empty name selects
    /// it too) and description. [`serve_exports`] ignores both.
    pub export_name: String,
    pub export_description: Option<String>,
    /// Advertise READ_ONLY and refuse writes with EPERM, on every export.
    pub read_only: bool,
    /// Established connections (past the handshake) at most; one that
    /// finishes its handshake beyond this is closed instead of served.
    pub max_connections: usize,
    /// Connections still in the handshake at most; a new one beyond this
    /// closes the oldest handshake (see `admission`).
    pub max_handshakes: usize,
    /// Handshakes of one peer (IP address, or user id on the Unix socket)
    /// at most; beyond this a new one closes that peer's oldest.
    pub max_handshakes_per_peer: usize,
    /// What STARTTLS gets (nbdkit's `--tls=off|on|require`). Anything but
    /// `Off` needs `tls_acceptor`.
    pub tls: TlsPolicy,
    /// The server's TLS credentials, loaded once.
    pub tls_acceptor: Option<Arc<TlsAcceptor>>,
    /// TCP clients allowed, by network; empty allows every address. A
    /// client outside them is closed at accept, before a byte is sent.
    /// Unix-socket clients are governed by the socket's mode and group.
    pub allow: Vec<ipnet::IpNet>,
    /// Requests queued or running per connection before its reader stops
    /// reading (backpressure).
    pub max_in_flight_per_connection: usize,
    /// Largest option payload during negotiation.
    pub max_option_bytes: u32,
    /// Largest export name or metadata query.
    pub max_name_bytes: u32,
    /// Options per connection before the server hangs up.
    pub max_options_per_connection: u32,
    /// Read/write payload bytes buffered across all connections.
    pub max_buffered_bytes: u64,
    /// Advertised block sizes: minimum, preferred, maximum payload.
    pub min_block_bytes: u32,
    pub preferred_block_bytes: u32,
    pub max_payload_bytes: u32,
    /// Oversized write payloads up to this size are read and dropped (the
    /// client gets EINVAL); larger ones end the connection.
    pub max_discard_bytes: u64,
    pub max_block_status_extents: u32,
    /// Offer NBD_OPT_EXTENDED_HEADERS (64-bit lengths).
    pub extended_headers: bool,
    /// Whole-handshake deadline; 0 disables it.
    pub handshake_timeout_ms: u64,
    /// A reply write blocked this long (client not reading) kills the
    /// connection; 0 disables it.
    pub write_timeout_ms: u64,
    /// Stop serving when the last client disconnects (after at least one
    /// connected). Meant for socket activation, where the parent waits for
    /// the server to exit, like qemu-nbd without --persistent.
    pub stop_when_idle: bool,
    /// With `stop_when_idle`: how long the server stays up with no client
    /// before it stops (a client that comes meanwhile cancels it); 0 stops
    /// at once. systemd starts a socket-activated daemon again at the next
    /// connection, but a grace spares probing clients a start each.
    pub idle_grace_ms: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        let limits = Limits::default();
        let sizes = BlockSizes::default();
        ServerConfig {
            export_name: String::new(),
            export_description: None,
            read_only: false,
            max_connections: 32,
            max_handshakes: 64,
            max_handshakes_per_peer: 16,
            tls: TlsPolicy::Off,
            tls_acceptor: None,
            allow: Vec::new(),
            max_in_flight_per_connection: DEFAULT_MAX_IN_FLIGHT_PER_CONNECTION,
            max_option_bytes: limits.max_option_bytes,
            max_name_bytes: limits.max_name_bytes,
            max_options_per_connection: limits.max_options,
            max_buffered_bytes: 256 * 1024 * 1024,
            min_block_bytes: sizes.min_bytes,
            preferred_block_bytes: sizes.preferred_bytes,
            max_payload_bytes: sizes.max_bytes,
            max_discard_bytes: limits.max_discard_bytes,
            max_block_status_extents: limits.max_block_status_extents,
            extended_headers: true,
            handshake_timeout_ms: 5_000,
            write_timeout_ms: 30_000,
            stop_when_idle: false,
            idle_grace_ms: 0,
        }
    }
}

impl ServerConfig {
    /// Check the limits are consistent with each other and the spec.
    pub fn validate(&self) -> Result<(), ServerError> {
        let bad = |m: String| Err(ServerError::Config(m));
        if self.max_connections == 0
            || self.max_in_flight_per_connection == 0
            || self.max_handshakes == 0
            || self.max_handshakes_per_peer == 0
        {
            return bad(
                "max_connections, max_handshakes, max_handshakes_per_peer and max_in_flight_per_connection must be at least 1".into(),
            );
        }
        match (self.tls, &self.tls_acceptor) {
            (TlsPolicy::Off, Some(_)) => {
                return bad(
                    "TLS credentials were given with TLS off; use --tls=on or --tls=require".into(),
                )
            }
            (TlsPolicy::Offered | TlsPolicy::Required, None) => {
                return bad(
                    "TLS needs credentials: --tls-certificates=DIR or --tls-psk=FILE".into(),
                )
            }
            _ => {}
        }
        if !self.min_block_bytes.is_power_of_two()
            || self.min_block_bytes > crate::proto::MAX_MIN_BLOCK_BYTES
        {
            return bad(format!(
                "min_block_bytes {} must be a power of two <= 65536",
                self.min_block_bytes
            ));
        }
        if !self.preferred_block_bytes.is_power_of_two()
            || self.preferred_block_bytes < self.min_block_bytes.max(512)
        {
            return bad(format!(
                "preferred_block_bytes {} must be a power of two >= max(min_block_bytes, 512)",
                self.preferred_block_bytes
            ));
        }
        if self.max_payload_bytes < self.preferred_block_bytes {
            return bad(format!(
                "max_payload_bytes {} must be >= preferred_block_bytes {}",
                self.max_payload_bytes, self.preferred_block_bytes
            ));
        }
        if self.max_buffered_bytes < self.max_payload_bytes as u64 + 64 {
            return bad(format!(
                "max_buffered_bytes {} must hold at least one maximum payload ({} bytes)",
                self.max_buffered_bytes, self.max_payload_bytes
            ));
        }
        if self.max_name_bytes as usize > crate::proto::MAX_STRING_BYTES {
            return bad(format!(
                "max_name_bytes {} is above the protocol limit of 4096",
                self.max_name_bytes
            ));
        }
        if self.max_option_bytes < self.max_name_bytes + 8 {
            return bad("max_option_bytes must fit a maximal name plus its framing".into());
        }
        if self.max_discard_bytes < self.max_payload_bytes as u64 {
            return bad("max_discard_bytes must be >= max_payload_bytes".into());
        }
        if self.export_name.len() > crate::proto::MAX_STRING_BYTES {
            return bad("export_name is longer than 4096 bytes".into());
        }
        Ok(())
    }

    fn limits(&self) -> Limits {
        Limits {
            max_option_bytes: self.max_option_bytes,
            max_name_bytes: self.max_name_bytes,
            max_options: self.max_options_per_connection,
            max_payload_bytes: self.max_payload_bytes,
            max_discard_bytes: self.max_discard_bytes,
            max_block_status_extents: self.max_block_status_extents,
        }
    }

    /// What the negotiation tells clients about `exports`.
    fn catalog(&self, exports: Exports) -> ServerCatalog {
        ServerCatalog {
            exports,
            block_sizes: BlockSizes {
                min_bytes: self.min_block_bytes,
                preferred_bytes: self.preferred_block_bytes,
                max_bytes: self.max_payload_bytes,
            },
            read_only: self.read_only,
            extended_headers: self.extended_headers,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    #[error("invalid server configuration: {0}")]
    Config(String),
    #[error("{}: a server is already listening on this socket; stop it or choose another path", path.display())]
    SocketInUse { path: std::path::PathBuf },
    #[error("{}: exists and is not a socket; refusing to replace it", path.display())]
    NotASocket { path: std::path::PathBuf },
    #[error("cannot listen on {what}: {source}")]
    Bind {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("socket activation: {0}")]
    SocketActivation(String),
    #[error("cannot start server threads: {0}")]
    Spawn(#[source] io::Error),
    #[error("final flush of the export failed: {0}")]
    FinalFlush(#[source] ExportError),
    #[error("the listening socket failed: {0}")]
    Listener(#[source] io::Error),
    #[error("a server thread panicked")]
    Panicked,
}

/// Counters for tests and status output. Each `*_waits` counts the times
/// a named limit was hit (the request waited; nothing failed).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ServerStats {
    pub connections_active: u64,
    pub connections_accepted: u64,
    /// Turned away at `max_connections` (after their handshake).
    pub connections_refused: u64,
    /// Connections in the handshake right now.
    pub connections_handshaking: u64,
    /// Handshakes closed to make room for newer ones (`max_handshakes`,
    /// `max_handshakes_per_peer`).
    pub handshakes_evicted: u64,
    /// TCP clients closed at accept: not in the allow list.
    pub connections_denied: u64,
    /// TLS handshakes that succeeded, and that failed (wrong key, no or
    /// untrusted certificate, clear text after STARTTLS, timeouts).
    pub tls_handshakes: u64,
    pub tls_handshake_failures: u64,
    pub protocol_errors: u64,
    pub requests: u64,
    /// A connection's reader paused at `max_in_flight_per_connection`.
    pub in_flight_limit_waits: u64,
    /// A request waited for `max_buffered_bytes` of payload budget.
    pub buffer_budget_waits: u64,
    /// Reply sends that found the client's socket full (it took part of
    /// the replies or none): the client reads slower than it is answered.
    pub reply_sends_short: u64,
    /// Reply sends that waited on the ring for room in the client's socket.
    /// Each short send leads to at most one; far more of either than the
    /// client's reads would be a writer spinning on a full socket.
    pub reply_send_waits: u64,
    /// Payload bytes buffered right now, across connections.
    pub buffered_bytes: u64,
    /// The limits themselves (`ServerConfig`).
    pub max_connections: u64,
    pub max_in_flight_per_connection: u64,
    pub max_buffered_bytes: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    connections_accepted: AtomicU64,
    connections_refused: AtomicU64,
    handshakes_evicted: AtomicU64,
    connections_denied: AtomicU64,
    pub(crate) tls_handshakes: AtomicU64,
    pub(crate) tls_handshake_failures: AtomicU64,
    protocol_errors: AtomicU64,
    requests: AtomicU64,
    pub(crate) in_flight_limit_waits: AtomicU64,
    pub(crate) reply_sends_short: AtomicU64,
    pub(crate) reply_send_waits: AtomicU64,
}

/// Reads a running server's counters from any thread (status, metrics),
/// also after it stopped.
#[derive(Clone)]
pub struct StatsReader {
    shared: Arc<Shared>,
}

impl StatsReader {
    pub fn stats(&self) -> ServerStats {
        self.shared.stats()
    }

    /// Each export with its established connections.
    pub fn exports(&self) -> Vec<ExportStatus> {
        self.shared.exports.list()
    }
}

/// State shared by the acceptor, readers and workers.
struct Shared {
    exports: Exports,
    /// `exports` as the negotiation sees them.
    catalog: Arc<ServerCatalog>,
    config: ServerConfig,
    limits: Limits,
    stopping: AtomicBool,
    /// Live connections by id, with a handle used to cut their reads at
    /// shutdown.
    connections: Mutex<HashMap<u64, Stream>>,
    connections_changed: Condvar,
    /// When the last client left, while none has come since (for
    /// `idle_grace_ms`).
    idle_since: Mutex<Option<Instant>>,
    budget: ByteBudget,
    wake_tx: UnixStream,
    counters: Counters,
    admission: Admission,
}

impl Shared {
    fn stats(&self) -> ServerStats {
        let c = &self.counters;
        ServerStats {
            connections_active: lock(&self.connections).len() as u64,
            connections_accepted: c.connections_accepted.load(Ordering::Relaxed),
            connections_refused: c.connections_refused.load(Ordering::Relaxed),
            connections_handshaking: self.admission.counts().0 as u64,
            handshakes_evicted: c.handshakes_evicted.load(Ordering::Relaxed),
            connections_denied: c.connections_denied.load(Ordering::Relaxed),
            tls_handshakes: c.tls_handshakes.load(Ordering::Relaxed),
            tls_handshake_failures: c.tls_handshake_failures.load(Ordering::Relaxed),
            protocol_errors: c.protocol_errors.load(Ordering::Relaxed),
            requests: c.requests.load(Ordering::Relaxed),
            in_flight_limit_waits: c.in_flight_limit_waits.load(Ordering::Relaxed),
            buffer_budget_waits: self.budget.waits(),
            reply_sends_short: c.reply_sends_short.load(Ordering::Relaxed),
            reply_send_waits: c.reply_send_waits.load(Ordering::Relaxed),
            buffered_bytes: self.budget.total() - self.budget.available(),
            max_connections: self.config.max_connections as u64,
            max_in_flight_per_connection: self.config.max_in_flight_per_connection as u64,
            max_buffered_bytes: self.config.max_buffered_bytes,
        }
    }

    fn trigger_stop(&self) {
        if !self.stopping.swap(true, Ordering::SeqCst) {
            tracing::info!("server stopping");
        }
        // One byte wakes the acceptor's poll; a full pipe means it is
        // already awake.
        let _ = (&self.wake_tx).write(&[1]);
    }

    fn connection_finished(&self, id: u64) {
        let mut conns = lock(&self.connections);
        conns.remove(&id);
        let idle = conns.is_empty();
        drop(conns);
        self.connections_changed.notify_all();
        if idle && self.config.stop_when_idle {
            if self.config.idle_grace_ms == 0 {
                self.trigger_stop();
            } else {
                *lock(&self.idle_since) = Some(Instant::now());
                // The acceptor waits for the grace from now on.
                let _ = (&self.wake_tx).write(&[1]);
            }
        }
    }
}

/// Start serving `export` on `listener`, as `config.export_name` (the
/// empty name selects it too). Returns once the server is accepting; stop
/// it with [`ServerHandle::shutdown`].
pub fn serve(
    export: Arc<dyn Export>,
    listener: Listener,
    config: ServerConfig,
) -> Result<ServerHandle, ServerError> {
    config.validate()?;
    let exports = Exports::new();
    let options = ExportOptions {
        description: config.export_description.clone(),
        read_only: false,
    };
    exports
        .add(&config.export_name, export, options)
        .map_err(|e| ServerError::Config(e.to_string()))?;
    exports.set_default(Some(&config.export_name));
    serve_exports(exports, listener, config)
}

/// Start serving every export of `exports` on `listener`; exports added
/// to the set later are served too, removed ones no longer. Returns once
/// the server is accepting; stop it with [`ServerHandle::shutdown`].
pub fn serve_exports(
    exports: Exports,
    listener: Listener,
    config: ServerConfig,
) -> Result<ServerHandle, ServerError> {
    config.validate()?;
    let (wake_tx, wake_rx) = UnixStream::pair().map_err(ServerError::Spawn)?;
    wake_tx.set_nonblocking(true).map_err(ServerError::Spawn)?;
    wake_rx.set_nonblocking(true).map_err(ServerError::Spawn)?;
    listener
        .set_nonblocking()
        .map_err(|source| ServerError::Bind {
            what: listener.description().to_string(),
            source,
        })?;
    let catalog = Arc::new(config.catalog(exports.clone()));
    let shared = Arc::new(Shared {
        limits: config.limits(),
        catalog,
        stopping: AtomicBool::new(false),
        connections: Mutex::new(HashMap::new()),
        connections_changed: Condvar::new(),
        idle_since: Mutex::new(None),
        budget: ByteBudget::new(config.max_buffered_bytes),
        wake_tx,
        counters: Counters::default(),
        admission: Admission::new(AdmissionLimits {
            max_handshakes: config.max_handshakes,
            max_handshakes_per_peer: config.max_handshakes_per_peer,
            max_connections: config.max_connections,
        }),
        exports,
        config,
    });
    let description = listener.description().to_string();
    tracing::info!(listen = %description, exports = shared.exports.len(), "NBD server listening");
    let acceptor_shared = shared.clone();
    let acceptor = std::thread::Builder::new()
        .name("nbd-accept".to_string())
        .spawn(move || accept_loop(acceptor_shared, listener, wake_rx))
        .map_err(ServerError::Spawn)?;
    Ok(ServerHandle {
        shared,
        acceptor: Some(acceptor),
        description,
    })
}

/// A running server.
pub struct ServerHandle {
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<Result<(), ServerError>>>,
    description: String,
}

/// Asks a server to stop, from any thread (e.g. a signal watcher).
#[derive(Clone)]
pub struct ShutdownTrigger {
    shared: Arc<Shared>,
}

impl ShutdownTrigger {
    /// Begin a graceful shutdown; returns at once.
    pub fn shutdown(&self) {
        self.shared.trigger_stop();
    }
}

impl ServerHandle {
    /// Graceful shutdown: stop accepting, stop reading new requests, finish
    /// the ones in flight and send their replies, close every connection,
    /// flush the export, and return.
    pub fn shutdown(mut self) -> Result<(), ServerError> {
        self.shared.trigger_stop();
        self.join()
    }

    /// Block until the server stops (by a trigger, or by `stop_when_idle`).
    pub fn wait(mut self) -> Result<(), ServerError> {
        self.join()
    }

    pub fn trigger(&self) -> ShutdownTrigger {
        ShutdownTrigger {
            shared: self.shared.clone(),
        }
    }

    /// Where the server listens, e.g. `unix:/run/cairn.sock`.
    pub fn description(&self) -> &str {
        &self.description
    }

    pub fn active_connections(&self) -> usize {
        lock(&self.shared.connections).len()
    }

    /// The exports this server offers: add and remove them here while it
    /// runs; each one's established connections are in its status.
    pub fn exports(&self) -> &Exports {
        &self.shared.exports
    }

    pub fn stats(&self) -> ServerStats {
        self.shared.stats()
    }

    /// A handle that reads the counters from another thread.
    pub fn stats_reader(&self) -> StatsReader {
        StatsReader {
            shared: self.shared.clone(),
        }
    }

    fn join(&mut self) -> Result<(), ServerError> {
        match self.acceptor.take() {
            Some(handle) => handle.join().map_err(|_| ServerError::Panicked)?,
            None => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if self.acceptor.is_some() {
            self.shared.trigger_stop();
            if let Err(e) = self.join() {
                tracing::error!(error = %e, "server stopped with an error");
            }
        }
    }
}

fn accept_loop(
    shared: Arc<Shared>,
    listener: Listener,
    wake_rx: UnixStream,
) -> Result<(), ServerError> {
    let mut next_id = 0u64;
    let mut failure = None;
    // Wake-ups are drained, not read one by one.
    let _ = wake_rx.set_nonblocking(true);
    while !shared.stopping.load(Ordering::SeqCst) {
        let timeout_ms = match idle_grace_left(&shared) {
            Some(Duration::ZERO) => {
                tracing::info!(
                    grace_ms = shared.config.idle_grace_ms,
                    "no client for the idle grace; stopping"
                );
                shared.trigger_stop();
                break;
            }
            Some(left) => left.as_millis().clamp(1, i32::MAX as u128) as i32,
            None => -1,
        };
        if let Err(e) = wait_readable(listener.raw_fd(), wake_rx.as_raw_fd(), timeout_ms) {
            tracing::error!(error = %e, "poll failed; stopping the server");
            failure = Some(e);
            break;
        }
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        drain_wakeups(&wake_rx);
        let stream = match listener.accept() {
            Ok(s) => s,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::Interrupted
                        | io::ErrorKind::ConnectionAborted
                ) =>
            {
                continue
            }
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EBADF | libc::EINVAL | libc::ENOTSOCK)
                ) =>
            {
                // The listener itself is gone: retrying cannot help.
                tracing::error!(error = %e, "listener failed; stopping the server");
                failure = Some(e);
                break;
            }
            Err(e) => {
                // Out of fds or memory: back off instead of spinning on a
                // listener that stays readable.
                tracing::warn!(error = %e, "accept failed; retrying shortly");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        next_id += 1;
        start_connection(&shared, next_id, stream);
    }
    // Stop accepting before anything else; this also removes our unix
    // socket file.
    drop(listener);
    drain(&shared)?;
    match failure {
        Some(e) => Err(ServerError::Listener(e)),
        None => Ok(()),
    }
}

fn start_connection(shared: &Arc<Shared>, id: u64, stream: Stream) {
    if !allowed(&shared.config.allow, &stream) {
        shared
            .counters
            .connections_denied
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(peer = %stream.peer(), "connection from an address not in the allow list; closing it");
        stream.shutdown(std::net::Shutdown::Both);
        return;
    }
    let control = match stream.try_clone() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "cannot clone client socket; closing it");
            return;
        }
    };
    let evicted = shared.admission.admit(id, PeerKey::of(&stream));
    let mut conns = lock(&shared.connections);
    for old in evicted {
        shared
            .counters
            .handshakes_evicted
            .fetch_add(1, Ordering::Relaxed);
        // Its thread sees EOF and ends; it never reached transmission.
        if let Some(handle) = conns.get(&old) {
            handle.shutdown(std::net::Shutdown::Both);
        }
    }
    conns.insert(id, control);
    *lock(&shared.idle_since) = None;
    drop(conns);
    shared
        .counters
        .connections_accepted
        .fetch_add(1, Ordering::Relaxed);
    let conn_shared = shared.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("nbd-conn-{id}"))
        .spawn(move || {
            conn::run(&conn_shared, id, stream);
            conn_shared.admission.finished(id);
            conn_shared.connection_finished(id);
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start a connection thread; closing it");
        shared.admission.finished(id);
        shared.connection_finished(id);
    }
}

/// Whether a TCP client's address is in `allow` (an IPv4 client on an
/// IPv6 socket counts by its IPv4 address too); Unix-socket clients and an
/// empty list always pass. An address that cannot be read does not.
fn allowed(allow: &[ipnet::IpNet], stream: &Stream) -> bool {
    let Stream::Tcp(tcp) = stream else {
        return true;
    };
    if allow.is_empty() {
        return true;
    }
    let Ok(peer) = tcp.peer_addr() else {
        return false;
    };
    let ip = peer.ip();
    let mapped = match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map(std::net::IpAddr::V4),
        std::net::IpAddr::V4(_) => None,
    };
    allow
        .iter()
        .any(|net| net.contains(&ip) || mapped.is_some_and(|v4| net.contains(&v4)))
}

/// Shut every connection's reading side, wait for them to finish their
/// in-flight requests and flush every export.
fn drain(shared: &Arc<Shared>) -> Result<(), ServerError> {
    {
        let conns = lock(&shared.connections);
        if !conns.is_empty() {
            tracing::info!(
                connections = conns.len(),
                "waiting for connections to finish in-flight requests"
            );
        }
        for stream in conns.values() {
            // Wakes a reader blocked in read() with EOF; replies can still
            // be written.
            stream.shutdown(std::net::Shutdown::Read);
        }
    }
    let mut conns = lock(&shared.connections);
    while !conns.is_empty() {
        conns = shared
            .connections_changed
            .wait(conns)
            .unwrap_or_else(|e| e.into_inner());
    }
    drop(conns);
    // Every export is flushed, even after one failed; the first failure
    // is the one reported.
    let mut failure = None;
    for (name, export) in shared.exports.all() {
        if let Err(e) = export.flush() {
            tracing::error!(export = name, error = %e, "final flush of the export failed");
            failure.get_or_insert(e);
        }
    }
    if let Some(e) = failure {
        return Err(ServerError::FinalFlush(e));
    }
    tracing::info!("server stopped");
    Ok(())
}

/// How much of the idle grace is left, if the server is waiting one out.
fn idle_grace_left(shared: &Shared) -> Option<Duration> {
    if !shared.config.stop_when_idle || shared.config.idle_grace_ms == 0 {
        return None;
    }
    let since = (*lock(&shared.idle_since))?;
    let grace = Duration::from_millis(shared.config.idle_grace_ms);
    Some(grace.saturating_sub(since.elapsed()))
}

/// Read every pending wake-up byte (the pipe is non-blocking), so the next
/// poll waits again.
fn drain_wakeups(mut wake_rx: &UnixStream) {
    let mut buf = [0u8; 64];
    // Bounded: the pipe holds at most its buffer, and a read that returns
    // a full buffer is followed by one that drains the rest or blocks.
    for _ in 0..1024 {
        match wake_rx.read(&mut buf) {
            Ok(n) if n == buf.len() => continue,
            _ => return,
        }
    }
}

/// Block until the listener or the wake pipe is readable, or `timeout_ms`
/// passed (-1: no timeout).
fn wait_readable(listen_fd: RawFd, wake_fd: RawFd, timeout_ms: i32) -> io::Result<()> {
    let mut fds = [
        libc::pollfd {
            fd: listen_fd,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: wake_fd,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: `fds` is a valid array of two pollfd for the duration of
        // the call, and its length is passed correctly.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
        if rc >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not take the whole server down with poison.
    m.lock().unwrap_or_else(|e| e.into_inner())
}
