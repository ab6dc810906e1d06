//! One `cairn top` frame as plain ASCII text, for `--once` and for a
//! stdout that is not a terminal (a script, a pipe, a log): the same
//! figures as the drawn frame, without box drawing, gauges or colour.

use super::render::{bound, duration, mb};
use super::view::View;

/// The frame's lines, each ending in a newline.
pub fn frame(view: &View) -> String {
    let hit = view
        .hit_ratio
        .map(|r| format!("{:.1}%", r * 100.0))
        .unwrap_or_else(|| "-".into());
    let mut lines = vec![
        format!(
            "cairn top: {}  mode {}  cache {}  origin {}  clients {}",
            view.cache, view.mode, view.cache_state, view.origin_state, view.connections
        ),
        format!("{:<8}{:>10}{:>12}", "", "IOPS", "MB/s"),
        format!(
            "{:<8}{:>10.0}{:>12}  hit ratio {hit}",
            "read",
            view.read_iops,
            mb(view.read_bytes_per_sec)
        ),
        format!(
            "{:<8}{:>10.0}{:>12}  flushes {:.0}/s",
            "write",
            view.write_iops,
            mb(view.write_bytes_per_sec),
            view.flushes_per_sec
        ),
        format!(
            "cache: dirty {:.1}%  ({} dirty, {} clean, {} free of {} blocks)",
            view.dirty_share() * 100.0,
            view.dirty_blocks,
            view.clean_blocks,
            view.free_blocks,
            view.cache_blocks
        ),
        writeback_line(view),
        format!("latency over the last {}:", duration(view.interval)),
        format!(
            "{:<14}{:>10}{:>12}{:>12}",
            "operation", "requests", "p50", "p99"
        ),
    ];
    for l in &view.latencies {
        lines.push(format!(
            "{:<14}{:>10}{:>12}{:>12}",
            l.op,
            l.requests,
            bound(l.p50_le_us),
            bound(l.p99_le_us)
        ));
    }
    let mut text = String::new();
    for line in lines {
        text.push_str(line.trim_end());
        text.push('\n');
    }
    text
}

/// The write-back line, the same in the drawn frame and the plain one.
pub(super) fn writeback_line(view: &View) -> String {
    let mut wb = format!("write-back {} MB/s", mb(view.writeback_bytes_per_sec));
    wb.push_str(&match view.time_to_clean {
        Some(t) => format!(", clean in {}", duration(t)),
        None if view.dirty_blocks == 0 => ", clean".to_string(),
        None => ", idle".to_string(),
    });
    if view.writeback_paused {
        wb.push_str(" (paused)");
    }
    if let Some((at, total)) = view.recalc {
        wb.push_str(&format!(
            ", integrity recalculation {:.1}%",
            at as f64 * 100.0 / total.max(1) as f64
        ));
    }
    wb
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::*;

    /// The frame a script or a log gets is ASCII only (the drawn frame's
    /// box drawing and gauge blocks were in `--once`'s output), with every
    /// figure of the drawn one.
    #[test]
    fn the_plain_frame_is_ascii_with_every_figure() {
        let hist =
            |counts: [u64; 3]| json!({"read": {"le_us": [100, 1000, null], "counts": counts}});
        let before = json!({"reads": 100, "read_bytes": 0, "read_hits": 10, "read_misses": 0,
            "writes": 0, "write_bytes": 0, "flushes": 0, "writeback_bytes": 0,
            "latency": hist([0, 0, 0])});
        let now = json!({"reads": 300, "read_bytes": 8192000, "read_hits": 40, "read_misses": 10,
            "writes": 50, "write_bytes": 204800, "flushes": 6, "writeback_bytes": 4096000,
            "dirty_blocks": 250, "clean_blocks": 500, "free_blocks": 250, "cache_blocks": 1000,
            "block_size_bytes": 4096, "mode": "writeback", "cache_state": "ok",
            "origin_state": "ok", "nbd_connections_active": 2, "writeback_paused": false,
            "latency": hist([0, 150, 50])});
        let view = View::between("/dev/cache", &before, &now, Duration::from_secs(2));
        let text = frame(&view);
        assert!(text.is_ascii(), "not ASCII:\n{text}");
        for needle in [
            "cairn top: /dev/cache  mode writeback  cache ok  origin ok  clients 2\n",
            "read           100         4.1  hit ratio 75.0%\n",
            "write           25         0.1  flushes 3/s\n",
            "cache: dirty 25.0%  (250 dirty, 500 clean, 250 free of 1000 blocks)\n",
            "write-back 2.0 MB/s, clean in 500 ms\n",
            "latency over the last 2.0 s:\n",
            "operation       requests         p50         p99\n",
            "read                 200     <= 1 ms       > 1 s\n",
        ] {
            assert!(text.contains(needle), "no {needle:?} in:\n{text}");
        }
    }
}
