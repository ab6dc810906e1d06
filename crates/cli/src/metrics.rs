//! The Prometheus endpoint (`serve --metrics HOST:PORT`): the engine's
//! counters and gauges, and latency histograms per NBD operation.

use std::io::Write as _;
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use cairn_engine::Engine;

use crate::export::{Latencies, LATENCY_BUCKETS_US};

/// A Prometheus label value: backslash, double quote and newline escaped.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The per-volume gauges, each with a `volume` label (the export name)
/// and the volume's `id`; the cache-wide figures stay unlabelled.
fn render_volumes(out: &mut String, engine: &Engine, exports: Option<&[cairn_nbd::ExportStatus]>) {
    use std::fmt::Write as _;
    let volumes = engine.volumes_status();
    let block_bytes = engine.block_size_bytes() as u64;
    let _ = writeln!(out, "# TYPE cairn_volume_info gauge");
    for v in &volumes {
        let e = &v.entry;
        let mode = cairn_engine::CacheMode::name_of_code(e.mode);
        let _ = writeln!(
            out,
            "cairn_volume_info{{volume=\"{}\",id=\"{}\",origin=\"{}\",mode=\"{mode}\"}} 1",
            label(&e.name),
            e.id,
            label(&e.origin_identity)
        );
    }
    // The connections to each volume's export, when a daemon serves it.
    let connections = |v: &cairn_engine::VolumeStatus| {
        exports.and_then(|x| {
            x.iter()
                .find(|e| e.name == v.entry.name)
                .map(|e| e.connections as u64)
        })
    };
    // `None`: no line for that volume (a limit that does not apply).
    type Gauge<'a> = Box<dyn Fn(&cairn_engine::VolumeStatus) -> Option<u64> + 'a>;
    let mut gauges: Vec<(&str, Gauge)> = vec![
        ("dirty_blocks", Box::new(|v| Some(v.dirty_blocks))),
        ("clean_blocks", Box::new(|v| Some(v.clean_blocks))),
        (
            "cached_bytes",
            Box::new(|v| Some((v.dirty_blocks + v.clean_blocks) * block_bytes)),
        ),
        ("size_bytes", Box::new(|v| Some(v.entry.origin_size_bytes))),
        ("writeback_offset", Box::new(|v| Some(v.writeback_offset))),
        (
            "origin_failing",
            Box::new(|v| Some(u64::from(v.origin_error.is_some()))),
        ),
        (
            "origin_fenced",
            Box::new(|v| Some(u64::from(v.origin_fenced))),
        ),
        (
            "dirty_share_pct",
            Box::new(|v| Some(u64::from(v.dirty_share_pct))),
        ),
        // Only while another volume holds blocks: alone, no limit.
        ("dirty_limit_blocks", Box::new(|v| v.dirty_limit_blocks)),
        // Only for volumes with integrity tags.
        (
            "recalc_position_blocks",
            Box::new(|v| v.recalc_position_blocks),
        ),
    ];
    if exports.is_some() {
        gauges.push((
            "connections",
            Box::new(move |v| Some(connections(v).unwrap_or(0))),
        ));
    }
    for (name, value) in gauges {
        let _ = writeln!(out, "# TYPE cairn_volume_{name} gauge");
        for v in &volumes {
            let Some(value) = value(v) else { continue };
            let _ = writeln!(
                out,
                "cairn_volume_{name}{{volume=\"{}\",id=\"{}\"}} {value}",
                label(&v.entry.name),
                v.entry.id,
            );
        }
    }
}

/// Scrapes answered at once; a connection beyond them is closed unanswered.
const SCRAPES_IN_FLIGHT_MAX: usize = 16;
/// How long a scraper may take to send its request head.
const REQUEST_HEAD_TIMEOUT_MS: u64 = 2_000;
/// Largest request head read.
const REQUEST_HEAD_BYTES_MAX: usize = 16 * 1024;

/// Answer `GET /metrics` (and `GET /`) with the current metrics, each
/// connection on a thread of its own, so one client that connects and
/// says nothing cannot hold back the scrapes of others (one at a time, a
/// silent connection delayed every scrape by its whole timeout, and a few
/// hundred of them blinded monitoring). At most
/// [`SCRAPES_IN_FLIGHT_MAX`] at once.
pub fn metrics_loop(
    listener: TcpListener,
    engine: &Engine,
    latencies: &Latencies,
    server: &cairn_nbd::StatsReader,
) {
    let in_flight = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for conn in listener.incoming() {
            let Ok(stream) = conn else { continue };
            if in_flight.fetch_add(1, Ordering::AcqRel) >= SCRAPES_IN_FLIGHT_MAX {
                in_flight.fetch_sub(1, Ordering::AcqRel);
                tracing::debug!("metrics: too many connections at once; one closed unanswered");
                continue;
            }
            let in_flight = &in_flight;
            let spawned = std::thread::Builder::new()
                .name("metrics-scrape".into())
                .spawn_scoped(scope, move || {
                    answer(stream, engine, latencies, server);
                    in_flight.fetch_sub(1, Ordering::AcqRel);
                });
            if let Err(e) = spawned {
                in_flight.fetch_sub(1, Ordering::AcqRel);
                tracing::warn!(error = %e, "metrics: cannot start a thread for a scrape");
            }
        }
    });
}

/// Read one request head and answer it.
fn answer(
    mut stream: std::net::TcpStream,
    engine: &Engine,
    latencies: &Latencies,
    server: &cairn_nbd::StatsReader,
) {
    let _ = stream.set_read_timeout(Some(Duration::from_millis(REQUEST_HEAD_TIMEOUT_MS)));
    let _ = stream.set_write_timeout(Some(Duration::from_millis(REQUEST_HEAD_TIMEOUT_MS)));
    // Read the whole request head before answering: closing a socket
    // with unread request bytes resets the connection, and the client
    // may lose the response.
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < REQUEST_HEAD_BYTES_MAX {
        match std::io::Read::read(&mut stream, &mut buf) {
            Ok(n) if n > 0 => head.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    let request_line = head
        .split(|&b| b == b'\r' || b == b'\n')
        .next()
        .unwrap_or(&[]);
    let mut words = request_line.split(|&b| b == b' ');
    let (method, path) = (words.next().unwrap_or(&[]), words.next().unwrap_or(&[]));
    let path = path.split(|&b| b == b'?').next().unwrap_or(&[]);
    let (status, body) = match (method, path) {
        (b"GET" | b"HEAD", b"/metrics" | b"/") => {
            let exports = server.exports();
            let body = render_metrics(engine, latencies, Some(&server.stats()), Some(&exports));
            ("200 OK", body)
        }
        (b"GET" | b"HEAD", _) => ("404 Not Found", "metrics are at /metrics\n".to_string()),
        _ => ("405 Method Not Allowed", "only GET\n".to_string()),
    };
    let body = if method == b"HEAD" {
        String::new()
    } else {
        body
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes());
}

pub fn render_metrics(
    engine: &Engine,
    latencies: &Latencies,
    server: Option<&cairn_nbd::ServerStats>,
    exports: Option<&[cairn_nbd::ExportStatus]>,
) -> String {
    use std::fmt::Write as _;
    let s = engine.stats();
    let mut out = String::new();
    render_volumes(&mut out, engine, exports);
    for (name, value) in s.counter_pairs() {
        let _ = writeln!(
            out,
            "# TYPE cairn_{name}_total counter\ncairn_{name}_total {value}"
        );
    }
    // Totals over every run of the cache (persisted with the checkpoint).
    for (name, value) in &s.lifetime {
        let _ = writeln!(
            out,
            "# TYPE cairn_lifetime_{name}_total counter\ncairn_lifetime_{name}_total {value}"
        );
    }
    for (name, value) in [
        ("dirty_blocks", s.dirty_blocks),
        ("clean_blocks", s.clean_blocks),
        ("free_blocks", s.free_blocks),
        ("corrupt_blocks", s.corrupt_blocks),
        ("lost_blocks", s.lost_blocks),
        ("cache_blocks", s.cache_blocks),
        ("block_size_bytes", s.block_size_bytes),
        ("volume_size_bytes", s.volume_size_bytes),
        ("writeback_paused", s.writeback_paused as u64),
        ("index_memory_bytes", s.index_memory_bytes),
        ("integrity_enabled", s.integrity as u64),
        ("integrity_recalc_position_blocks", s.recalc_position_blocks),
        ("integrity_recalc_total_blocks", s.recalc_total_blocks),
        ("integrity_tag_memory_bytes", s.tag_memory_bytes),
        ("integrity_tag_area_pages", s.tag_area_pages),
        ("integrity_tag_area_free_pages", s.tag_area_free_pages),
        ("cache_degraded", s.degraded as u64),
        ("cache_degrading", s.degrading as u64),
        ("cache_failed", s.failed as u64),
        ("origin_failing", s.origin_failing as u64),
        ("origin_fenced", s.origin_fenced as u64),
    ] {
        let _ = writeln!(out, "# TYPE cairn_{name} gauge\ncairn_{name} {value}");
    }
    if let Some(n) = server {
        for (name, value) in crate::status::server_pairs(n) {
            // Limits and levels are gauges; the rest only ever grow.
            let gauge = name.starts_with("max_")
                || name.ends_with("_active")
                || name.ends_with("_bytes")
                || name == "connections_handshaking";
            if gauge {
                let _ = writeln!(
                    out,
                    "# TYPE cairn_nbd_{name} gauge\ncairn_nbd_{name} {value}"
                );
            } else {
                let _ = writeln!(
                    out,
                    "# TYPE cairn_nbd_{name}_total counter\ncairn_nbd_{name}_total {value}"
                );
            }
        }
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

#[cfg(test)]
mod tests {
    #[test]
    fn label_values_are_escaped() {
        assert_eq!(super::label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
        assert_eq!(super::label("db"), "db");
    }
}
