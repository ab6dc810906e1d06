//! The daemon side: accept admin connections, decode one request each, run
//! it (see [`super::exec`]) and send the replies.

use std::io::BufReader;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cairn_engine::Engine;
use cairn_nbd::{Exports, StatsReader};

use crate::export::Latencies;
use crate::settings::SharedSettings;
use crate::volume_exports::VolumeExports;

use super::exec::{execute, Target};
use super::{
    decode_request, read_line, write_message, AdminReply, ProtocolError, REQUEST_LINE_BYTES_MAX,
};

/// Admin connections served at once; more are refused with an error.
pub const ADMIN_CONNECTIONS_MAX: usize = 16;

/// How long a client may take to send its request line, so a silent
/// connection cannot hold one of the slots for long.
const REQUEST_READ_TIMEOUT_MS: u64 = 10_000;

/// What is read and thrown away after a bad request, at the most.
const DISCARD_BYTES_MAX: u64 = 64 << 10;

/// Frees an admin connection slot when its thread ends (or never starts).
struct AdminSlot(Arc<AtomicUsize>);

impl Drop for AdminSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One thread per admin connection, so `cairn status` answers while a
/// `cairn flush` drains for minutes on another connection. Returns once
/// `stop` is set and a connection wakes it.
pub fn admin_loop(
    listener: UnixListener,
    engine: &Arc<Engine>,
    cache: &Path,
    stop: &AtomicBool,
    (server, latencies, settings, exports): Served<'_>,
) {
    let active = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut stream) = conn else { continue };
        if active.fetch_add(1, Ordering::SeqCst) >= ADMIN_CONNECTIONS_MAX {
            active.fetch_sub(1, Ordering::SeqCst);
            let busy = AdminReply::error(format!(
                "the daemon is busy with {ADMIN_CONNECTIONS_MAX} admin requests; try again"
            ));
            let _ = write_message(&mut stream, &busy);
            continue;
        }
        let slot = AdminSlot(active.clone());
        let engine = engine.clone();
        let cache = cache.to_path_buf();
        let server = server.clone();
        let latencies = latencies.clone();
        let settings = settings.clone();
        let exports = exports.clone();
        let _ = std::thread::Builder::new()
            .name("admin-conn".into())
            .spawn(move || {
                let _slot = slot;
                let served = (&server, &latencies, &settings, &exports);
                if let Err(e) = handle_connection(stream, &engine, cache, served) {
                    tracing::debug!("admin connection: {e}");
                }
            });
    }
}

/// What a daemon serving the engine adds to a request's target: the NBD
/// server's counters, the latency histograms, the settings in force and
/// the exports.
pub type Served<'a> = (
    &'a StatsReader,
    &'a Arc<Latencies>,
    &'a SharedSettings,
    &'a Exports,
);

fn handle_connection(
    stream: UnixStream,
    engine: &Arc<Engine>,
    cache: PathBuf,
    (server, latencies, settings, exports): Served<'_>,
) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_millis(REQUEST_READ_TIMEOUT_MS)))?;
    let mut w = stream.try_clone()?;
    let mut r = BufReader::new(stream);
    let request = match read_line(&mut r, REQUEST_LINE_BYTES_MAX) {
        // Connected and left without asking: the "is a daemon there?" probe.
        Ok(None) => return Ok(()),
        Ok(Some(line)) => decode_request(&line),
        Err(ProtocolError::Io(e)) if is_timeout(&e) => {
            let msg = format!("no request line within {REQUEST_READ_TIMEOUT_MS} ms");
            return write_message(&mut w, &AdminReply::error(msg));
        }
        Err(e) => Err(e),
    };
    let request = match request {
        Ok(request) => request,
        Err(ProtocolError::Io(e)) => return Err(e),
        Err(e) => {
            write_message(&mut w, &AdminReply::error(e.to_string()))?;
            return discard_input(&mut r, &w);
        }
    };
    tracing::debug!(command = request.name(), "admin request");
    let target = Target {
        engine,
        cache: &cache,
        served: true,
        server: Some(server.stats()),
        latency: Some(latencies.to_json()),
        settings: Some(settings.clone()),
        exports: Some(VolumeExports {
            exports,
            engine,
            latencies,
        }),
    };
    // A client that went away mid-request does not stop the work (a drain
    // runs to its end); the first failed write is reported at the end.
    let mut broken: Option<std::io::Error> = None;
    let mut send = |reply: AdminReply| {
        if broken.is_none() {
            if let Err(e) = write_message(&mut w, &reply) {
                broken = Some(e);
            }
        }
    };
    let result = execute(&target, &request, &mut send);
    let last = match result {
        Ok(()) => AdminReply::Ok,
        Err(e) => AdminReply::Error {
            advice: crate::advice::for_command(&e),
            message: e.to_string(),
        },
    };
    send(last);
    match broken {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// After a bad request: finish our side, then read what the client still
/// sends (bounded in bytes and by the read timeout). Closing a socket with
/// unread input resets the connection, and the client could lose the error
/// reply.
fn discard_input(r: &mut impl std::io::Read, w: &UnixStream) -> std::io::Result<()> {
    w.shutdown(std::net::Shutdown::Write)?;
    let _ = std::io::copy(
        &mut std::io::Read::take(&mut *r, DISCARD_BYTES_MAX),
        &mut std::io::sink(),
    );
    Ok(())
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}
