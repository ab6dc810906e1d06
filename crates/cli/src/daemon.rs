//! `cairn serve`: open the cache, serve it over NBD, run write-back in the
//! background, answer the admin socket and the metrics endpoint, and shut
//! down cleanly on SIGTERM/SIGINT.

use std::net::TcpListener;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use cairn_engine::Engine;
use cairn_nbd::{serve_exports, Exports, Listener, ServerConfig, StatsReader};

use crate::export::Latencies;
use crate::volume_exports::VolumeExports;
use crate::writeback_turns::WRITEBACK_THREADS_MAX;

/// Called once the volume is being served, with the listener's description.
pub type ReadyHook = Box<dyn FnOnce(&str) + Send>;

pub struct ServeOptions {
    pub cache: PathBuf,
    /// The policy settings in force (the write-back loop reads them every
    /// step; `cairn set` changes them while serving).
    pub settings: crate::settings::SharedSettings,
    pub socket: Option<PathBuf>,
    pub listen: Option<String>,
    pub no_writeback: bool,
    pub metrics: Option<String>,
    /// Under socket activation: exit after this long with no client.
    pub idle_exit_secs: u64,
    /// Connection limits and read-only.
    pub connection: crate::cmd::connection_args::ConnectionArgs,
    /// Called once the volume is being served (the demo prints its hints).
    pub on_ready: Option<ReadyHook>,
}

pub fn serve_volume(engine: Arc<Engine>, opts: ServeOptions) -> Result<()> {
    let latencies = Arc::new(Latencies::default());
    engine.set_writeback_paused(opts.no_writeback);
    let stop = Arc::new(AtomicBool::new(false));
    let (admin, admin_file) = bind_admin_socket(&opts.cache)?;

    // Catch SIGTERM/SIGINT before the socket appears: a signal that comes
    // right after start-up must still shut down cleanly (it waits in
    // `signals` until the handler thread runs).
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT])
        .context("installing signal handlers")?;
    let signal_handle = signals.handle();

    let (metrics_listener, listener) = bind_listeners(&opts)?;
    let description = listener.description().to_string();
    let mut config = ServerConfig {
        stop_when_idle: std::env::var_os("LISTEN_FDS").is_some(),
        idle_grace_ms: opts.idle_exit_secs.saturating_mul(1000),
        ..ServerConfig::default()
    };
    opts.connection.apply(&mut config)?;
    // Every volume is an export by its name; the first volume's is `""`
    // unless named otherwise, which clients that name no export get.
    let exports = Exports::new();
    let volumes = VolumeExports {
        exports: &exports,
        engine: &engine,
        latencies: &latencies,
    };
    for volume in engine.volume_table().volumes() {
        volumes.add(volume)?;
    }
    let server =
        serve_exports(exports.clone(), listener, config).context("starting the NBD server")?;
    tracing::info!(
        volumes = engine.volume_table().volumes().len(),
        "serving {} on {description}",
        opts.cache.display()
    );

    let workers = Workers::spawn(
        &engine,
        &opts,
        &stop,
        admin,
        server.stats_reader(),
        latencies.clone(),
        exports,
    )?;
    if let Some(l) = metrics_listener {
        let m_engine = engine.clone();
        let m_lat = latencies.clone();
        let m_server = server.stats_reader();
        std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || crate::metrics::metrics_loop(l, &m_engine, &m_lat, &m_server))?;
    }

    if let Some(ready) = opts.on_ready {
        ready(&description);
    }
    // Under systemd (`Type=notify`): ready once the socket accepts.
    notify_systemd(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(&format!("serving on {description}")),
    ]);

    // Wait for SIGTERM/SIGINT, or for the server to stop by itself.
    let trigger = server.trigger();
    let signal_stop = stop.clone();
    let signal_engine = engine.clone();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                tracing::info!("signal {sig}: finishing in-flight requests and shutting down");
                signal_engine.begin_shutdown();
                notify_systemd(&[
                    sd_notify::NotifyState::Stopping,
                    sd_notify::NotifyState::Status(
                        "finishing in-flight requests, then a final checkpoint",
                    ),
                ]);
                signal_stop.store(true, Ordering::SeqCst);
                trigger.shutdown();
            }
        })?;
    server.wait().context("NBD server")?;
    signal_handle.close();
    stop.store(true, Ordering::SeqCst);
    workers.join(&admin_file.0);
    drop(admin_file);
    engine.flush().context("final flush")?;
    engine.close().context("final checkpoint")?;
    tracing::info!("clean shutdown");
    Ok(())
}

/// Tell systemd (`$NOTIFY_SOCKET`, set for `Type=notify` units) how the
/// daemon is doing; nothing without it. A failure is logged, never fatal:
/// the service manager then times the start out and says why.
fn notify_systemd(states: &[sd_notify::NotifyState]) {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return;
    }
    if let Err(e) = sd_notify::notify(states) {
        tracing::warn!("telling systemd the daemon's state ($NOTIFY_SOCKET) failed: {e}");
    }
}

/// Bind the admin socket, refusing to start if another daemon answers on
/// it. The guard removes the socket file on every way out, so a daemon
/// that fails to start leaves no stale admin socket behind.
fn bind_admin_socket(cache: &Path) -> Result<(UnixListener, RemoveOnDrop)> {
    let admin_path = crate::admin::socket_path(cache);
    if UnixStream::connect(&admin_path).is_ok() {
        bail!(
            "cache {} is already being served by another cairn (admin socket {} answers). Stop that daemon first",
            cache.display(),
            admin_path.display()
        );
    }
    let _ = std::fs::remove_file(&admin_path);
    if let Some(dir) = admin_path.parent() {
        std::fs::create_dir_all(dir).with_context(|| {
            format!(
                "creating the runtime directory {} for the admin socket (set CAIRN_RUNTIME_DIR to use another)",
                dir.display()
            )
        })?;
    }
    let admin = UnixListener::bind(&admin_path)
        .with_context(|| format!("binding the admin socket {}", admin_path.display()))?;
    Ok((admin, RemoveOnDrop(admin_path)))
}

/// The metrics listener, then the data listener: once the data socket
/// appears, everything answers, and a taken metrics port fails before any
/// client connects.
fn bind_listeners(opts: &ServeOptions) -> Result<(Option<TcpListener>, Listener)> {
    let metrics = match &opts.metrics {
        Some(addr) => Some(TcpListener::bind(addr).with_context(|| {
            format!("metrics listener {addr}: address unusable; pick another --metrics HOST:PORT")
        })?),
        None => None,
    };
    // Socket activation, TCP when asked, else a unix socket.
    let activated = Listener::from_systemd().context("socket activation")?;
    let access = opts
        .connection
        .socket_access(opts.listen.is_some(), activated.is_some())?;
    let data = if let Some(l) = activated {
        l
    } else if let Some(addr) = &opts.listen {
        Listener::bind_tcp(addr.as_str()).with_context(|| format!("listening on {addr}"))?
    } else {
        let sock = opts
            .socket
            .clone()
            .unwrap_or_else(|| PathBuf::from("cairn.sock"));
        Listener::bind_unix_with(&sock, &access)
            .with_context(|| format!("listening on {}", sock.display()))?
    };
    Ok((metrics, data))
}

/// The background threads that stop with `stop`: write-back, integrity
/// recalculation, and the admin socket.
struct Workers {
    writeback: JoinHandle<()>,
    /// Threads that run the write-back steps requests wait for as tasks
    /// (space, dirty shares, write-through), and their own stop flag: they
    /// stop once the NBD server has finished its requests, not before.
    request_servers: Vec<JoinHandle<()>>,
    request_servers_stop: Arc<AtomicBool>,
    engine: Arc<Engine>,
    recalc: Option<JoinHandle<()>>,
    admin: JoinHandle<()>,
}

impl Workers {
    fn spawn(
        engine: &Arc<Engine>,
        opts: &ServeOptions,
        stop: &Arc<AtomicBool>,
        admin: UnixListener,
        server: StatsReader,
        latencies: Arc<Latencies>,
        exports: Exports,
    ) -> Result<Workers> {
        // Write-back: one epoch group at a time; idle waits short.
        let wb_engine = engine.clone();
        let wb_settings = opts.settings.clone();
        let wb_stop = stop.clone();
        let writeback = std::thread::Builder::new()
            .name("writeback".into())
            .spawn(move || {
                crate::writeback::writeback_loop(&wb_engine, &wb_stop, || {
                    wb_settings.get().writeback_policy()
                })
            })?;

        // Write-back steps that requests wait for: as many threads as
        // background write-back has, so several volumes' origins are
        // waited for at once, as when each writer ran its own step.
        let request_servers_stop = Arc::new(AtomicBool::new(false));
        let mut request_servers = Vec::with_capacity(WRITEBACK_THREADS_MAX);
        for index in 0..WRITEBACK_THREADS_MAX {
            let (r_engine, r_stop) = (engine.clone(), request_servers_stop.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("wb-requests-{index}"))
                .spawn(move || r_engine.serve_writeback_requests(&r_stop));
            match spawned {
                Ok(handle) => request_servers.push(handle),
                // Requests then run their write-back steps themselves.
                Err(e) => {
                    tracing::warn!("started {index} write-back request threads: {e}");
                    break;
                }
            }
        }

        // Requests made before a thread registers run their steps
        // themselves; wait (briefly) so none does once serving has begun.
        let registered_by = std::time::Instant::now() + Duration::from_secs(2);
        while engine.writeback_request_servers() < request_servers.len()
            && std::time::Instant::now() < registered_by
        {
            std::thread::sleep(Duration::from_millis(1));
        }

        // Integrity recalculation over data that predates the format (or
        // the volume's add): one bounded step at a time, resuming where it
        // stopped, and waiting for volumes added later with integrity.
        let recalc = if engine.integrity() {
            let r_engine = engine.clone();
            let r_stop = stop.clone();
            Some(
                std::thread::Builder::new()
                    .name("recalc".into())
                    .spawn(move || recalc_loop(&r_engine, &r_stop))?,
            )
        } else {
            None
        };

        let admin_engine = engine.clone();
        let admin_cache = opts.cache.clone();
        let admin_stop = stop.clone();
        let admin_settings = opts.settings.clone();
        let admin = std::thread::Builder::new()
            .name("admin".into())
            .spawn(move || {
                crate::admin::server::admin_loop(
                    admin,
                    &admin_engine,
                    &admin_cache,
                    &admin_stop,
                    (&server, &latencies, &admin_settings, &exports),
                )
            })?;
        Ok(Workers {
            writeback,
            request_servers,
            request_servers_stop,
            engine: engine.clone(),
            recalc,
            admin,
        })
    }

    /// Wait for the threads once `stop` is set.
    fn join(self, admin_path: &Path) {
        let _ = self.writeback.join();
        self.request_servers_stop.store(true, Ordering::SeqCst);
        self.engine.wake_writeback_request_servers();
        for handle in self.request_servers {
            let _ = handle.join();
        }
        if let Some(r) = self.recalc {
            let _ = r.join();
        }
        // Wake the admin loop so it sees the stop flag. If its socket file
        // is gone (someone removed the runtime directory) it cannot be
        // woken; it is not joined then, and ends with the process after the
        // final checkpoint.
        if UnixStream::connect(admin_path).is_ok() {
            let _ = self.admin.join();
        }
    }
}

/// Recalculate integrity tags until done or stopped. Origin errors back
/// off and retry: tags not yet computed only mean unverified reads.
/// How often an idle recalculation looks for a volume added with integrity.
const RECALC_IDLE_POLL: Duration = Duration::from_secs(1);

fn recalc_loop(engine: &Engine, stop: &AtomicBool) {
    let mut backoff_ms = 100u64;
    let mut announced = false;
    while !stop.load(Ordering::SeqCst) {
        match engine.recalc_step() {
            Ok(p) if p.done() => {
                // Finished until a volume with integrity is added.
                announced = false;
                let deadline = std::time::Instant::now() + RECALC_IDLE_POLL;
                while std::time::Instant::now() < deadline && !stop.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            Ok(p) => {
                if !announced {
                    tracing::info!(
                        position_blocks = p.position_blocks,
                        total_blocks = p.total_blocks,
                        "integrity recalculation running: blocks above the position are served unverified"
                    );
                    announced = true;
                }
                backoff_ms = 100;
                // Leave the origin to clients between steps.
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => {
                tracing::warn!("integrity recalculation paused: {e}; retrying in {backoff_ms} ms");
                let deadline = std::time::Instant::now() + Duration::from_millis(backoff_ms);
                while std::time::Instant::now() < deadline && !stop.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(50));
                }
                backoff_ms = (backoff_ms * 2).min(10_000);
            }
        }
    }
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
