//! Medians, ratios, goals; Markdown, JSON and SVG output.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{json, Value};

use crate::systems::{self, Sys};
use crate::workloads::{Meas, W};

pub fn median(v: &[f64]) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Everything a report is made of.
pub struct Data {
    pub meas: Vec<Meas>,
    pub memory: Option<Value>,
    pub errors: Vec<String>,
    pub header: Value,
    pub systems: Vec<Sys>,
    pub workloads: Vec<W>,
}

pub type Medians = BTreeMap<(W, Sys), BTreeMap<String, f64>>;

impl Data {
    pub fn medians(&self) -> Medians {
        let mut all: BTreeMap<(W, Sys), BTreeMap<String, Vec<f64>>> = BTreeMap::new();
        for m in &self.meas {
            let e = all.entry((m.w, m.sys)).or_default();
            for (k, v) in &m.m {
                e.entry(k.clone()).or_default().push(*v);
            }
        }
        all.into_iter()
            .map(|(k, ms)| (k, ms.into_iter().map(|(n, v)| (n, median(&v))).collect()))
            .collect()
    }

    fn values(&self, w: W, sys: Sys, metric: &str) -> Vec<f64> {
        self.meas
            .iter()
            .filter(|m| m.w == w && m.sys == sys)
            .filter_map(|m| m.m.get(metric).copied())
            .collect()
    }
}

fn get(med: &Medians, w: W, s: Sys, k: &str) -> Option<f64> {
    med.get(&(w, s))
        .and_then(|m| m.get(k))
        .copied()
        .filter(|x| x.is_finite())
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

pub const PEERS: [Sys; 5] = [
    Sys::NbdkitFile,
    Sys::Origin,
    Sys::Raw,
    Sys::QemuNbd,
    Sys::NbdkitCache,
];

pub fn fmt_val(metric: &str, v: f64) -> String {
    if !v.is_finite() {
        return "–".into();
    }
    match metric {
        "iops" => {
            if v >= 10000.0 {
                format!("{:.1}k", v / 1000.0)
            } else {
                format!("{v:.0}")
            }
        }
        "mb_s" => format!("{v:.0}"),
        "seconds" => format!("{v:.2}"),
        _ => {
            if v.abs() >= 100.0 {
                format!("{v:.0}")
            } else if v.abs() >= 10.0 {
                format!("{v:.1}")
            } else {
                format!("{v:.2}")
            }
        }
    }
}

fn inflight(mm: &BTreeMap<String, f64>) -> String {
    match (mm.get("dev_inflight_reads"), mm.get("dev_inflight_writes")) {
        (Some(r), Some(w)) => format!("{r:.1} r / {w:.1} w"),
        _ => "–".into(),
    }
}

fn fmt_ratio(r: Option<f64>) -> String {
    match r {
        Some(r) if r >= 100.0 => format!("{r:.0}×"),
        Some(r) if r >= 10.0 => format!("{r:.1}×"),
        Some(r) => format!("{r:.2}×"),
        None => "–".into(),
    }
}

pub struct Goal {
    pub id: &'static str,
    pub text: String,
    pub measured: Option<f64>,
    pub shown: String,
    pub met: Option<bool>,
}

impl Goal {
    fn to_json(&self) -> Value {
        json!({"id": self.id, "goal": self.text, "measured": self.measured, "shown": self.shown, "met": self.met})
    }
}

fn push(
    g: &mut Vec<Goal>,
    id: &'static str,
    text: &str,
    measured: Option<f64>,
    ok: &dyn Fn(f64) -> bool,
    suffix: &str,
) {
    g.push(Goal {
        id,
        text: text.to_string(),
        measured,
        shown: measured
            .map(|v| format!("{}{suffix}", fmt_num(v)))
            .unwrap_or_else(|| "not measured".into()),
        met: measured.map(ok),
    });
}

pub fn goals(d: &Data, med: &Medians) -> Vec<Goal> {
    let mut g: Vec<Goal> = Vec::new();
    let c = |w, k: &str| get(med, w, Sys::Cairn, k);
    let p = |w, s, k: &str| get(med, w, s, k);
    push(
        &mut g,
        "1a",
        "W1 fsync'd 4K writes: IOPS cairn / nbdkit-file ≥ 0.90",
        ratio(c(W::Fsync, "iops"), p(W::Fsync, Sys::NbdkitFile, "iops")),
        &|r| r >= 0.90,
        "×",
    );
    push(
        &mut g,
        "1b",
        "W1 fsync'd 4K writes: IOPS cairn / origin alone ≥ 20",
        ratio(c(W::Fsync, "iops"), p(W::Fsync, Sys::Origin, "iops")),
        &|r| r >= 20.0,
        "×",
    );
    push(
        &mut g,
        "2a",
        "W2 ext4 untar: wall time cairn / nbdkit-file ≤ 1.15",
        ratio(
            c(W::Ext4, "seconds"),
            p(W::Ext4, Sys::NbdkitFile, "seconds"),
        ),
        &|r| r <= 1.15,
        "×",
    );
    push(
        &mut g,
        "2b",
        "W2 ext4 untar: far below the origin alone (we read it as time cairn / origin ≤ 0.25)",
        ratio(c(W::Ext4, "seconds"), p(W::Ext4, Sys::Origin, "seconds")),
        &|r| r <= 0.25,
        "×",
    );
    push(
        &mut g,
        "3a",
        "W3 64K seq writes: MB/s cairn / raw io_uring O_DIRECT ≥ 0.90",
        ratio(c(W::Seq, "mb_s"), p(W::Seq, Sys::Raw, "mb_s")),
        &|r| r >= 0.90,
        "×",
    );
    push(
        &mut g,
        "3b",
        "W3 64K seq writes: MB/s cairn / qemu-nbd ≥ 1.0",
        ratio(c(W::Seq, "mb_s"), p(W::Seq, Sys::QemuNbd, "mb_s")),
        &|r| r >= 1.0,
        "×",
    );
    push(&mut g, "3c", "W3 64K seq writes: MB/s cairn / nbdkit-file (reported, no goal; nbdkit writes into the page cache)", ratio(c(W::Seq, "mb_s"), p(W::Seq, Sys::NbdkitFile, "mb_s")), &|_| true, "×");
    // Issue 17: what TLS costs, cairn's and a peer's (reported, no goal).
    for (id, w, k, what) in [
        ("3t", W::Seq, "mb_s", "W3 64K seq writes through TLS: MB/s"),
        (
            "4t",
            W::RandRead,
            "iops",
            "W4 cached 4K random reads QD32 through TLS: IOPS",
        ),
    ] {
        push(
            &mut g,
            id,
            &format!("{what} cairn-tls / cairn (reported)"),
            ratio(p(w, Sys::CairnTls, k), c(w, k)),
            &|_| true,
            "×",
        );
        push(
            &mut g,
            id,
            &format!("{what} nbdkit-file-tls / nbdkit-file (the peer's cost, reported)"),
            ratio(p(w, Sys::NbdkitFileTls, k), p(w, Sys::NbdkitFile, k)),
            &|_| true,
            "×",
        );
        push(
            &mut g,
            id,
            &format!("{what} cairn-tls / nbdkit-file-tls (reported)"),
            ratio(p(w, Sys::CairnTls, k), p(w, Sys::NbdkitFileTls, k)),
            &|_| true,
            "×",
        );
    }
    g.last_mut().unwrap().met = None;
    let rb = d.values(W::Seq, Sys::Cairn, "daemon_read_bytes");
    let rb_max = if rb.is_empty() {
        None
    } else {
        Some(rb.iter().cloned().fold(0.0, f64::max))
    };
    g.push(Goal {
        id: "3d",
        text: "W3: bytes read from the cache device by the daemon = 0 (/proc/PID/io read_bytes, worst round)".into(),
        measured: rb_max,
        shown: rb_max.map(|v| format!("{} bytes ({:.1} MiB)", v as u64, v / 1048576.0)).unwrap_or_else(|| "not measured".into()),
        met: rb_max.map(|v| v == 0.0),
    });
    push(&mut g, "3e", "W3: cache-device bytes written per client byte ≤ 1.05 (cairn status cache_bytes_written / fio bytes)", c(W::Seq, "cache_write_amp"), &|r| r <= 1.05, "");
    let best_read = match (
        p(W::RandRead, Sys::NbdkitFile, "iops"),
        p(W::RandRead, Sys::QemuNbd, "iops"),
    ) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    push(&mut g, "3f", "W3s (added stress, no goal): sustained 64K writes looping over a region that fits the cache, MB/s cairn / raw", ratio(c(W::SeqSustained, "mb_s"), p(W::SeqSustained, Sys::Raw, "mb_s")), &|_| true, "×");
    g.last_mut().unwrap().met = None;
    push(
        &mut g,
        "4a",
        "W4 cached 4K random reads QD32: IOPS cairn / best of (nbdkit-file, qemu-nbd) ≥ 1.0",
        ratio(c(W::RandRead, "iops"), best_read),
        &|r| r >= 1.0,
        "×",
    );
    push(
        &mut g,
        "4b",
        "W4: IOPS cairn / raw io_uring ≥ 0.8",
        ratio(c(W::RandRead, "iops"), p(W::RandRead, Sys::Raw, "iops")),
        &|r| r >= 0.8,
        "×",
    );
    let best_cpu = [Sys::NbdkitFile, Sys::QemuNbd, Sys::NbdkitCache]
        .iter()
        .filter_map(|s| p(W::RandRead, *s, "cpu_us_per_io"))
        .fold(None, |acc: Option<f64>, v| {
            Some(acc.map_or(v, |a| a.min(v)))
        });
    push(
        &mut g,
        "4c",
        "W4: CPU per I/O (fio + daemon, usr+sys) cairn / best NBD peer ≤ 1.0",
        ratio(c(W::RandRead, "cpu_us_per_io"), best_cpu),
        &|r| r <= 1.0,
        "×",
    );
    let mem = d.memory.as_ref();
    let gib = mem
        .and_then(|m| m["cache_gib"].as_f64())
        .unwrap_or(f64::NAN);
    push(
        &mut g,
        "5a",
        &format!(
            "W5: RSS per GiB of cache, cache full of 4 KiB blocks ({gib} GiB cache) ≤ 8 MiB/GiB"
        ),
        mem.and_then(|m| m["rss_mib_per_gib"].as_f64()),
        &|v| v <= 8.0,
        " MiB/GiB",
    );
    push(
        &mut g,
        "5b",
        "W5: reopen after kill -9 with that cache full ≤ 2 s (worst round)",
        mem.and_then(|m| m["reopen_s_max"].as_f64()),
        &|v| v <= 2.0,
        " s",
    );

    // Issue 14.
    let cd = |w, k: &str| get(med, w, Sys::CairnDirect, k);
    push(
        &mut g,
        "4d",
        "W4d cached 4K random reads QD32, cairn --no-page-cache-reads: IOPS cairn-direct / raw io_uring O_DIRECT ≥ 0.9",
        ratio(
            cd(W::RandReadDirect, "iops"),
            p(W::RandReadDirect, Sys::Raw, "iops"),
        ),
        &|r| r >= 0.9,
        "×",
    );
    push(
        &mut g,
        "4e",
        "W4d: IOPS cairn-direct / qemu-nbd ≥ 1.5",
        ratio(
            cd(W::RandReadDirect, "iops"),
            p(W::RandReadDirect, Sys::QemuNbd, "iops"),
        ),
        &|r| r >= 1.5,
        "×",
    );
    push(
        &mut g,
        "4f",
        "W4d: daemon CPU per I/O (usr+sys, /proc/PID/stat) cairn-direct / qemu-nbd ≤ 1.0",
        ratio(
            cd(W::RandReadDirect, "daemon_cpu_us_per_io"),
            p(W::RandReadDirect, Sys::QemuNbd, "daemon_cpu_us_per_io"),
        ),
        &|r| r <= 1.0,
        "×",
    );
    push(
        &mut g,
        "6a",
        "W6 cold 4K random reads QD32 (every read a miss; origin nbdkit -t 64): IOPS cairn / origin alone ≥ 0.95",
        ratio(c(W::ColdRead, "iops"), p(W::ColdRead, Sys::Origin, "iops")),
        &|r| r >= 0.95,
        "×",
    );
    push(
        &mut g,
        "6b",
        "W6q1 the same at QD1: mean latency cairn / origin alone ≤ 1.1",
        ratio(
            c(W::ColdReadQd1, "lat_mean_us"),
            p(W::ColdReadQd1, Sys::Origin, "lat_mean_us"),
        ),
        &|r| r <= 1.1,
        "×",
    );
    push(
        &mut g,
        "7a",
        "W7 4 clients, fsync'd 4K random writes QD1 each: IOPS cairn / nbdkit-file ≥ 1.0",
        ratio(
            c(W::MultiFsync, "iops"),
            p(W::MultiFsync, Sys::NbdkitFile, "iops"),
        ),
        &|r| r >= 1.0,
        "×",
    );
    let fpb = c(W::MultiFsync, "flushes_per_barrier");
    g.push(Goal {
        id: "7b",
        text: "W7 (reported, no goal): cairn's client flushes per flush barrier, Δflushes / Δflush_barriers of `cairn status --json`, and its group_commit_joins".into(),
        measured: fpb,
        shown: fpb
            .map(|v| {
                format!(
                    "{} flushes/barrier ({} joins)",
                    fmt_num(v),
                    c(W::MultiFsync, "cairn_group_commit_joins")
                        .map(fmt_num)
                        .unwrap_or("–".into())
                )
            })
            .unwrap_or_else(|| "not measured".into()),
        met: None,
    });
    push(
        &mut g,
        "7r",
        "W7r 4 clients, cached 4K random reads QD8 each: IOPS cairn / nbdkit-file ≥ 1.0",
        ratio(
            c(W::MultiRead, "iops"),
            p(W::MultiRead, Sys::NbdkitFile, "iops"),
        ),
        &|r| r >= 1.0,
        "×",
    );
    push(
        &mut g,
        "8a",
        "W8: cairn's QD1 4K reader, p99 with 4 fsync'd 4K writers beside it / its p99 alone (same fresh system, median of rounds) ≤ 2",
        c(W::ReadUnderWrites, "p99_ratio"),
        &|r| r <= 2.0,
        "×",
    );
    push(
        &mut g,
        "8b",
        "W8 (reference, no goal): the same ratio for nbdkit-file",
        p(W::ReadUnderWrites, Sys::NbdkitFile, "p99_ratio"),
        &|_| true,
        "×",
    );
    g.last_mut().unwrap().met = None;
    g
}

/// The goals of issue 14 that compare two systems' medians: (goal, workload,
/// metric, numerator system, denominator system), for the per-round table.
const ROUND_RATIOS: [(&str, W, &str, Sys, Sys); 7] = [
    ("4d", W::RandReadDirect, "iops", Sys::CairnDirect, Sys::Raw),
    (
        "4e",
        W::RandReadDirect,
        "iops",
        Sys::CairnDirect,
        Sys::QemuNbd,
    ),
    (
        "4f",
        W::RandReadDirect,
        "daemon_cpu_us_per_io",
        Sys::CairnDirect,
        Sys::QemuNbd,
    ),
    ("6a", W::ColdRead, "iops", Sys::Cairn, Sys::Origin),
    ("6b", W::ColdReadQd1, "lat_mean_us", Sys::Cairn, Sys::Origin),
    ("7a", W::MultiFsync, "iops", Sys::Cairn, Sys::NbdkitFile),
    ("7r", W::MultiRead, "iops", Sys::Cairn, Sys::NbdkitFile),
];

pub fn short(id: &str) -> &'static str {
    match id {
        "1a" => "W1 IOPS ÷ nbdkit-file ≥ 0.90",
        "1b" => "W1 IOPS ÷ origin ≥ 20",
        "2a" => "W2 time ÷ nbdkit-file ≤ 1.15",
        "2b" => "W2 time ÷ origin ≤ 0.25",
        "3a" => "W3 MB/s ÷ raw ≥ 0.90",
        "3b" => "W3 MB/s ÷ qemu-nbd ≥ 1.0",
        "3c" => "W3 MB/s ÷ nbdkit-file (info)",
        "3d" => "W3 cache-device reads = 0",
        "3e" => "W3 cache bytes per client byte ≤ 1.05",
        "3f" => "W3s sustained MB/s ÷ raw (info)",
        "4a" => "W4 IOPS ÷ best of nbdkit-file, qemu ≥ 1.0",
        "4b" => "W4 IOPS ÷ raw ≥ 0.8",
        "4c" => "W4 CPU/IO ÷ best NBD peer ≤ 1.0",
        "5a" => "W5 RSS per GiB of cache ≤ 8 MiB",
        "5b" => "W5 reopen after kill -9 ≤ 2 s",
        "4d" => "W4d IOPS cairn-direct ÷ raw ≥ 0.9",
        "4e" => "W4d IOPS cairn-direct ÷ qemu ≥ 1.5",
        "4f" => "W4d daemon CPU/IO ÷ qemu ≤ 1.0",
        "6a" => "W6 cold IOPS ÷ origin ≥ 0.95",
        "6b" => "W6q1 mean latency ÷ origin ≤ 1.1",
        "7a" => "W7 4-client fsync IOPS ÷ nbdkit-file ≥ 1.0",
        "7b" => "W7 flushes per barrier (info)",
        "7r" => "W7r 4-client read IOPS ÷ nbdkit-file ≥ 1.0",
        "8a" => "W8 reader p99 loaded ÷ alone ≤ 2",
        "8b" => "W8 nbdkit-file p99 loaded ÷ alone (info)",
        _ => "",
    }
}

fn fmt_num(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else if v.abs() >= 0.01 || v == 0.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.4}")
    }
}

fn met_str(m: Option<bool>) -> &'static str {
    match m {
        Some(true) => "**met**",
        Some(false) => "**not met**",
        None => "–",
    }
}

pub fn markdown(d: &Data, med: &Medians, goals: &[Goal]) -> String {
    let h = &d.header;
    let mut s = String::new();
    let _ = writeln!(s, "# cairn benchmark results\n");
    let _ = writeln!(s, "- date: {}", h["date"].as_str().unwrap_or("?"));
    let _ = writeln!(s, "- command: `{}`", h["command"].as_str().unwrap_or("?"));
    let _ = writeln!(s, "- mode: {}; {} round(s), {} s per fio measurement, systems interleaved (order rotated each round); medians", h["mode"].as_str().unwrap_or("?"), h["config"]["rounds"], h["config"]["runtime_s"]);
    let m = &h["machine"];
    let _ = writeln!(
        s,
        "- machine: {} CPUs ({}), {} GiB RAM, kernel {}; scratch on {}",
        m["nproc"],
        m["cpu_model"].as_str().unwrap_or("?"),
        m["mem_gib"],
        m["kernel"].as_str().unwrap_or("?"),
        m["scratch_fs"].as_str().unwrap_or("?")
    );
    let _ = writeln!(s, "- load average (1/5/15 min) at start: {}; at end: {} (other work on the machine shares these 2 cores)", h["load_start"], h["load_end"]);
    let _ = writeln!(
        s,
        "- cairn {}; fio {}; nbdkit {}; qemu-nbd {}",
        h["cairn_commit"].as_str().unwrap_or("?"),
        m["fio"].as_str().unwrap_or("?"),
        m["nbdkit"].as_str().unwrap_or("?"),
        m["qemu_nbd"].as_str().unwrap_or("?")
    );
    let _ = writeln!(
        s,
        "- slow origin: {} ms per read and per write (nbdkit delay filter; flush not delayed)\n",
        h["config"]["delay_ms"]
    );

    // Headline table.
    let _ = writeln!(s, "## Headline: medians, and cairn's ratio to each peer\n");
    let _ = writeln!(s, "For W2 the figure is a wall time, and for W6q1 and W8 a latency, so a ratio below 1 means cairn is faster; elsewhere above 1 means cairn is faster. For W4d the ratios are cairn-direct's (cairn serving with `--no-page-cache-reads`).\n");
    let mut hdr = String::from("| workload | unit |");
    let mut sep = String::from("|---|---|");
    for sys in &d.systems {
        let _ = write!(hdr, " {} |", sys.name());
        sep.push_str("---:|");
    }
    for p in PEERS {
        if d.systems.contains(&p) && d.systems.contains(&Sys::Cairn) {
            let _ = write!(hdr, " cairn / {} |", p.name());
            sep.push_str("---:|");
        }
    }
    let _ = writeln!(s, "{hdr}\n{sep}");
    for w in &d.workloads {
        if *w == W::Memory {
            continue;
        }
        let (k, unit, _) = w.headline();
        let _ = write!(s, "| {} | {unit} |", w.name());
        for sys in &d.systems {
            let _ = write!(
                s,
                " {} |",
                get(med, *w, *sys, k)
                    .map(|v| fmt_val(k, v))
                    .unwrap_or("–".into())
            );
        }
        for p in PEERS {
            if d.systems.contains(&p) && d.systems.contains(&Sys::Cairn) {
                let _ = write!(
                    s,
                    " {} |",
                    fmt_ratio(ratio(get(med, *w, w.subject(), k), get(med, *w, p, k)))
                );
            }
        }
        s.push('\n');
    }
    if let Some(mm) = &d.memory {
        let _ = writeln!(
            s,
            "| {} | MiB RSS per GiB of cache | {} | (cairn only) |",
            W::Memory.name(),
            fmt_num(mm["rss_mib_per_gib"].as_f64().unwrap_or(f64::NAN))
        );
    }

    // Goals.
    let _ = writeln!(s, "\n## Goals of issue 8 (1a–5b) and issue 14 (4d–8b)\n");
    let _ = writeln!(s, "| # | goal | measured | verdict |\n|---|---|---:|---|");
    for g in goals {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} |",
            g.id,
            g.text,
            g.shown,
            met_str(g.met)
        );
    }

    // CPU, RSS, latency.
    let _ = writeln!(
        s,
        "\n## CPU per I/O, latency and daemon peak RSS (medians)\n"
    );
    let _ = writeln!(s, "CPU is usr+sys: fio's own (client) from its JSON, the daemon's from /proc/PID/stat (all threads, 10 ms ticks) over the fio run. Peak RSS is VmHWM of the daemon, started fresh for each measurement (the origin daemon is shared by the whole run). Device in flight: reads/writes in flight on the scratch disk (/sys/dev/block/M:m/inflight, sampled every 2 ms; includes other users of the disk); busy = share of samples with any I/O in flight.\n");
    let _ = writeln!(s, "| workload | system | headline | CPU µs/IO fio | CPU µs/IO daemon | CPU µs/IO total | lat mean µs | lat p99 µs | flush lat mean µs | device in flight (mean) | device busy % | daemon peak RSS MiB | load1 |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for w in &d.workloads {
        if *w == W::Memory || *w == W::Ext4 {
            continue;
        }
        let (k, unit, _) = w.headline();
        for sys in &d.systems {
            let Some(mm) = med.get(&(*w, *sys)) else {
                continue;
            };
            let f = |n: &str| mm.get(n).map(|v| fmt_num(*v)).unwrap_or("–".into());
            let _ = writeln!(
                s,
                "| {} | {} | {} {unit} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                w.id(),
                sys.name(),
                mm.get(k).map(|v| fmt_val(k, *v)).unwrap_or("–".into()),
                f("client_cpu_us_per_io"),
                f("daemon_cpu_us_per_io"),
                f("cpu_us_per_io"),
                f("lat_mean_us"),
                f("lat_p99_us"),
                f("sync_lat_mean_us"),
                inflight(mm),
                f("dev_busy_pct"),
                f("daemon_peak_rss_mib"),
                f("load1")
            );
        }
    }
    let w3_rows: Vec<(W, Sys)> = [W::Seq, W::SeqSustained]
        .iter()
        .flat_map(|w| d.systems.iter().map(move |s| (*w, *s)))
        .filter(|k| med.contains_key(k))
        .collect();
    if !w3_rows.is_empty() {
        let _ = writeln!(s, "\n### W3 write path: CPU per MB written (medians)\n");
        let _ = writeln!(s, "Daemon CPU (usr+sys, /proc/PID/stat, all threads) over the fio run, in µs per decimal MB the client wrote; total adds fio's own CPU. raw has no daemon.\n");
        let _ = writeln!(s, "| workload | system | MB/s | daemon CPU µs/MB | total CPU µs/MB | daemon CPU s |\n|---|---|---:|---:|---:|---:|");
        for (w, sys) in w3_rows {
            let mm = &med[&(w, sys)];
            let f = |n: &str| mm.get(n).map(|v| fmt_num(*v)).unwrap_or("–".into());
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} |",
                w.id(),
                sys.name(),
                mm.get("mb_s")
                    .map(|v| fmt_val("mb_s", *v))
                    .unwrap_or("–".into()),
                f("daemon_cpu_us_per_mb"),
                f("cpu_us_per_mb"),
                f("daemon_cpu_s")
            );
        }
    }
    issue14_details(&mut s, d, med);
    if d.workloads.contains(&W::Ext4) {
        let _ = writeln!(s, "\n### W2 ext4 details (medians)\n");
        let _ = writeln!(s, "| system | untar s | mkfs s | umount s | daemon CPU s during untar | daemon peak RSS MiB | rounds |\n|---|---:|---:|---:|---:|---:|---:|");
        for sys in &d.systems {
            let Some(mm) = med.get(&(W::Ext4, *sys)) else {
                continue;
            };
            let f = |n: &str| mm.get(n).map(|v| fmt_num(*v)).unwrap_or("–".into());
            let n = d
                .meas
                .iter()
                .filter(|m| m.w == W::Ext4 && m.sys == *sys)
                .count();
            let to = if mm.contains_key("timed_out") {
                " (timed out: lower bound)"
            } else {
                ""
            };
            let _ = writeln!(
                s,
                "| {} | {}{to} | {} | {} | {} | {} | {n} |",
                sys.name(),
                f("seconds"),
                f("mkfs_s"),
                f("umount_s"),
                f("daemon_cpu_s"),
                f("daemon_peak_rss_mib")
            );
        }
        if let Some(mm) = med.get(&(W::Ext4, Sys::Cairn)) {
            if let (Some(wr), Some(fl), Some(secs)) = (
                mm.get("cairn_writes"),
                mm.get("cairn_flushes"),
                mm.get("seconds"),
            ) {
                let g = |k: &str| mm.get(k).copied().unwrap_or(f64::NAN);
                let _ = writeln!(
                    s,
                    "\ncairn during the untar (medians): {:.0} NBD writes ({:.1} MiB), {:.0} flushes ({:.0}/s, {:.0} µs of wall time per flush), {:.0} FUA writes, {:.0} cache barriers, {:.1} MiB written to the cache device ({:.2} per client byte), {:.0} records sealed.",
                    wr,
                    g("cairn_write_bytes") / 1048576.0,
                    fl,
                    fl / secs,
                    secs * 1e6 / fl.max(1.0),
                    g("cairn_fua_writes"),
                    g("cairn_cache_barriers"),
                    g("cairn_cache_bytes_written") / 1048576.0,
                    g("cairn_cache_bytes_written") / g("cairn_write_bytes").max(1.0),
                    g("cairn_records_sealed")
                );
            }
        }
    }

    // cairn internals.
    let cairn_rows: Vec<(W, Sys)> = d
        .workloads
        .iter()
        .flat_map(|w| {
            [
                (*w, Sys::Cairn),
                (*w, Sys::CairnNoWb),
                (*w, Sys::CairnDirect),
            ]
        })
        .filter(|k| med.contains_key(k) && k.0 != W::Ext4)
        .collect();
    if !cairn_rows.is_empty() {
        let _ = writeln!(
            s,
            "\n## cairn counters during the fio run (medians of deltas)\n"
        );
        let _ = writeln!(s, "read_bytes and write_bytes are the daemon's /proc/PID/io (all its I/O to the cache file; the origin is a socket); the rest come from `cairn status --json` before and after the run.\n");
        let _ = writeln!(s, "| workload | system | daemon read_bytes | daemon write_bytes | cache_bytes_written | per client byte | cache barriers | flushes | internal flushes | records sealed | write-back bytes | stalls | hit ratio |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for (w, sys) in cairn_rows {
            let mm = &med[&(w, sys)];
            let f = |n: &str| mm.get(n).map(|v| fmt_num(*v)).unwrap_or("–".into());
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                w.id(),
                sys.name(),
                f("daemon_read_bytes"),
                f("daemon_write_bytes"),
                f("cairn_cache_bytes_written"),
                f("cache_write_amp"),
                f("cairn_cache_barriers"),
                f("cairn_flushes"),
                f("cairn_internal_flushes"),
                f("cairn_records_sealed"),
                f("cairn_writeback_bytes"),
                f("cairn_writeback_stalls"),
                f("hit_ratio")
            );
        }
    }

    if let Some(mm) = &d.memory {
        let _ = writeln!(s, "\n## W5 memory and recovery (cairn)\n");
        let f = |n: &str| mm[n].as_f64().map(fmt_num).unwrap_or("–".into());
        let _ = writeln!(s, "- cache: {} GiB file, {} blocks of 4 KiB; filled with {} scattered 4 KiB blocks by random 4 KiB writes, QD32, over twice that span ({} of the blocks; fill ran at {} IOPS), then one flush; started with --no-writeback so all of them stay dirty", f("cache_gib"), mm["cache_blocks"], mm["filled_blocks"], f("fill_fraction"), f("fill_iops"));
        let _ = writeln!(s, "- RSS: {} MiB empty, {} MiB full (peak {} MiB); index_memory_bytes {} → **{} MiB RSS per GiB of cache** (growth from empty: {} MiB/GiB; peak {} MiB/GiB; peak after a recovery {} MiB/GiB)", f("rss_empty_mib"), f("rss_full_mib"), f("peak_rss_full_mib"), mm["index_memory_bytes"], f("rss_mib_per_gib"), f("rss_growth_mib_per_gib"), f("peak_rss_mib_per_gib"), f("peak_rss_after_recovery_mib_per_gib"));
        let _ = writeln!(s, "- reopen after kill -9 (spawn of `cairn serve` until its socket accepts): {:?} s; worst {} s (first open after format: {} s)", mm["reopen_s"].as_array().map(|a| a.iter().map(|x| (x.as_f64().unwrap_or(0.0) * 1000.0).round() / 1000.0).collect::<Vec<_>>()).unwrap_or_default(), f("reopen_s_max"), f("first_open_s"));
        if let Some(rs) = mm["recoveries"].as_array() {
            for (i, r) in rs.iter().enumerate() {
                let _ = writeln!(s, "  - recovery {}: {:.3} s, dirty blocks {} → {}, read {:.0} MiB from the cache device, RSS {:.1} MiB (peak {:.1})", i + 1, r["reopen_s"].as_f64().unwrap_or(0.0), r["dirty_blocks_before"], r["dirty_blocks_after"], r["recovery_read_bytes"].as_f64().unwrap_or(0.0) / 1048576.0, r["rss_mib"].as_f64().unwrap_or(0.0), r["peak_rss_mib"].as_f64().unwrap_or(0.0));
            }
        }
    }

    // Spread across rounds.
    round_ratios(&mut s, d);
    let _ = writeln!(s, "\n## Every round (headline metric, in run order)\n");
    let _ = writeln!(
        s,
        "| workload | system | rounds | min | max |\n|---|---|---|---:|---:|"
    );
    for w in &d.workloads {
        let (k, _, _) = w.headline();
        for sys in &d.systems {
            let v = d.values(*w, *sys, k);
            if v.is_empty() {
                continue;
            }
            let lo = v.iter().cloned().fold(f64::INFINITY, f64::min);
            let hi = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let all: Vec<String> = v.iter().map(|x| fmt_val(k, *x)).collect();
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} |",
                w.id(),
                sys.name(),
                all.join(", "),
                fmt_val(k, lo),
                fmt_val(k, hi)
            );
        }
    }

    if !d.errors.is_empty() {
        let _ = writeln!(s, "\n## Errors\n");
        for e in &d.errors {
            let _ = writeln!(s, "- {}", e.replace('\n', " "));
        }
    }

    let _ = writeln!(s, "\n## Systems and workloads\n");
    for sys in &d.systems {
        let _ = writeln!(s, "- **{}**: {}", sys.name(), sys.describe());
    }
    if let Some(cmds) = h["fio_commands"].as_object() {
        let _ = writeln!(s);
        for (k, v) in cmds {
            let _ = writeln!(s, "- {k}: `{}`", v.as_str().unwrap_or(""));
        }
    }
    if let Some(n) = h["notes"].as_array() {
        for x in n {
            let _ = writeln!(s, "- {}", x.as_str().unwrap_or(""));
        }
    }
    s
}

/// Medians and rounds of the issue-14 workloads' own figures: W6 latency
/// and hit ratio, W7's group commit, W8's reader alone and under load.
fn issue14_details(s: &mut String, d: &Data, med: &Medians) {
    let rows = |ws: &[W]| -> Vec<(W, Sys)> {
        ws.iter()
            .flat_map(|w| d.systems.iter().map(move |s| (*w, *s)))
            .filter(|k| med.contains_key(k))
            .collect()
    };
    let w6 = rows(&[W::ColdRead, W::ColdReadQd1]);
    if !w6.is_empty() {
        let _ = writeln!(s, "\n### W6 cold reads (medians)\n");
        let _ = writeln!(s, "Every read should miss: cairn is freshly formatted over the 64-thread origin before each measurement; the hit ratio is cairn's read_hits / (read_hits + read_misses) over the run.\n");
        let _ = writeln!(s, "| workload | system | IOPS | lat mean µs | lat p99 µs | cairn hit ratio | daemon CPU µs/IO |\n|---|---|---:|---:|---:|---:|---:|");
        for (w, sys) in w6 {
            let mm = &med[&(w, sys)];
            let f = |n: &str| mm.get(n).map(|v| fmt_num(*v)).unwrap_or("–".into());
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} |",
                w.id(),
                sys.name(),
                mm.get("iops")
                    .map(|v| fmt_val("iops", *v))
                    .unwrap_or("–".into()),
                f("lat_mean_us"),
                f("lat_p99_us"),
                f("hit_ratio"),
                f("daemon_cpu_us_per_io")
            );
        }
    }
    let w7 = rows(&[W::MultiFsync, W::MultiRead]);
    if !w7.is_empty() {
        let _ = writeln!(s, "\n### W7 / W7r: 4 clients (medians)\n");
        let _ = writeln!(s, "Flushes per barrier = Δflushes / Δflush_barriers from `cairn status --json` over the run: how many clients' flushes one fdatasync of cairn's log answered (1.0 = no group commit). group_commit_joins: flushes that waited on another's barrier.\n");
        let _ = writeln!(s, "| workload | system | IOPS | lat mean µs | lat p99 µs | flush lat mean µs | CPU µs/IO total | daemon CPU µs/IO | flushes | flush barriers | flushes per barrier | group_commit_joins |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for (w, sys) in w7 {
            let mm = &med[&(w, sys)];
            let f = |n: &str| mm.get(n).map(|v| fmt_num(*v)).unwrap_or("–".into());
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                w.id(),
                sys.name(),
                mm.get("iops")
                    .map(|v| fmt_val("iops", *v))
                    .unwrap_or("–".into()),
                f("lat_mean_us"),
                f("lat_p99_us"),
                f("sync_lat_mean_us"),
                f("cpu_us_per_io"),
                f("daemon_cpu_us_per_io"),
                f("cairn_flushes"),
                f("cairn_flush_barriers"),
                f("flushes_per_barrier"),
                f("cairn_group_commit_joins")
            );
        }
        let per_round = d.values(W::MultiFsync, Sys::Cairn, "flushes_per_barrier");
        if !per_round.is_empty() {
            let _ = writeln!(
                s,
                "\nW7 cairn flushes per barrier, every round: {}",
                per_round
                    .iter()
                    .map(|v| fmt_num(*v))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    if d.workloads.contains(&W::ReadUnderWrites) {
        let ms: Vec<&Meas> = d
            .meas
            .iter()
            .filter(|m| m.w == W::ReadUnderWrites)
            .collect();
        if !ms.is_empty() {
            let _ = writeln!(
                s,
                "\n### W8 reader p99 alone and under 4 fsync'd writers (every round)\n"
            );
            let _ = writeln!(s, "One freshly started system per row: prewarm, the QD1 4 KiB reader alone, then the same reader with 4 fsync'd 4 KiB writers (QD1 each) in one fio run; the reader's completion-latency p99 of each run.\n");
            let _ = writeln!(s, "| system | round | p99 alone µs | p99 under load µs | ratio | mean alone µs | mean under load µs | reader IOPS alone | reader IOPS under load | writers IOPS | writers flush lat mean µs | daemon read_bytes alone / under load |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
            for sys in &d.systems {
                for m in ms.iter().filter(|m| m.sys == *sys) {
                    let f = |n: &str| m.m.get(n).map(|v| fmt_num(*v)).unwrap_or("–".into());
                    let _ = writeln!(
                        s,
                        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} |",
                        sys.name(),
                        m.round + 1,
                        f("alone_lat_p99_us"),
                        f("lat_p99_us"),
                        m.m.get("p99_ratio")
                            .map(|v| fmt_ratio(Some(*v)))
                            .unwrap_or("–".into()),
                        f("alone_lat_mean_us"),
                        f("lat_mean_us"),
                        f("alone_iops"),
                        f("iops"),
                        f("writer_iops"),
                        f("sync_lat_mean_us"),
                        f("alone_daemon_read_bytes"),
                        f("daemon_read_bytes")
                    );
                }
                if let Some(mm) = med.get(&(W::ReadUnderWrites, *sys)) {
                    let f = |n: &str| mm.get(n).map(|v| fmt_num(*v)).unwrap_or("–".into());
                    let _ = writeln!(
                        s,
                        "| {} | **median** | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} |",
                        sys.name(),
                        f("alone_lat_p99_us"),
                        f("lat_p99_us"),
                        mm.get("p99_ratio")
                            .map(|v| fmt_ratio(Some(*v)))
                            .unwrap_or("–".into()),
                        f("alone_lat_mean_us"),
                        f("lat_mean_us"),
                        f("alone_iops"),
                        f("iops"),
                        f("writer_iops"),
                        f("sync_lat_mean_us"),
                        f("alone_daemon_read_bytes"),
                        f("daemon_read_bytes")
                    );
                }
            }
        }
    }
}

/// Each issue-14 ratio goal round by round: round i of one system against
/// round i of the other (the systems are interleaved within a round).
fn round_ratios(s: &mut String, d: &Data) {
    let mut lines = Vec::new();
    for (id, w, k, a, b) in ROUND_RATIOS {
        let va: Vec<(usize, f64)> = d
            .meas
            .iter()
            .filter(|m| m.w == w && m.sys == a)
            .filter_map(|m| m.m.get(k).map(|v| (m.round, *v)))
            .collect();
        let rs: Vec<f64> = va
            .iter()
            .filter_map(|(r, x)| {
                let y = d
                    .meas
                    .iter()
                    .find(|m| m.w == w && m.sys == b && m.round == *r)
                    .and_then(|m| m.m.get(k).copied());
                ratio(Some(*x), y)
            })
            .collect();
        if rs.is_empty() {
            continue;
        }
        let lo = rs.iter().cloned().fold(f64::INFINITY, f64::min);
        let hi = rs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        lines.push(format!(
            "| {id} | {} {k}: {} / {} | {} | {} | {} | {} |",
            w.id(),
            a.name(),
            b.name(),
            rs.iter()
                .map(|r| fmt_ratio(Some(*r)))
                .collect::<Vec<_>>()
                .join(", "),
            fmt_ratio(Some(lo)),
            fmt_ratio(Some(hi)),
            fmt_ratio(Some(median(&rs)))
        ));
    }
    for (id, sys) in [("8a", Sys::Cairn), ("8b", Sys::NbdkitFile)] {
        let rs = d.values(W::ReadUnderWrites, sys, "p99_ratio");
        if rs.is_empty() {
            continue;
        }
        let lo = rs.iter().cloned().fold(f64::INFINITY, f64::min);
        let hi = rs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        lines.push(format!(
            "| {id} | w8 {} reader p99: under load / alone | {} | {} | {} | {} |",
            sys.name(),
            rs.iter()
                .map(|r| fmt_ratio(Some(*r)))
                .collect::<Vec<_>>()
                .join(", "),
            fmt_ratio(Some(lo)),
            fmt_ratio(Some(hi)),
            fmt_ratio(Some(median(&rs)))
        ));
    }
    if lines.is_empty() {
        return;
    }
    let _ = writeln!(s, "\n## Issue 14 goals round by round\n");
    let _ = writeln!(s, "Each round's ratio of the two systems' figures in that round (the goals above use the ratio of the medians; 8a/8b are per-round ratios already).\n");
    let _ = writeln!(
        s,
        "| # | ratio | every round | min | max | median |\n|---|---|---|---:|---:|---:|"
    );
    for l in lines {
        let _ = writeln!(s, "{l}");
    }
}

pub fn to_json(d: &Data, med: &Medians, goals: &[Goal]) -> Value {
    let mut meds = serde_json::Map::new();
    for ((w, sys), m) in med {
        let e = meds.entry(w.name()).or_insert_with(|| json!({}));
        e[sys.name()] = json!(m);
    }
    let mut ratios = serde_json::Map::new();
    for w in &d.workloads {
        if *w == W::Memory {
            continue;
        }
        let (k, _, _) = w.headline();
        let mut r = serde_json::Map::new();
        for p in PEERS {
            r.insert(
                format!("{}/{}", w.subject().name(), p.name()),
                json!(ratio(get(med, *w, w.subject(), k), get(med, *w, p, k))),
            );
        }
        ratios.insert(w.name().to_string(), json!({"metric": k, "ratios": r}));
    }
    json!({
        "header": d.header,
        "medians": meds,
        "ratios": ratios,
        "goals": goals.iter().map(Goal::to_json).collect::<Vec<_>>(),
        "memory": d.memory,
        "measurements": d.meas.iter().map(Meas::to_json).collect::<Vec<_>>(),
        "errors": d.errors,
        "systems": systems::ALL.iter().map(|s| json!({"name": s.name(), "what": s.describe()})).collect::<Vec<_>>(),
    })
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A grid of horizontal bar charts, two to a row (W1–W4, W3s, then the
/// issue-14 workloads that ran), cairn highlighted, the goals below, and a
/// footer with W5 and the goal tally.
pub fn svg(d: &Data, med: &Medians, goals: &[Goal]) -> String {
    let (pw, ph) = (470.0, 250.0);
    // W1-W4 and W3s always (as before), then the issue-14 workloads run.
    let first = [W::Fsync, W::Ext4, W::Seq, W::RandRead, W::SeqSustained];
    let mut panels = first.to_vec();
    panels.extend(
        crate::workloads::ALL
            .iter()
            .copied()
            .filter(|w| !first.contains(w) && *w != W::Memory && d.workloads.contains(w)),
    );
    // Panels two to a row; then the goals across the width, two columns.
    let grid_rows = panels.len().div_ceil(2) as f64;
    let goal_lines = goals.len().div_ceil(2) as f64;
    let gh = 40.0 + goal_lines * 13.5;
    let gy = 40.0 + grid_rows * (ph + 10.0);
    let fy = gy + gh + 26.0;
    let (w_total, h_total) = (2.0 * pw + 30.0, fy + 60.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w_total}" height="{h_total}" viewBox="0 0 {w_total} {h_total}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r##"<rect width="100%" height="100%" fill="#ffffff"/>"##);
    let title = format!(
        "cairn vs peers — {} — medians of {} round(s)",
        d.header["date"].as_str().unwrap_or(""),
        d.header["config"]["rounds"]
    );
    let _ = writeln!(
        s,
        r#"<text x="15" y="24" font-size="16" font-weight="bold">{}</text>"#,
        esc(&title)
    );
    for (i, w) in panels.iter().enumerate() {
        let x0 = 15.0 + (i % 2) as f64 * (pw + 10.0);
        let y0 = 40.0 + (i / 2) as f64 * (ph + 10.0);
        let (k, unit, higher) = w.headline();
        let _ = writeln!(
            s,
            r##"<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="#f7f7f7" stroke="#cccccc"/>"##
        );
        let t = format!(
            "{} — {unit} ({} is better)",
            w.name(),
            if higher { "higher" } else { "lower" }
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" font-weight="bold">{}</text>"#,
            x0 + 8.0,
            y0 + 18.0,
            esc(&t)
        );
        let rows: Vec<(Sys, f64)> = d
            .systems
            .iter()
            .filter_map(|sys| get(med, *w, *sys, k).map(|v| (*sys, v)))
            .collect();
        if rows.is_empty() {
            let _ = writeln!(
                s,
                r##"<text x="{}" y="{}" fill="#888888">not measured</text>"##,
                x0 + 8.0,
                y0 + 50.0
            );
            continue;
        }
        let max = rows.iter().map(|r| r.1).fold(0.0, f64::max).max(1e-9);
        let label_w = 100.0;
        let bar_max = pw - label_w - 165.0;
        let bh = ((ph - 40.0) / rows.len() as f64).min(30.0);
        for (j, (sys, v)) in rows.iter().enumerate() {
            let y = y0 + 30.0 + j as f64 * bh;
            let len = (v / max * bar_max).max(1.0);
            let color = match sys {
                Sys::Cairn => "#e4572e",
                Sys::CairnNoWb => "#f3a712",
                Sys::CairnDirect => "#b8336a",
                Sys::CairnTls => "#8c2f1b",
                Sys::Raw => "#29335c",
                Sys::Origin => "#a0a0a0",
                _ => "#669bbc",
            };
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
                x0 + label_w,
                y + bh * 0.65,
                sys.name()
            );
            let _ = writeln!(
                s,
                r#"<rect x="{}" y="{}" width="{len:.1}" height="{:.1}" fill="{color}"/>"#,
                x0 + label_w + 6.0,
                y + 2.0,
                bh - 6.0
            );
            let mut lbl = fmt_val(k, *v);
            if *sys != w.subject() {
                if let Some(r) = ratio(get(med, *w, w.subject(), k), Some(*v)) {
                    lbl.push_str(&format!(
                        "  ({} {})",
                        w.subject().name(),
                        fmt_ratio(Some(r))
                    ));
                }
            }
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}">{}</text>"#,
                x0 + label_w + 10.0 + len,
                y + bh * 0.65,
                esc(&lbl)
            );
        }
    }
    // The goals, across the width below the panels, in two columns.
    {
        let x0 = 15.0;
        let gw = 2.0 * pw + 10.0;
        let _ = writeln!(
            s,
            r##"<rect x="{x0}" y="{gy}" width="{gw}" height="{gh}" fill="#f7f7f7" stroke="#cccccc"/>"##
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" font-weight="bold">Goals of issues 8 and 14</text>"#,
            x0 + 8.0,
            gy + 18.0
        );
        let per_col = goals.len().div_ceil(2);
        for (j, g) in goals.iter().enumerate() {
            let (mark, color) = match g.met {
                Some(true) => ("met", "#2a7f3f"),
                Some(false) => ("NOT met", "#c0392b"),
                None => ("info", "#555555"),
            };
            let shown: String = g.shown.chars().take(24).collect();
            let (col, row) = (j / per_col.max(1), j % per_col.max(1));
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" font-size="11" fill="{color}">{} {}: {} — {mark}</text>"#,
                x0 + 8.0 + col as f64 * (pw + 10.0),
                gy + 36.0 + row as f64 * 13.5,
                g.id,
                esc(short(g.id)),
                esc(&shown)
            );
        }
    }
    if let Some(m) = &d.memory {
        let line = format!(
            "W5: {} MiB RSS per GiB of cache ({} GiB cache full of 4 KiB blocks; goal ≤ 8); reopen after kill -9: worst {} s (goal ≤ 2)",
            m["rss_mib_per_gib"].as_f64().map(fmt_num).unwrap_or("–".into()),
            m["cache_gib"],
            m["reopen_s_max"].as_f64().map(fmt_num).unwrap_or("–".into())
        );
        let _ = writeln!(s, r#"<text x="15" y="{fy}">{}</text>"#, esc(&line));
    }
    let met = goals.iter().filter(|g| g.met == Some(true)).count();
    let total = goals.iter().filter(|g| g.met.is_some()).count();
    let missed: Vec<&str> = goals
        .iter()
        .filter(|g| g.met == Some(false))
        .map(|g| g.id)
        .collect();
    let line = format!(
        "Goals of issues 8 and 14 met: {met} of {total}; not met: {}",
        if missed.is_empty() {
            "none".into()
        } else {
            missed.join(", ")
        }
    );
    let _ = writeln!(s, r#"<text x="15" y="{}">{}</text>"#, fy + 20.0, esc(&line));
    let line = format!(
        "Labels give the value and cairn's ratio to that system (for ext4, a time ratio: below 1 = cairn faster). Load average at start {}, end {}.",
        d.header["load_start"], d.header["load_end"]
    );
    let _ = writeln!(
        s,
        r##"<text x="15" y="{}" fill="#555555" font-size="11">{}</text>"##,
        fy + 40.0,
        esc(&line)
    );
    s.push_str("</svg>\n");
    s
}
