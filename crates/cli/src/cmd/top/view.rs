//! What one frame of `cairn top` shows, computed from two status samples
//! of the daemon (rates are their difference over the time between them).

use std::time::Duration;

use serde_json::Value;

/// Latency of one operation over the interval: (p50, p99) as the upper
/// bound of the histogram bucket each falls in (`None`: the open last
/// bucket, over a second).
#[derive(Debug, Clone, PartialEq)]
pub struct OpLatency {
    pub op: String,
    pub requests: u64,
    pub p50_le_us: Option<u64>,
    pub p99_le_us: Option<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct View {
    pub cache: String,
    pub mode: String,
    pub cache_state: String,
    pub origin_state: String,
    pub interval: Duration,
    pub read_iops: f64,
    pub write_iops: f64,
    pub read_bytes_per_sec: f64,
    pub write_bytes_per_sec: f64,
    pub flushes_per_sec: f64,
    /// Hits over lookups in the interval; `None` without a lookup.
    pub hit_ratio: Option<f64>,
    pub dirty_blocks: u64,
    pub clean_blocks: u64,
    pub free_blocks: u64,
    pub cache_blocks: u64,
    pub block_size_bytes: u64,
    pub writeback_bytes_per_sec: f64,
    pub writeback_paused: bool,
    /// Dirty bytes over the write-back rate; `None` when nothing is
    /// written back (or nothing is dirty).
    pub time_to_clean: Option<Duration>,
    pub connections: u64,
    pub latencies: Vec<OpLatency>,
    /// Integrity recalculation: (position, total) while it runs.
    pub recalc: Option<(u64, u64)>,
}

fn u(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or(0)
}

fn s(v: &Value, key: &str) -> String {
    v[key].as_str().unwrap_or("?").to_string()
}

impl View {
    /// The view of the interval from `before` to `now`, `interval` apart.
    pub fn between(cache: &str, before: &Value, now: &Value, interval: Duration) -> View {
        let secs = interval.as_secs_f64().max(1e-3);
        let rate = |key: &str| u(now, key).saturating_sub(u(before, key)) as f64 / secs;
        let hits = u(now, "read_hits").saturating_sub(u(before, "read_hits"));
        let misses = u(now, "read_misses").saturating_sub(u(before, "read_misses"));
        let writeback_bytes_per_sec = rate("writeback_bytes");
        let dirty_bytes = u(now, "dirty_blocks") * u(now, "block_size_bytes");
        let time_to_clean = (writeback_bytes_per_sec > 0.0 && dirty_bytes > 0)
            .then(|| Duration::from_secs_f64(dirty_bytes as f64 / writeback_bytes_per_sec));
        let recalc = (now["integrity"].as_bool() == Some(true)
            && u(now, "recalc_position_blocks") < u(now, "recalc_total_blocks"))
        .then(|| {
            (
                u(now, "recalc_position_blocks"),
                u(now, "recalc_total_blocks"),
            )
        });
        View {
            cache: cache.to_string(),
            mode: s(now, "mode"),
            cache_state: s(now, "cache_state"),
            origin_state: s(now, "origin_state"),
            interval,
            read_iops: rate("reads"),
            write_iops: rate("writes"),
            read_bytes_per_sec: rate("read_bytes"),
            write_bytes_per_sec: rate("write_bytes"),
            flushes_per_sec: rate("flushes"),
            hit_ratio: (hits + misses > 0).then(|| hits as f64 / (hits + misses) as f64),
            dirty_blocks: u(now, "dirty_blocks"),
            clean_blocks: u(now, "clean_blocks"),
            free_blocks: u(now, "free_blocks"),
            cache_blocks: u(now, "cache_blocks"),
            block_size_bytes: u(now, "block_size_bytes"),
            writeback_bytes_per_sec,
            writeback_paused: now["writeback_paused"].as_bool() == Some(true),
            time_to_clean,
            connections: u(now, "nbd_connections_active"),
            latencies: latencies(&before["latency"], &now["latency"]),
            recalc,
        }
    }

    pub fn dirty_share(&self) -> f64 {
        if self.cache_blocks == 0 {
            0.0
        } else {
            (self.dirty_blocks as f64 / self.cache_blocks as f64).clamp(0.0, 1.0)
        }
    }
}

/// p50 and p99 of each operation over the interval, from the difference of
/// the two histograms.
fn latencies(before: &Value, now: &Value) -> Vec<OpLatency> {
    let Some(ops) = now.as_object() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (op, h) in ops {
        let counts = |v: &Value| -> Vec<u64> {
            v["counts"]
                .as_array()
                .map(|a| a.iter().map(|c| c.as_u64().unwrap_or(0)).collect())
                .unwrap_or_default()
        };
        let (was, is) = (counts(&before[op]), counts(h));
        let diff: Vec<u64> = is
            .iter()
            .enumerate()
            .map(|(i, &c)| c.saturating_sub(was.get(i).copied().unwrap_or(0)))
            .collect();
        let bounds: Vec<Option<u64>> = h["le_us"]
            .as_array()
            .map(|a| a.iter().map(Value::as_u64).collect())
            .unwrap_or_default();
        let requests: u64 = diff.iter().sum();
        let quantile = |q: f64| -> Option<u64> {
            let want = ((requests as f64) * q).ceil().max(1.0) as u64;
            let mut seen = 0;
            for (i, &c) in diff.iter().enumerate() {
                seen += c;
                if seen >= want {
                    return bounds.get(i).copied().flatten();
                }
            }
            None
        };
        if requests > 0 {
            out.push(OpLatency {
                op: op.clone(),
                requests,
                p50_le_us: quantile(0.50),
                p99_le_us: quantile(0.99),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rates_ratios_and_percentiles_come_from_the_difference() {
        let hist = |counts: [u64; 3]| json!({"read": {"le_us": [100, 1000, null], "counts": counts, "count": 0, "sum_us": 0}});
        let before = json!({"reads": 100, "read_bytes": 0, "read_hits": 10, "read_misses": 0,
            "dirty_blocks": 0, "block_size_bytes": 4096, "writeback_bytes": 0,
            "latency": hist([5, 0, 0])});
        let now = json!({"reads": 300, "read_bytes": 8192000, "read_hits": 40, "read_misses": 10,
            "dirty_blocks": 1000, "cache_blocks": 4000, "block_size_bytes": 4096,
            "writeback_bytes": 4096000, "mode": "writeback",
            "latency": hist([103, 1, 1])});
        let v = View::between("c", &before, &now, Duration::from_secs(2));
        assert_eq!(v.read_iops, 100.0);
        assert_eq!(v.read_bytes_per_sec, 4096000.0);
        assert_eq!(v.hit_ratio, Some(30.0 / 40.0));
        assert_eq!(v.dirty_share(), 0.25);
        // 4,096,000 dirty bytes at 2,048,000 B/s.
        assert_eq!(v.time_to_clean, Some(Duration::from_secs(2)));
        assert_eq!(
            v.latencies,
            vec![OpLatency {
                op: "read".into(),
                requests: 100,
                p50_le_us: Some(100),
                p99_le_us: Some(1000)
            }]
        );
        let slow = json!({"latency": hist([103, 1, 96])});
        let v = View::between("c", &before, &slow, Duration::from_secs(1));
        assert_eq!(v.latencies[0].p99_le_us, None, "over the last bound");
        assert_eq!(v.latencies[0].p50_le_us, Some(100));
        assert_eq!(v.hit_ratio, None);
    }
}
