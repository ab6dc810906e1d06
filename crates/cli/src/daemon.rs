//! `cairn serve`: open the cache, serve it over NBD, run write-back in the
//! background, answer the admin socket and the metrics endpoint, and shut
//! down cleanly on SIGTERM/SIGINT.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use cairn_engine::Engine;
use cairn_nbd::{serve, Listener, ServerConfig};

use crate::export::{EngineExport, Latencies, LATENCY_BUCKETS_US};
use crate::status::status_json;

/// Called once the volume is being served, with the listener's description.
pub type ReadyHook = Box<dyn FnOnce(&str) + Send>;

pub struct ServeOptions {
    pub cache: PathBuf,
    pub writeback_policy: crate::writeback::WritebackPolicy,
    pub socket: Option<PathBuf>,
    pub listen: Option<String>,
    pub no_writeback: bool,
    pub metrics: Option<String>,
    /// Called once the volume is being served (the demo prints its hints).
    pub on_ready: Option<ReadyHook>,
}

/// Where the admin socket of the daemon serving `cache` lives.
pub fn admin_socket_path(cache: &Path) -> PathBuf {
    let canonical = std::fs::canonicalize(cache).unwrap_or_else(|_| cache.to_path_buf());
    let key = cairn_format::crc32c(canonical.to_string_lossy().as_bytes());
    let dir = std::env::var_os("CAIRN_RUNTIME_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    dir.join(format!("cairn-admin-{key:08x}.sock"))
}

/// Ask a running daemon; `None` if no daemon serves this cache.
pub fn ask_daemon(
    cache: &Path,
    command: &str,
    mut on_line: impl FnMut(&str),
) -> Option<Result<()>> {
    let path = admin_socket_path(cache);
    let stream = UnixStream::connect(&path).ok()?;
    Some((|| {
        let mut w = stream.try_clone()?;
        writeln!(w, "{command}")?;
        for line in BufReader::new(stream).lines() {
            let line = line?;
            if let Some(err) = line.strip_prefix("error: ") {
                bail!("{err}");
            }
            if line == "ok" {
                return Ok(());
            }
            on_line(&line);
        }
        bail!("the daemon closed the admin connection early")
    })())
}

pub fn serve_volume(engine: Arc<Engine>, opts: ServeOptions) -> Result<()> {
    let latencies = Arc::new(Latencies::default());
    engine.set_writeback_paused(opts.no_writeback);
    let stop = Arc::new(AtomicBool::new(false));

    // Admin socket (status, drain, check). Refuse a second daemon early.
    let admin_path = admin_socket_path(&opts.cache);
    if UnixStream::connect(&admin_path).is_ok() {
        bail!(
            "cache {} is already being served by another cairn (admin socket {} answers). Stop that daemon first",
            opts.cache.display(),
            admin_path.display()
        );
    }
    let _ = std::fs::remove_file(&admin_path);
    let admin = UnixListener::bind(&admin_path)
        .with_context(|| format!("binding the admin socket {}", admin_path.display()))?;
    // Removed on every way out, so a daemon that fails to start leaves no
    // stale admin socket behind.
    let _admin_file = RemoveOnDrop(admin_path.clone());

    // Catch SIGTERM/SIGINT before the socket appears: a signal that comes
    // right after start-up must still shut down cleanly (it waits in
    // `signals` until the handler thread runs).
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT])
        .context("installing signal handlers")?;
    let signal_handle = signals.handle();

    // Metrics before the data socket: once the socket appears, everything
    // answers, and a taken metrics port fails before any client connects.
    let metrics_listener = match &opts.metrics {
        Some(addr) => Some(TcpListener::bind(addr).with_context(|| {
            format!("metrics listener {addr}: address unusable; pick another --metrics HOST:PORT")
        })?),
        None => None,
    };

    // Data listener: socket activation, TCP when asked, else a unix socket.
    let listener = if let Some(l) = Listener::from_systemd().context("socket activation")? {
        l
    } else if let Some(addr) = &opts.listen {
        Listener::bind_tcp(addr.as_str()).with_context(|| format!("listening on {addr}"))?
    } else {
        let sock = opts
            .socket
            .clone()
            .unwrap_or_else(|| PathBuf::from("cairn.sock"));
        Listener::bind_unix(&sock).with_context(|| format!("listening on {}", sock.display()))?
    };
    let description = listener.description().to_string();
    let config = ServerConfig {
        stop_when_idle: std::env::var_os("LISTEN_FDS").is_some(),
        // Engine calls block in the kernel (device I/O), so the number of
        // workers is the queue depth the devices see; they sleep, not spin.
        // More than 8 bought no IOPS on 2 cores and cost memory.
        worker_count: 8,
        ..ServerConfig::default()
    };
    let export = Arc::new(EngineExport {
        engine: engine.clone(),
        latencies: latencies.clone(),
    });
    let server = serve(export, listener, config).context("starting the NBD server")?;
    tracing::info!("serving {} on {description}", opts.cache.display());

    // Background write-back: one epoch group at a time; idle waits short.
    let wb_engine = engine.clone();
    let wb_policy = opts.writeback_policy.clone();
    let wb_stop = stop.clone();
    let writeback = std::thread::Builder::new()
        .name("writeback".into())
        .spawn(move || crate::writeback::writeback_loop(&wb_engine, &wb_stop, wb_policy))?;

    // Integrity recalculation over data that predates the format: in the
    // background, one bounded step at a time, resuming where it stopped.
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
    let admin_stop = stop.clone();
    let admin_thread = std::thread::Builder::new()
        .name("admin".into())
        .spawn(move || admin_loop(admin, &admin_engine, &admin_stop))?;

    if let Some(l) = metrics_listener {
        let m_engine = engine.clone();
        let m_lat = latencies.clone();
        std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || metrics_loop(l, &m_engine, &m_lat))?;
    }

    if let Some(ready) = opts.on_ready {
        ready(&description);
    }

    // Wait for SIGTERM/SIGINT, or for the server to stop by itself.
    let trigger = server.trigger();
    let signal_stop = stop.clone();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                tracing::info!("signal {sig}: finishing in-flight requests and shutting down");
                signal_stop.store(true, Ordering::SeqCst);
                trigger.shutdown();
            }
        })?;
    server.wait().context("NBD server")?;
    signal_handle.close();
    stop.store(true, Ordering::SeqCst);
    let _ = writeback.join();
    if let Some(r) = recalc {
        let _ = r.join();
    }
    // Wake the admin loop so it sees the stop flag. If its socket file is
    // gone (someone removed the runtime directory) it cannot be woken; it is
    // not joined then, and ends with the process after the final checkpoint.
    if UnixStream::connect(&admin_path).is_ok() {
        let _ = admin_thread.join();
    }
    let _ = std::fs::remove_file(&admin_path);
    engine.flush().context("final flush")?;
    engine.close().context("final checkpoint")?;
    tracing::info!("clean shutdown");
    Ok(())
}

/// Recalculate integrity tags until done or stopped. Origin errors back
/// off and retry: tags not yet computed only mean unverified reads.
fn recalc_loop(engine: &Engine, stop: &AtomicBool) {
    let mut backoff_ms = 100u64;
    let mut announced = false;
    while !stop.load(Ordering::SeqCst) {
        match engine.recalc_step() {
            Ok(p) if p.done() => return,
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

/// Admin connections served at once; more are refused with an error.
const ADMIN_CONNECTIONS_MAX: usize = 16;

/// Frees an admin connection slot when its thread ends (or never starts).
struct AdminSlot(Arc<AtomicUsize>);

impl Drop for AdminSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One thread per admin connection, so `cairn status` answers while a
/// `cairn flush` drains for minutes on another connection.
fn admin_loop(listener: UnixListener, engine: &Arc<Engine>, stop: &AtomicBool) {
    let active = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut stream) = conn else { continue };
        if active.fetch_add(1, Ordering::SeqCst) >= ADMIN_CONNECTIONS_MAX {
            active.fetch_sub(1, Ordering::SeqCst);
            let _ = writeln!(
                stream,
                "error: the daemon is busy with {ADMIN_CONNECTIONS_MAX} admin requests; try again"
            );
            continue;
        }
        let slot = AdminSlot(active.clone());
        let engine = engine.clone();
        let _ = std::thread::Builder::new()
            .name("admin-conn".into())
            .spawn(move || {
                let _slot = slot;
                let _ = handle_admin(stream, &engine);
            });
    }
}

fn handle_admin(stream: UnixStream, engine: &Engine) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut w = stream.try_clone()?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    match line.trim() {
        "status" => {
            writeln!(
                w,
                "{}",
                status_json(&engine.stats(), &engine.superblock(), true)
            )?;
            writeln!(w, "ok")?;
        }
        "drain" => {
            let mut progress = w.try_clone()?;
            let r = engine.drain_with_progress(|p| {
                let _ = writeln!(progress, "progress {} {}", p.blocks_written, p.dirty_blocks);
            });
            match r {
                Ok(p) => writeln!(w, "done {} {}\nok", p.blocks_written, p.dirty_blocks)?,
                Err(e) => writeln!(w, "error: {e}")?,
            }
        }
        "check" => match engine.check(|_, _| {}) {
            Ok(bad) => {
                let bs = engine.block_size_bytes() as u64;
                for lba in bad {
                    writeln!(w, "bad {lba} {}", lba * bs)?;
                }
                writeln!(w, "ok")?;
            }
            Err(e) => writeln!(w, "error: {e}")?,
        },
        other if other.starts_with("scrub ") => {
            // scrub RATE_BYTES_PER_S REPAIR(0|1)
            let parts: Vec<u64> = other
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            let [rate, repair] = parts[..] else {
                writeln!(w, "error: usage: scrub RATE_BYTES_PER_S REPAIR")?;
                return Ok(());
            };
            let opts = cairn_engine::ScrubOptions {
                repair: repair != 0,
                rate_bytes_per_s: (rate > 0).then_some(rate),
            };
            let mut progress = w.try_clone()?;
            let mut last = std::time::Instant::now();
            let r = engine.scrub_origin(&opts, |done, total| {
                if last.elapsed() >= Duration::from_millis(200) || done == total {
                    last = std::time::Instant::now();
                    let _ = writeln!(progress, "progress {done} {total}");
                }
            });
            match r {
                Ok(report) => {
                    let bs = engine.block_size_bytes() as u64;
                    for lba in &report.mismatches {
                        writeln!(w, "mismatch {lba} {}", lba * bs)?;
                    }
                    for lba in &report.repaired {
                        writeln!(w, "repaired {lba} {}", lba * bs)?;
                    }
                    writeln!(
                        w,
                        "done {} {} {} {}\nok",
                        report.blocks_checked,
                        report.blocks_verified,
                        report.blocks_unverified,
                        report.blocks_skipped
                    )?;
                }
                Err(e) => writeln!(w, "error: {e}")?,
            }
        }
        other if other.starts_with("mode ") => {
            let name = other.trim_start_matches("mode ").trim();
            match cairn_engine::CacheMode::parse(name) {
                None => writeln!(w, "error: unknown mode {name:?}; use writeback, writethrough, writearound or passthrough")?,
                Some(mode) => {
                    let mut progress = w.try_clone()?;
                    let r = engine.set_mode(mode, |p| {
                        let _ = writeln!(progress, "progress {} {}", p.blocks_written, p.dirty_blocks);
                    });
                    match r {
                        Ok(p) => writeln!(w, "done {} {}\nok", p.blocks_written, p.dirty_blocks)?,
                        Err(e) => writeln!(w, "error: {e}")?,
                    }
                }
            }
        }
        other if other.starts_with("warm ") => {
            let parts: Vec<u64> = other
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            match parts[..] {
                [offset, length] => match warm(engine, offset, length) {
                    Ok(blocks) => writeln!(w, "done {blocks}\nok")?,
                    Err(e) => writeln!(w, "error: {e}")?,
                },
                _ => writeln!(w, "error: usage: warm OFFSET LENGTH")?,
            }
        }
        other => writeln!(w, "error: unknown admin command {other:?}")?,
    }
    Ok(())
}

fn metrics_loop(listener: TcpListener, engine: &Engine, latencies: &Latencies) {
    for conn in listener.incoming() {
        let Ok(mut stream) = conn else { continue };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        // Read the whole request head before answering: closing a socket
        // with unread request bytes resets the connection, and the client
        // may lose the response.
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
            match std::io::Read::read(&mut stream, &mut buf) {
                Ok(n) if n > 0 => head.extend_from_slice(&buf[..n]),
                _ => break,
            }
        }
        let body = render_metrics(engine, latencies);
        let response = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = stream.write_all(response.as_bytes());
    }
}

pub fn render_metrics(engine: &Engine, latencies: &Latencies) -> String {
    use std::fmt::Write as _;
    let s = engine.stats();
    let mut out = String::new();
    for (name, value) in s.counter_pairs() {
        let _ = writeln!(
            out,
            "# TYPE cairn_{name}_total counter\ncairn_{name}_total {value}"
        );
    }
    for (name, value) in [
        ("dirty_blocks", s.dirty_blocks),
        ("clean_blocks", s.clean_blocks),
        ("free_blocks", s.free_blocks),
        ("corrupt_blocks", s.corrupt_blocks),
        ("cache_blocks", s.cache_blocks),
        ("block_size_bytes", s.block_size_bytes),
        ("volume_size_bytes", s.volume_size_bytes),
        ("writeback_paused", s.writeback_paused as u64),
        ("index_memory_bytes", s.index_memory_bytes),
        ("integrity_enabled", s.integrity as u64),
        ("integrity_recalc_position_blocks", s.recalc_position_blocks),
        ("integrity_recalc_total_blocks", s.recalc_total_blocks),
        ("integrity_tag_memory_bytes", s.tag_memory_bytes),
        ("cache_degraded", s.degraded as u64),
        ("cache_failed", s.failed as u64),
        ("origin_failing", s.origin_failing as u64),
    ] {
        let _ = writeln!(out, "# TYPE cairn_{name} gauge\ncairn_{name} {value}");
    }
    let _ = writeln!(out, "# TYPE cairn_request_latency_seconds histogram");
    for (op, h) in latencies.all() {
        let mut cumulative = 0u64;
        for (i, bound) in LATENCY_BUCKETS_US.iter().enumerate() {
            cumulative += h.buckets[i].load(Ordering::Relaxed);
            let le = if *bound == u64::MAX {
                "+Inf".to_string()
            } else {
                format!("{}", *bound as f64 / 1e6)
            };
            let _ = writeln!(
                out,
                "cairn_request_latency_seconds_bucket{{op=\"{op}\",le=\"{le}\"}} {cumulative}"
            );
        }
        let _ = writeln!(
            out,
            "cairn_request_latency_seconds_sum{{op=\"{op}\"}} {}\ncairn_request_latency_seconds_count{{op=\"{op}\"}} {}",
            h.sum_us.load(Ordering::Relaxed) as f64 / 1e6,
            h.count.load(Ordering::Relaxed)
        );
    }
    out
}

/// Read a range so its blocks are promoted into the cache (the NBD CACHE
/// command and `cairn warm`). Returns the blocks now cached.
pub fn warm(engine: &Engine, offset: u64, length: u64) -> Result<u64, cairn_engine::EngineError> {
    let chunk = 1u64 << 20;
    let end = (offset.saturating_add(length)).min(engine.size_bytes());
    let mut buf = vec![0u8; chunk.min(end.saturating_sub(offset)).max(1) as usize];
    let mut at = offset;
    while at < end {
        let n = chunk.min(end - at) as usize;
        engine.read_uncut(at, &mut buf[..n])?;
        at += n as u64;
    }
    let bs = engine.block_size_bytes() as u64;
    Ok((offset / bs..end.div_ceil(bs))
        .filter(|&b| engine.is_cached(b))
        .count() as u64)
}
