//! Status output: stable JSON (snake_case keys) and a human table.

use cairn_engine::{CacheMode, StatsSnapshot, Superblock, VolumeEntry, VolumeState, VolumeStatus};
use cairn_nbd::ExportStatus;
use cairn_nbd::ServerStats;
use serde_json::{json, Map, Value};

/// Every volume as `volume list --json` and `status --json` (`volumes`)
/// show it; with `served`, the connections to each volume's export.
pub fn volumes_json(
    volumes: &[VolumeStatus],
    block_size_bytes: u32,
    served: Option<&[ExportStatus]>,
) -> Value {
    let list: Vec<Value> = volumes
        .iter()
        .map(|v| {
            let e = &v.entry;
            let mut m = Map::new();
            m.insert("id".into(), json!(e.id));
            m.insert("name".into(), json!(e.name));
            m.insert("origin".into(), json!(e.origin_identity));
            m.insert("size_bytes".into(), json!(e.origin_size_bytes));
            let mode = CacheMode::name_of_code(e.mode);
            m.insert("mode".into(), json!(mode));
            m.insert("integrity".into(), json!(e.integrity));
            if let Some(at) = v.recalc_position_blocks {
                m.insert("recalc_position_blocks".into(), json!(at));
            }
            let state = match e.state {
                VolumeState::Active => "active",
                VolumeState::Removing => "removing",
            };
            m.insert("state".into(), json!(state));
            m.insert("dirty_blocks".into(), json!(v.dirty_blocks));
            m.insert("clean_blocks".into(), json!(v.clean_blocks));
            let cached_bytes = (v.dirty_blocks + v.clean_blocks) * block_size_bytes as u64;
            m.insert("cached_bytes".into(), json!(cached_bytes));
            m.insert("writeback_offset".into(), json!(v.writeback_offset));
            m.insert("dirty_share_pct".into(), json!(v.dirty_share_pct));
            m.insert(
                "dirty_share_default".into(),
                json!(e.dirty_share_pct.is_none()),
            );
            m.insert("dirty_limit_blocks".into(), json!(v.dirty_limit_blocks));
            let origin = if v.origin_fenced {
                "fenced"
            } else if v.origin_error.is_some() {
                "failing"
            } else {
                "ok"
            };
            m.insert("origin_state".into(), json!(origin));
            if let Some(error) = &v.origin_error {
                m.insert("origin_error".into(), json!(error));
            }
            if let Some(exports) = served {
                let connections = exports
                    .iter()
                    .find(|x| x.name == e.name)
                    .map_or(0, |x| x.connections);
                m.insert("connections".into(), json!(connections));
            }
            Value::Object(m)
        })
        .collect();
    Value::Array(list)
}

pub fn status_json(
    s: &StatsSnapshot,
    sb: &Superblock,
    volume: &VolumeEntry,
    served: bool,
    server: Option<&ServerStats>,
    latency: Option<Value>,
    settings: Value,
) -> Value {
    let mut m = Map::new();
    m.insert("served".into(), json!(served));
    m.insert("mode".into(), json!(s.mode));
    let cache_state = cache_state(s);
    m.insert("state".into(), json!(cache_state));
    m.insert("cache_state".into(), json!(cache_state));
    m.insert("origin".into(), json!(volume.origin_identity));
    m.insert("volume".into(), json!(volume.name));
    m.insert("format_version".into(), json!(sb.version()));
    m.insert(
        "origin_state".into(),
        json!(if s.origin_fenced {
            "fenced"
        } else if s.origin_failing {
            "failing"
        } else {
            "ok"
        }),
    );
    m.insert("block_size_bytes".into(), json!(s.block_size_bytes));
    // 1 MiB (252 blocks at 4 KiB) for caches formatted with large records,
    // 256 KiB before: tells an operator whether a reformat would gain them.
    let record_blocks = cairn_format::record_data_blocks_max(sb.block_size_bytes, sb.features);
    m.insert(
        "record_data_max_bytes".into(),
        json!(record_blocks as u64 * sb.block_size_bytes as u64),
    );
    m.insert("volume_size_bytes".into(), json!(s.volume_size_bytes));
    m.insert("cache_size_bytes".into(), json!(sb.cache_size_bytes));
    m.insert("cache_blocks".into(), json!(s.cache_blocks));
    m.insert("dirty_blocks".into(), json!(s.dirty_blocks));
    m.insert("clean_blocks".into(), json!(s.clean_blocks));
    m.insert("free_blocks".into(), json!(s.free_blocks));
    m.insert("corrupt_blocks".into(), json!(s.corrupt_blocks));
    m.insert("lost_blocks".into(), json!(s.lost_blocks));
    m.insert("pending_ranges".into(), json!(s.pending_ranges));
    m.insert("origin_queue_depth".into(), json!(s.origin_queue_depth));
    m.insert(
        "origin_queue_in_flight".into(),
        json!(s.origin_queue_in_flight),
    );
    m.insert("writeback_paused".into(), json!(s.writeback_paused));
    m.insert("writeback_offset".into(), json!(s.writeback_offset));
    m.insert("head_offset".into(), json!(s.head_offset));
    // The log between its tail and its head, dirty or clean or stale.
    m.insert(
        "log_used_blocks".into(),
        json!(s.head_offset.saturating_sub(s.tail_offset)),
    );
    m.insert("index_memory_bytes".into(), json!(s.index_memory_bytes));
    m.insert("policy_memory_bytes".into(), json!(s.policy_memory_bytes));
    m.insert("integrity".into(), json!(s.integrity));
    insert_integrity(&mut m, s);
    let lookups = s.read_hits + s.read_misses;
    // The ratio counts block lookups of client reads: cache hits over hits
    // plus origin misses (zeroed ranges are neither).
    m.insert(
        "read_hit_ratio".into(),
        json!(if lookups == 0 {
            0.0
        } else {
            s.read_hits as f64 / lookups as f64
        }),
    );
    // Group commit: how many durability requests (FLUSH commands and FUA
    // writes) one cache barrier answered on average (one with nothing new
    // to make durable needs none).
    m.insert(
        "flushes_per_barrier".into(),
        json!(if s.flush_barriers == 0 {
            0.0
        } else {
            (s.flushes + s.fua_writes) as f64 / s.flush_barriers as f64
        }),
    );
    for (name, value) in s.counter_pairs() {
        m.insert(name.into(), json!(value));
    }
    insert_extras(&mut m, s, server, latency, settings);
    Value::Object(m)
}

/// The cache device's state: ok; degrading (a cache write failed for good
/// and the switch to degraded mode is under way or, after a failed attempt,
/// waits to be tried again: writes and flushes fail meanwhile, reads are
/// served); degraded (every dirty block was written back, every write goes
/// straight to the origin); failed (stopped, every request fails until
/// restart). `state` is the same word.
fn cache_state(s: &StatsSnapshot) -> &'static str {
    if s.failed {
        "failed"
    } else if s.degraded {
        "degraded"
    } else if s.degrading {
        "degrading"
    } else {
        "ok"
    }
}

/// The integrity tags' figures, present only when integrity is on.
fn insert_integrity(m: &mut Map<String, Value>, s: &StatsSnapshot) {
    if !s.integrity {
        return;
    }
    m.insert("tag_algorithm".into(), json!(s.tag_algorithm));
    m.insert(
        "recalc_position_blocks".into(),
        json!(s.recalc_position_blocks),
    );
    m.insert("recalc_total_blocks".into(), json!(s.recalc_total_blocks));
    m.insert(
        "recalc_state".into(),
        json!(if s.recalc_position_blocks >= s.recalc_total_blocks {
            "complete"
        } else {
            "running"
        }),
    );
    m.insert("tag_pages_dirty".into(), json!(s.tag_pages_dirty));
    m.insert("tag_memory_bytes".into(), json!(s.tag_memory_bytes));
    m.insert("tag_area_pages".into(), json!(s.tag_area_pages));
    m.insert("tag_area_free_pages".into(), json!(s.tag_area_free_pages));
    // What the free pages can still cover, in origin bytes.
    let free_blocks = s.tag_area_free_pages * cairn_format::TAGS_PER_PAGE as u64;
    m.insert(
        "tag_area_free_origin_bytes".into(),
        json!(free_blocks * s.block_size_bytes),
    );
}

/// The NBD server's counters and the latencies (online), the settings in
/// force and the lifetime counters.
fn insert_extras(
    m: &mut Map<String, Value>,
    s: &StatsSnapshot,
    server: Option<&ServerStats>,
    latency: Option<Value>,
    settings: Value,
) {
    if let Some(n) = server {
        for (name, value) in server_pairs(n) {
            m.insert(format!("nbd_{name}"), json!(value));
        }
    }
    m.insert("settings".into(), settings);
    // Since-start counters are the top-level keys; these span every run.
    let lifetime: Map<String, Value> = s
        .lifetime
        .iter()
        .map(|&(n, v)| (n.to_string(), json!(v)))
        .collect();
    m.insert("lifetime".into(), Value::Object(lifetime));
    if let Some(latency) = latency {
        m.insert("latency".into(), latency);
    }
}

/// The NBD server's counters and limits, by name (status and metrics).
pub fn server_pairs(n: &ServerStats) -> [(&'static str, u64); 18] {
    [
        ("connections_active", n.connections_active),
        ("connections_accepted", n.connections_accepted),
        ("connections_refused", n.connections_refused),
        ("connections_handshaking", n.connections_handshaking),
        ("handshakes_evicted", n.handshakes_evicted),
        ("connections_denied", n.connections_denied),
        ("tls_handshakes", n.tls_handshakes),
        ("tls_handshake_failures", n.tls_handshake_failures),
        ("protocol_errors", n.protocol_errors),
        ("requests", n.requests),
        ("in_flight_limit_waits", n.in_flight_limit_waits),
        ("buffer_budget_waits", n.buffer_budget_waits),
        ("reply_sends_short", n.reply_sends_short),
        ("reply_send_waits", n.reply_send_waits),
        ("buffered_bytes", n.buffered_bytes),
        ("max_connections", n.max_connections),
        (
            "max_in_flight_per_connection",
            n.max_in_flight_per_connection,
        ),
        ("max_buffered_bytes", n.max_buffered_bytes),
    ]
}

/// The human table. A closed stdout (`cairn status | head -1`) is an
/// error for the caller, not a panic.
/// The integrity part of the human status.
pub(crate) fn integrity_line(v: &Value) -> String {
    let get = |k: &str| v.get(k).map(|x| x.to_string()).unwrap_or_default();
    if v.get("integrity").and_then(|x| x.as_bool()) != Some(true) {
        return "off (only cached blocks are checksummed)".into();
    }
    if v.get("recalc_total_blocks").and_then(|x| x.as_u64()) == Some(0) {
        // A reserve made at format, which no volume uses yet.
        return format!(
            "no volume keeps tags yet; tag area {} pages, {} free (room for {} bytes of origin, for `volume add --integrity`)",
            get("tag_area_pages"),
            get("tag_area_free_pages"),
            get("tag_area_free_origin_bytes")
        );
    }
    format!(
        "on ({}), recalculation {} ({} of {} blocks), origin mismatches {}, origin repairs {}, unverified reads {}; tag area {} pages, {} free (room for {} bytes of origin)",
        get("tag_algorithm"),
        get("recalc_state"),
        get("recalc_position_blocks"),
        get("recalc_total_blocks"),
        get("origin_mismatches"),
        get("origin_repairs"),
        get("origin_unverified_reads"),
        get("tag_area_pages"),
        get("tag_area_free_pages"),
        get("tag_area_free_origin_bytes")
    )
}

/// A corrupt block is one of the dirty or clean ones whose dirty data
/// failed its checksum, and a lost mark one such block evicted since: both
/// read as EIO until rewritten. Said in words, so the block counts (which
/// hold the corrupt ones) are not taken for a miscount and the loss is not
/// missed.
fn write_lost_data(out: &mut impl std::io::Write, v: &Value) -> std::io::Result<()> {
    let count = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
    let lost_data = count("corrupt_blocks") + count("lost_blocks");
    if lost_data > 0 {
        writeln!(
            out,
            "  DATA LOST: {lost_data} blocks read as EIO until rewritten ({} corrupt in the cache, counted among the blocks above; {} evicted since, lost_blocks); `cairn check` lists them",
            count("corrupt_blocks"),
            count("lost_blocks")
        )?;
    }
    Ok(())
}

/// The prefetch line (`cairn warm`, NBD CACHE), once there were any: their
/// reads are counted apart from the clients' and the hit ratio.
fn write_prefetches(out: &mut impl std::io::Write, v: &Value) -> std::io::Result<()> {
    let count = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
    if count("prefetch_reads") > 0 {
        writeln!(
            out,
            "  prefetches (warm, NBD CACHE) {} requests (blocks: {} hits, {} misses), not counted in reads",
            count("prefetch_reads"),
            count("prefetch_hits"),
            count("prefetch_misses")
        )?;
    }
    Ok(())
}

/// The partial-write line, once there were any: where the old contents of
/// blocks written in part came from, counted apart from the clients' reads.
fn write_partial_writes(out: &mut impl std::io::Write, v: &Value) -> std::io::Result<()> {
    let count = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
    if count("write_rmw") > 0 {
        writeln!(
            out,
            "  partial-block writes {} blocks (old contents: {} cached, {} zeroed, {} read from the origin), not counted in reads",
            count("write_rmw"),
            count("write_rmw_hits"),
            count("write_rmw_zero_hits"),
            count("write_rmw_origin_reads")
        )?;
    }
    Ok(())
}

pub fn print_human(v: &Value) -> std::io::Result<()> {
    write_human(&mut std::io::stdout().lock(), v)
}

/// The first lines of a human status, the same online and offline: the
/// cache, its sizes, its blocks and any data lost; `served` follows the
/// mode and state on the first line.
pub(crate) fn write_head(
    out: &mut impl std::io::Write,
    v: &Value,
    served: &str,
) -> std::io::Result<()> {
    let get = |k: &str| v.get(k).map(|x| x.to_string()).unwrap_or_default();
    writeln!(
        out,
        "cairn cache: {} (mode {}, {}){served}",
        get("origin"),
        get("mode"),
        get("state")
    )?;
    writeln!(
        out,
        "  block size {} B, records up to {} B, volume {} B, cache {} blocks",
        get("block_size_bytes"),
        get("record_data_max_bytes"),
        get("volume_size_bytes"),
        get("cache_blocks")
    )?;
    writeln!(
        out,
        "  blocks: {} dirty, {} clean, {} free, {} corrupt",
        get("dirty_blocks"),
        get("clean_blocks"),
        get("free_blocks"),
        get("corrupt_blocks")
    )?;
    write_lost_data(out, v)
}

/// The human form of the status `v`.
fn write_human(out: &mut impl std::io::Write, v: &Value) -> std::io::Result<()> {
    let get = |k: &str| v.get(k).map(|x| x.to_string()).unwrap_or_default();
    write_head(out, v, "")?;
    // `reads` and `writes` count client requests; hits, misses and
    // bypassed count blocks (one request spans many), so each says which.
    writeln!(
        out,
        "  reads {} requests (blocks: {} hits, {} misses, hit ratio {}), writes {} requests (blocks: {} hits), bypassed {} blocks",
        get("reads"),
        get("read_hits"),
        get("read_misses"),
        get("read_hit_ratio"),
        get("writes"),
        get("write_hits"),
        get("bypassed")
    )?;
    write_prefetches(out, v)?;
    write_partial_writes(out, v)?;
    let flushes_per_barrier = v
        .get("flushes_per_barrier")
        .and_then(|x| x.as_f64())
        .unwrap_or(0.0);
    writeln!(
        out,
        "  flushes {} and FUA writes {} ({} barriers, {:.2} per barrier, {} joined one in progress, {} barriers overlapped another), discards {}, checksum mismatches {}, repairs {}",
        get("flushes"),
        get("fua_writes"),
        get("flush_barriers"),
        flushes_per_barrier,
        get("group_commit_joins"),
        get("overlapped_barriers"),
        get("discards"),
        get("checksum_mismatches"),
        get("repairs")
    )?;
    writeln!(
        out,
        "  cache device: {}, origin: {} (queue depth {}, {} reads in flight, {} waited for a slot)",
        get("cache_state"),
        get("origin_state"),
        get("origin_queue_depth"),
        get("origin_queue_in_flight"),
        get("origin_queue_waits")
    )?;
    for volume in v["volumes"].as_array().into_iter().flatten() {
        if let Some(error) = volume["origin_error"].as_str() {
            let name = volume["name"].as_str().unwrap_or("");
            writeln!(out, "  origin of volume {name:?}: {error}")?;
        }
    }
    writeln!(out, "  integrity: {}", integrity_line(v))?;
    writeln!(
        out,
        "  device errors: cache read {} write {}, origin read {} write {} (origin reads asked again {}, writes {})",
        get("cache_read_errors"),
        get("cache_write_errors"),
        get("origin_read_errors"),
        get("origin_write_errors"),
        get("origin_read_retries"),
        get("origin_write_retries")
    )?;
    print_settings(out, v)?;
    print_nbd(out, v)?;
    writeln!(
        out,
        "  write-back: {} blocks in {} groups, paused {}, position {} of {}",
        get("writeback_blocks"),
        get("writeback_groups"),
        get("writeback_paused"),
        get("writeback_offset"),
        get("head_offset")
    )?;
    Ok(())
}

/// The NBD server's lines, when a daemon serves the cache.
fn print_nbd(out: &mut impl std::io::Write, v: &Value) -> std::io::Result<()> {
    if v.get("nbd_requests").is_none() {
        return Ok(());
    }
    let get = |k: &str| v.get(k).map(|x| x.to_string()).unwrap_or_default();
    writeln!(
        out,
        "  nbd: {} connections ({} in the handshake; {} accepted, {} refused at the limit of {}, {} handshakes pushed out), {} requests, {} protocol errors, {} TLS handshakes ({} failed)",
        get("nbd_connections_active"),
        get("nbd_connections_handshaking"),
        get("nbd_connections_accepted"),
        get("nbd_connections_refused"),
        get("nbd_max_connections"),
        get("nbd_handshakes_evicted"),
        get("nbd_requests"),
        get("nbd_protocol_errors"),
        get("nbd_tls_handshakes"),
        get("nbd_tls_handshake_failures")
    )?;
    writeln!(
        out,
        "  limits hit: in-flight per connection {} times (max {}), buffer budget {} times (max {} bytes, {} in use); clients slow to read: {} reply sends found the socket full, {} waited for room",
        get("nbd_in_flight_limit_waits"),
        get("nbd_max_in_flight_per_connection"),
        get("nbd_buffer_budget_waits"),
        get("nbd_max_buffered_bytes"),
        get("nbd_buffered_bytes"),
        get("nbd_reply_sends_short"),
        get("nbd_reply_send_waits")
    )?;
    Ok(())
}

/// The settings line: each setting's value and source.
pub(crate) fn print_settings(out: &mut impl std::io::Write, v: &Value) -> std::io::Result<()> {
    if let Some(settings) = v["settings"].as_object() {
        let line: Vec<String> = settings
            .iter()
            .map(|(name, s)| {
                format!(
                    "{name}={} ({})",
                    s["value"],
                    s["source"].as_str().unwrap_or("?")
                )
            })
            .collect();
        writeln!(out, "  settings: {}", line.join(", "))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Requests and blocks are labelled, so "reads 16 (hits 2866 …)" no
    /// longer reads as more hits than reads.
    #[test]
    fn human_status_names_the_units_of_reads_and_writes() {
        let v = json!({
            "reads": 16, "read_hits": 2866, "read_misses": 13491, "read_hit_ratio": 0.25,
            "writes": 2810, "write_hits": 7858, "bypassed": 12,
        });
        let mut out = Vec::new();
        write_human(&mut out, &v).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("  reads 16 requests (blocks: 2866 hits, 13491 misses, hit ratio 0.25), writes 2810 requests (blocks: 7858 hits), bypassed 12 blocks\n"),
            "{text}"
        );
        assert!(!text.contains("prefetches"), "{text}");
    }

    /// Prefetches (`cairn warm`, NBD CACHE) have their own line, apart
    /// from the clients' reads.
    #[test]
    fn human_status_shows_prefetches_apart_from_reads() {
        let v = json!({
            "reads": 0, "read_hits": 0, "read_misses": 0, "read_hit_ratio": 0.0,
            "prefetch_reads": 2, "prefetch_hits": 256, "prefetch_misses": 256,
        });
        let mut out = Vec::new();
        write_human(&mut out, &v).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("  reads 0 requests (blocks: 0 hits, 0 misses, hit ratio 0.0)"),
            "{text}"
        );
        assert!(
            text.contains("  prefetches (warm, NBD CACHE) 2 requests (blocks: 256 hits, 256 misses), not counted in reads\n"),
            "{text}"
        );
    }

    /// Partial writes' old contents have their own line too: a client
    /// that only writes shows no reads.
    #[test]
    fn human_status_shows_partial_writes_apart_from_reads() {
        let v = json!({
            "reads": 0, "read_hits": 0, "read_misses": 0, "read_hit_ratio": 0.0,
            "write_rmw": 8, "write_rmw_hits": 2, "write_rmw_zero_hits": 1,
            "write_rmw_origin_reads": 5,
        });
        let mut out = Vec::new();
        write_human(&mut out, &v).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("  partial-block writes 8 blocks (old contents: 2 cached, 1 zeroed, 5 read from the origin), not counted in reads\n"),
            "{text}"
        );
    }
}
