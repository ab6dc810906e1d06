//! Status output: stable JSON (snake_case keys) and a human table.

use cairn_engine::{StatsSnapshot, Superblock};
use serde_json::{json, Map, Value};

pub fn status_json(s: &StatsSnapshot, sb: &Superblock, served: bool) -> Value {
    let mut m = Map::new();
    m.insert("served".into(), json!(served));
    m.insert("mode".into(), json!(s.mode));
    // The cache device's state: ok; degraded (cache writes failed for good,
    // every write goes straight to the origin); failed (stopped, every
    // request fails until restart). `state` is the same word.
    let cache_state = if s.failed {
        "failed"
    } else if s.degraded {
        "degraded"
    } else {
        "ok"
    };
    m.insert("state".into(), json!(cache_state));
    m.insert("cache_state".into(), json!(cache_state));
    m.insert("origin".into(), json!(sb.origin_identity));
    m.insert(
        "origin_state".into(),
        json!(if s.origin_failing { "failing" } else { "ok" }),
    );
    m.insert("block_size_bytes".into(), json!(s.block_size_bytes));
    m.insert("volume_size_bytes".into(), json!(s.volume_size_bytes));
    m.insert("cache_size_bytes".into(), json!(sb.cache_size_bytes));
    m.insert("cache_blocks".into(), json!(s.cache_blocks));
    m.insert("dirty_blocks".into(), json!(s.dirty_blocks));
    m.insert("clean_blocks".into(), json!(s.clean_blocks));
    m.insert("free_blocks".into(), json!(s.free_blocks));
    m.insert("corrupt_blocks".into(), json!(s.corrupt_blocks));
    m.insert("lost_blocks".into(), json!(s.lost_blocks));
    m.insert("pending_ranges".into(), json!(s.pending_ranges));
    m.insert("writeback_paused".into(), json!(s.writeback_paused));
    m.insert("writeback_offset".into(), json!(s.writeback_offset));
    m.insert("head_offset".into(), json!(s.head_offset));
    m.insert("index_memory_bytes".into(), json!(s.index_memory_bytes));
    m.insert("policy_memory_bytes".into(), json!(s.policy_memory_bytes));
    m.insert("integrity".into(), json!(s.integrity));
    if s.integrity {
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
    }
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
    for (name, value) in s.counter_pairs() {
        m.insert(name.into(), json!(value));
    }
    Value::Object(m)
}

/// The human table. A closed stdout (`cairn status | head -1`) is an
/// error for the caller, not a panic.
pub fn print_human(v: &Value) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let get = |k: &str| v.get(k).map(|x| x.to_string()).unwrap_or_default();
    writeln!(
        out,
        "cairn cache: {} (mode {}, {})",
        get("origin"),
        get("mode"),
        get("state")
    )?;
    writeln!(
        out,
        "  block size {} B, volume {} B, cache {} blocks",
        get("block_size_bytes"),
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
    writeln!(
        out,
        "  reads {} (hits {}, misses {}, hit ratio {}), writes {} (hits {}), bypassed {}",
        get("reads"),
        get("read_hits"),
        get("read_misses"),
        get("read_hit_ratio"),
        get("writes"),
        get("write_hits"),
        get("bypassed")
    )?;
    writeln!(
        out,
        "  flushes {}, discards {}, checksum mismatches {}, repairs {}",
        get("flushes"),
        get("discards"),
        get("checksum_mismatches"),
        get("repairs")
    )?;
    writeln!(
        out,
        "  cache device: {}, origin: {}",
        get("cache_state"),
        get("origin_state")
    )?;
    if v.get("integrity").and_then(|x| x.as_bool()) == Some(true) {
        writeln!(
            out,
            "  integrity: on ({}), recalculation {} ({} of {} blocks), origin mismatches {}, origin repairs {}, unverified reads {}",
            get("tag_algorithm"),
            get("recalc_state"),
            get("recalc_position_blocks"),
            get("recalc_total_blocks"),
            get("origin_mismatches"),
            get("origin_repairs"),
            get("origin_unverified_reads")
        )?;
    } else {
        writeln!(out, "  integrity: off (only cached blocks are checksummed)")?;
    }
    writeln!(
        out,
        "  device errors: cache read {} write {}, origin read {} write {}",
        get("cache_read_errors"),
        get("cache_write_errors"),
        get("origin_read_errors"),
        get("origin_write_errors")
    )?;
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
