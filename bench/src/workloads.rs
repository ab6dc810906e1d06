//! The five experiments of issue 8 and the five of issue 14, one
//! measurement at a time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::fio::{self, Job, Target};
use crate::procs::{self, Fuse, Loop, Mount};
use crate::systems::{Env, Sys};
use crate::Config;

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, PartialOrd, Ord)]
pub enum W {
    Fsync,
    Ext4,
    Seq,
    SeqSustained,
    RandRead,
    Memory,
    /// W6: 4 KiB random reads, QD32, over a cold span: every read a miss
    /// to the slow origin (a dedicated one with 64 threads).
    ColdRead,
    /// W6 at QD1: the miss path's latency.
    ColdReadQd1,
    /// W4 with cairn's cache hits read with O_DIRECT (cairn-direct).
    RandReadDirect,
    /// W7: several clients, each 4 KiB random writes with an fsync after
    /// each, QD1.
    MultiFsync,
    /// W7r: several clients, cached 4 KiB random reads, QD8 each.
    MultiRead,
    /// W8: one QD1 reader's p99 while several fsync'd writers run, against
    /// its p99 alone.
    ReadUnderWrites,
}

pub const ALL: [W; 12] = [
    W::Fsync,
    W::Ext4,
    W::Seq,
    W::SeqSustained,
    W::RandRead,
    W::Memory,
    W::ColdRead,
    W::ColdReadQd1,
    W::RandReadDirect,
    W::MultiFsync,
    W::MultiRead,
    W::ReadUnderWrites,
];

impl W {
    pub fn id(self) -> &'static str {
        match self {
            W::Fsync => "w1",
            W::Ext4 => "w2",
            W::Seq => "w3",
            W::SeqSustained => "w3s",
            W::RandRead => "w4",
            W::Memory => "w5",
            W::ColdRead => "w6",
            W::ColdReadQd1 => "w6q1",
            W::RandReadDirect => "w4d",
            W::MultiFsync => "w7",
            W::MultiRead => "w7r",
            W::ReadUnderWrites => "w8",
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            W::Fsync => "w1-fsync-4k-randwrite-qd1",
            W::Ext4 => "w2-ext4-sync-untar",
            W::Seq => "w3-seq-64k-write-qd8",
            W::SeqSustained => "w3s-seq-64k-write-qd8-sustained",
            W::RandRead => "w4-cached-4k-randread-qd32",
            W::Memory => "w5-memory-recovery",
            W::ColdRead => "w6-cold-4k-randread-qd32",
            W::ColdReadQd1 => "w6q1-cold-4k-randread-qd1",
            W::RandReadDirect => "w4d-cached-4k-randread-qd32-direct",
            W::MultiFsync => "w7-4clients-fsync-4k-randwrite-qd1",
            W::MultiRead => "w7r-4clients-cached-4k-randread-qd8",
            W::ReadUnderWrites => "w8-qd1-read-p99-under-fsync-writes",
        }
    }
    pub fn from_id(s: &str) -> Option<W> {
        ALL.iter().copied().find(|w| w.id() == s || w.name() == s)
    }
    /// What `--only ID` selects: `w6` is W6 with its QD1 variant (both
    /// belong to W6's goals); `w6q1` alone is the QD1 one.
    pub fn select(s: &str) -> Option<Vec<W>> {
        match s {
            "w6" => Some(vec![W::ColdRead, W::ColdReadQd1]),
            _ => W::from_id(s).map(|w| vec![w]),
        }
    }
    /// The system whose ratios to the others the goals and the headline
    /// table give: cairn, except W4d, which is about cairn-direct.
    pub fn subject(self) -> Sys {
        match self {
            W::RandReadDirect => Sys::CairnDirect,
            _ => Sys::Cairn,
        }
    }
    /// Served over the dedicated 64-thread origin (W6).
    pub fn cold_origin(self) -> bool {
        matches!(self, W::ColdRead | W::ColdReadQd1)
    }
    /// The prewarm is read twice, so the measured run finds the working
    /// set in the host page cache for every system (see `prewarm`).
    fn touch_after_prewarm(self) -> bool {
        matches!(self, W::MultiRead | W::ReadUnderWrites)
    }
    /// Reads a working set once before the measured run (not for raw).
    fn prewarmed(self) -> bool {
        matches!(
            self,
            W::RandRead | W::RandReadDirect | W::MultiRead | W::ReadUnderWrites
        )
    }
    /// The headline metric and whether higher is better.
    pub fn headline(self) -> (&'static str, &'static str, bool) {
        match self {
            W::Fsync => ("iops", "IOPS", true),
            W::Ext4 => ("seconds", "s (wall)", false),
            W::Seq | W::SeqSustained => ("mb_s", "MB/s", true),
            W::RandRead => ("iops", "IOPS", true),
            W::Memory => ("rss_mib_per_gib", "MiB/GiB", false),
            W::ColdRead | W::RandReadDirect | W::MultiFsync | W::MultiRead => {
                ("iops", "IOPS", true)
            }
            W::ColdReadQd1 => ("lat_mean_us", "µs mean latency", false),
            W::ReadUnderWrites => ("lat_p99_us", "µs reader p99 under load", false),
        }
    }
    pub fn applies(self, sys: Sys) -> bool {
        if sys.is_tls() {
            // TLS against clear text: the throughput workloads.
            return matches!(self, W::Seq | W::RandRead);
        }
        match self {
            W::ColdRead | W::ColdReadQd1 => matches!(sys, Sys::Cairn | Sys::Origin),
            W::RandReadDirect => matches!(sys, Sys::CairnDirect | Sys::Raw | Sys::QemuNbd),
            W::MultiFsync | W::MultiRead | W::ReadUnderWrites => {
                matches!(sys, Sys::Cairn | Sys::NbdkitFile)
            }
            W::Memory => sys == Sys::Cairn,
            W::Seq => sys != Sys::CairnDirect,
            // Overwrite stress: the peers that write in place, and cairn.
            W::SeqSustained => !matches!(sys, Sys::Origin | Sys::NbdkitCache | Sys::CairnDirect),
            W::RandRead => sys != Sys::CairnNoWb,
            _ => !matches!(sys, Sys::CairnNoWb | Sys::CairnDirect),
        }
    }
}

/// One measurement of one system on one workload in one round.
#[derive(Clone, Debug)]
pub struct Meas {
    pub w: W,
    pub sys: Sys,
    pub round: usize,
    pub m: BTreeMap<String, f64>,
    pub notes: Vec<String>,
}

impl Meas {
    pub fn to_json(&self) -> Value {
        json!({
            "workload": self.w.name(),
            "system": self.sys.name(),
            "round": self.round,
            "metrics": self.m,
            "notes": self.notes,
        })
    }
}

pub fn job(cfg: &Config, w: W) -> Job {
    let t = Some(cfg.runtime_s);
    match w {
        W::Fsync => Job {
            name: "w1",
            rw: "randwrite",
            bs: 4096,
            iodepth: 1,
            size: cfg.w1_region,
            io_size: None,
            fsync: true,
            end_fsync: false,
            time_based_s: t,
            max_runtime_s: 0,
            ..Job::default()
        },
        // One pass into a freshly started system: the write path itself.
        W::Seq => Job {
            name: "w3",
            rw: "write",
            bs: 65536,
            iodepth: 8,
            size: cfg.w3_bytes,
            io_size: None,
            fsync: false,
            end_fsync: false,
            time_based_s: None,
            max_runtime_s: 300,
            ..Job::default()
        },
        // Loops over a region that fits the cache for the whole run time,
        // so the stream outgrows the cache and overwrites itself.
        W::SeqSustained => Job {
            name: "w3s",
            rw: "write",
            bs: 65536,
            iodepth: 8,
            size: cfg.w3s_region,
            io_size: None,
            fsync: false,
            end_fsync: false,
            time_based_s: t,
            max_runtime_s: 0,
            ..Job::default()
        },
        W::RandRead => Job {
            name: "w4",
            rw: "randread",
            bs: 4096,
            iodepth: 32,
            size: cfg.w4_working_set,
            io_size: None,
            fsync: false,
            end_fsync: false,
            time_based_s: t,
            max_runtime_s: 0,
            ..Job::default()
        },
        W::ColdRead | W::ColdReadQd1 => Job {
            name: if w == W::ColdRead { "w6" } else { "w6q1" },
            rw: "randread",
            bs: 4096,
            iodepth: if w == W::ColdRead { 32 } else { 1 },
            size: cfg.w6_span,
            time_based_s: t,
            ..Job::default()
        },
        W::RandReadDirect => Job {
            name: "w4d",
            ..job(cfg, W::RandRead)
        },
        // Each client its own slice of W1's region.
        W::MultiFsync => Job {
            name: "w7",
            rw: "randwrite",
            bs: 4096,
            iodepth: 1,
            size: cfg.w1_region / u64::from(cfg.clients),
            fsync: true,
            time_based_s: t,
            numjobs: cfg.clients,
            offset_increment: cfg.w1_region / u64::from(cfg.clients),
            ..Job::default()
        },
        W::MultiRead => Job {
            name: "w7r",
            rw: "randread",
            bs: 4096,
            iodepth: 8,
            size: cfg.w4_working_set,
            time_based_s: t,
            numjobs: cfg.clients,
            ..Job::default()
        },
        W::ReadUnderWrites => w8_reader(cfg),
        _ => unreachable!(),
    }
}

/// W8's reader: QD1 4 KiB random reads over the prewarmed working set.
pub fn w8_reader(cfg: &Config) -> Job {
    Job {
        name: "w8-reader",
        rw: "randread",
        bs: 4096,
        iodepth: 1,
        size: cfg.w4_working_set,
        time_based_s: Some(cfg.runtime_s),
        ..Job::default()
    }
}

/// W8's load: `clients` fsync'd 4 KiB random writers, QD1 each, each on
/// its own slice of a region past the reader's (so they never overwrite
/// what it reads), reported as a second group.
pub fn w8_writers(cfg: &Config) -> Job {
    let slice = cfg.w1_region / u64::from(cfg.clients);
    Job {
        name: "w8-writers",
        rw: "randwrite",
        bs: 4096,
        iodepth: 1,
        size: slice,
        fsync: true,
        time_based_s: Some(cfg.runtime_s),
        numjobs: cfg.clients,
        offset: W8_WRITE_OFFSET,
        offset_increment: slice,
        new_group: true,
        ..Job::default()
    }
}

/// Where W8's writers start: past the reader's working set.
pub const W8_WRITE_OFFSET: u64 = 512 << 20;

/// Reads the working set once (random order, so no sequential-bypass
/// policy can skip it) to bring it into the cache.
pub fn prewarm_job(cfg: &Config) -> Job {
    Job {
        name: "w4-prewarm",
        rw: "randread",
        bs: 65536,
        iodepth: 16,
        size: cfg.w4_working_set,
        io_size: None,
        fsync: false,
        end_fsync: false,
        time_based_s: None,
        max_runtime_s: 600,
        ..Job::default()
    }
}

fn num(v: &Value, k: &str) -> f64 {
    v.get(k).and_then(|x| x.as_f64()).unwrap_or(f64::NAN)
}

const CAIRN_COUNTERS: &[&str] = &[
    "cache_bytes_written",
    "cache_barriers",
    "records_sealed",
    "read_hits",
    "read_misses",
    "writeback_bytes",
    "writeback_stalls",
    "internal_flushes",
    "flushes",
    "flush_barriers",
    "group_commit_joins",
    "writes",
    "reads",
    "checkpoints",
    "superblock_writes",
    "evictions",
];

struct Snap {
    ticks: Option<u64>,
    io: Option<(u64, u64)>,
    status: Option<Value>,
}

fn snap(env: &Env, sys: Sys, pid: Option<u32>) -> Snap {
    Snap {
        ticks: pid.and_then(procs::cpu_ticks),
        io: pid.and_then(procs::io_bytes),
        status: if sys.is_cairn() {
            env.cairn_status(&env.fast).ok()
        } else {
            None
        },
    }
}

/// W1, W3, W4, W4d, W6, W7, W7r: one fio run against a freshly started
/// system.
pub fn measure_fio(cfg: &Config, env: &Env, w: W, sys: Sys, round: usize) -> Result<Meas> {
    let daemon = start_for(env, w, sys)?;
    let target = match (&daemon, &env.tls) {
        (Some(d), Some(tls)) if sys.is_tls() => Target::NbdTls {
            sock: d.sock.clone(),
            home: tls.client_home.clone(),
        },
        (Some(d), _) => Target::Nbd(d.sock.clone()),
        (None, _) => Target::File(env.fast.clone()),
    };
    let out = env.dir.join(format!("fio-{}-{}.json", w.id(), sys.name()));
    let mut notes = Vec::new();
    if w.prewarmed() && sys != Sys::Raw {
        prewarm(cfg, &target, w, sys, &out, &mut notes)?;
    }
    let pid = daemon.as_ref().map(|d| d.pid);
    let s0 = snap(env, sys, pid);
    let sampler = procs::InflightSampler::start(env.inflight.as_deref());
    let r = fio::run(&target, &job(cfg, w), &out)
        .with_context(|| format!("{} on {}", w.id(), sys.name()))?;
    let inflight = sampler.and_then(procs::InflightSampler::finish);
    let s1 = snap(env, sys, pid);
    let hwm = pid.and_then(|p| procs::status_kib(p, "VmHWM"));
    let load = procs::loadavg();
    if let Some(d) = daemon {
        if sys != Sys::Origin {
            d.stop(Duration::from_secs(60))?;
        }
    }

    let mut m = BTreeMap::new();
    fio_metrics(&mut m, &r, &s0, &s1);
    if matches!(w, W::Seq | W::SeqSustained) {
        // The write path's cost per MB written (decimal MB, as MB/s).
        let mb = ((r.write_bytes as f64) / 1e6).max(1e-9);
        let daemon_s = m.get("daemon_cpu_s").copied().unwrap_or(0.0);
        m.insert("daemon_cpu_us_per_mb".into(), daemon_s * 1e6 / mb);
        m.insert(
            "cpu_us_per_mb".into(),
            (daemon_s + r.client_cpu_s()) * 1e6 / mb,
        );
    }
    if let Some(h) = hwm {
        m.insert("daemon_peak_rss_mib".into(), h as f64 / 1024.0);
    }
    cairn_metrics(&mut m, &mut notes, sys, &r, &s0, &s1);
    if let Some(i) = inflight {
        m.insert("dev_inflight_reads".into(), i.reads_mean);
        m.insert("dev_inflight_writes".into(), i.writes_mean);
        m.insert("dev_busy_pct".into(), 100.0 * i.busy_fraction);
    }
    m.insert("load1".into(), load[0]);
    Ok(Meas {
        w,
        sys,
        round,
        m,
        notes,
    })
}

/// Reads the working set once (`prewarm_job`): into cairn's cache, into
/// the host page cache for nbdkit-file. W7r and W8 read it a second time:
/// cairn's fills are written with O_DIRECT, so after one pass its cache
/// file's blocks are not in the host page cache yet, and the measured run
/// would time their first touch of the disk (W4 keeps that, as before);
/// after the second pass every system serves the set from memory.
fn prewarm(
    cfg: &Config,
    target: &Target,
    w: W,
    sys: Sys,
    out: &Path,
    notes: &mut Vec<String>,
) -> Result<()> {
    let passes = if w.touch_after_prewarm() { 2 } else { 1 };
    for pass in 1..=passes {
        let pw = fio::run(target, &prewarm_job(cfg), out)
            .with_context(|| format!("{} prewarm pass {pass} on {}", w.id(), sys.name()))?;
        notes.push(if passes == 1 {
            format!("prewarm {:.1} s", pw.runtime_ms / 1000.0)
        } else {
            format!("prewarm pass {pass} {:.1} s", pw.runtime_ms / 1000.0)
        });
    }
    Ok(())
}

/// Starts `sys` for `w`: on the dedicated 64-thread origin for W6, on the
/// shared origin otherwise.
fn start_for(env: &Env, w: W, sys: Sys) -> Result<Option<procs::Daemon>> {
    if w.cold_origin() {
        let o = env
            .cold_origin
            .as_ref()
            .context("the W6 origin (nbdkit -t 64) is not running")?;
        env.start_on(sys, o)
    } else {
        env.start(sys)
    }
}

/// fio's figures and the daemon's CPU over one fio run.
fn fio_metrics(m: &mut BTreeMap<String, f64>, r: &fio::FioResult, s0: &Snap, s1: &Snap) {
    let ios = r.ios().max(1) as f64;
    m.insert("iops".into(), r.iops());
    m.insert("mb_s".into(), r.mb_s());
    m.insert("ios".into(), r.ios() as f64);
    m.insert("client_bytes".into(), (r.read_bytes + r.write_bytes) as f64);
    m.insert("runtime_s".into(), r.runtime_ms / 1000.0);
    m.insert("lat_mean_us".into(), r.lat_mean_us);
    m.insert("lat_p99_us".into(), r.lat_p99_us);
    if r.sync_lat_mean_us > 0.0 {
        m.insert("sync_lat_mean_us".into(), r.sync_lat_mean_us);
    }
    let client_cpu = r.client_cpu_s() * 1e6 / ios;
    m.insert("client_cpu_us_per_io".into(), client_cpu);
    let daemon_s = match (s0.ticks, s1.ticks) {
        (Some(a), Some(b)) => b.saturating_sub(a) as f64 / procs::clk_tck(),
        _ => 0.0,
    };
    m.insert("daemon_cpu_s".into(), daemon_s);
    let daemon_cpu = daemon_s * 1e6 / ios;
    m.insert("daemon_cpu_us_per_io".into(), daemon_cpu);
    m.insert("cpu_us_per_io".into(), client_cpu + daemon_cpu);
    if let (Some(a), Some(b)) = (s0.io, s1.io) {
        m.insert("daemon_read_bytes".into(), b.0.saturating_sub(a.0) as f64);
        m.insert("daemon_write_bytes".into(), b.1.saturating_sub(a.1) as f64);
    }
}

/// Deltas of cairn's counters over one fio run (nothing for the peers).
fn cairn_metrics(
    m: &mut BTreeMap<String, f64>,
    notes: &mut Vec<String>,
    sys: Sys,
    r: &fio::FioResult,
    s0: &Snap,
    s1: &Snap,
) {
    if let (Some(a), Some(b)) = (&s0.status, &s1.status) {
        for k in CAIRN_COUNTERS {
            m.insert(format!("cairn_{k}"), num(b, k) - num(a, k));
        }
        // Cache bytes per client byte: for runs that write.
        if r.write_bytes > 0 {
            m.insert(
                "cache_write_amp".into(),
                (num(b, "cache_bytes_written") - num(a, "cache_bytes_written"))
                    / r.write_bytes as f64,
            );
        }
        let hits = num(b, "read_hits") - num(a, "read_hits");
        let misses = num(b, "read_misses") - num(a, "read_misses");
        if hits + misses > 0.0 {
            m.insert("hit_ratio".into(), hits / (hits + misses));
        }
        // Group commit: how many client flushes one barrier (one
        // fdatasync of the log) answered.
        let flushes = num(b, "flushes") - num(a, "flushes");
        let barriers = num(b, "flush_barriers") - num(a, "flush_barriers");
        if flushes > 0.0 && barriers > 0.0 {
            m.insert("flushes_per_barrier".into(), flushes / barriers);
        }
        m.insert("cairn_dirty_blocks_end".into(), num(b, "dirty_blocks"));
    } else if sys.is_cairn() {
        notes.push("cairn status unavailable".into());
    }
}

/// W8: on one freshly started system, prewarm the reader's working set,
/// run the QD1 reader alone, then the same reader again with `clients`
/// fsync'd writers beside it (one fio run, two reporting groups). The
/// headline is the reader's p99 under load; `p99_ratio` is that over its
/// p99 alone, in the same round.
pub fn measure_w8(cfg: &Config, env: &Env, sys: Sys, round: usize) -> Result<Meas> {
    let w = W::ReadUnderWrites;
    let daemon = env
        .start(sys)?
        .context("w8 needs an NBD server (not raw)")?;
    let target = Target::Nbd(daemon.sock.clone());
    let out = |what: &str| env.dir.join(format!("fio-w8-{what}-{}.json", sys.name()));
    let mut notes = Vec::new();
    prewarm(cfg, &target, w, sys, &out("prewarm"), &mut notes)?;
    let reader = w8_reader(cfg);
    let pid = Some(daemon.pid);
    let io_before_alone = procs::io_bytes(daemon.pid);
    let alone = fio::run(&target, &reader, &out("alone"))
        .with_context(|| format!("w8 reader alone on {}", sys.name()))?;
    let s0 = snap(env, sys, pid);
    let sampler = procs::InflightSampler::start(env.inflight.as_deref());
    let both = fio::run_group(&target, &[reader, w8_writers(cfg)], &out("loaded"))
        .with_context(|| format!("w8 reader with writers on {}", sys.name()))?;
    let inflight = sampler.and_then(procs::InflightSampler::finish);
    let s1 = snap(env, sys, pid);
    let hwm = procs::status_kib(daemon.pid, "VmHWM");
    let load = procs::loadavg();
    if sys != Sys::Origin {
        daemon.stop(Duration::from_secs(60))?;
    }
    let (rd, wr) = match both.as_slice() {
        [rd, wr] => (rd, wr),
        _ => bail!("w8: fio reported {} groups, expected 2", both.len()),
    };

    let mut m = BTreeMap::new();
    // CPU over the loaded run, per I/O of reader and writers together.
    let all = wr.merged(rd);
    fio_metrics(&mut m, &all, &s0, &s1);
    // The reader's own figures are the headline ones.
    m.insert("iops".into(), rd.iops());
    m.insert("lat_mean_us".into(), rd.lat_mean_us);
    m.insert("lat_p99_us".into(), rd.lat_p99_us);
    m.insert("alone_iops".into(), alone.iops());
    m.insert("alone_lat_mean_us".into(), alone.lat_mean_us);
    m.insert("alone_lat_p99_us".into(), alone.lat_p99_us);
    // Should be 0: the reader alone served from memory, as under load.
    if let (Some(a), Some(b)) = (io_before_alone, s0.io) {
        m.insert(
            "alone_daemon_read_bytes".into(),
            b.0.saturating_sub(a.0) as f64,
        );
    }
    if alone.lat_p99_us > 0.0 {
        m.insert("p99_ratio".into(), rd.lat_p99_us / alone.lat_p99_us);
    }
    m.insert("writer_iops".into(), wr.iops());
    m.insert("writer_lat_mean_us".into(), wr.lat_mean_us);
    if wr.sync_lat_mean_us > 0.0 {
        m.insert("sync_lat_mean_us".into(), wr.sync_lat_mean_us);
    }
    if let Some(h) = hwm {
        m.insert("daemon_peak_rss_mib".into(), h as f64 / 1024.0);
    }
    cairn_metrics(&mut m, &mut notes, sys, &all, &s0, &s1);
    if let Some(i) = inflight {
        m.insert("dev_inflight_reads".into(), i.reads_mean);
        m.insert("dev_inflight_writes".into(), i.writes_mean);
        m.insert("dev_busy_pct".into(), 100.0 * i.busy_fraction);
    }
    m.insert("load1".into(), load[0]);
    Ok(Meas {
        w,
        sys,
        round,
        m,
        notes,
    })
}

/// W2: mkfs.ext4 on the volume (through nbdfuse + loop), mount -o sync,
/// time `tar -xf`.
pub fn measure_ext4(cfg: &Config, env: &Env, tar: &Path, sys: Sys, round: usize) -> Result<Meas> {
    let daemon = env.start(sys)?;
    let pid = daemon.as_ref().map(|d| d.pid);
    let fuse = match &daemon {
        Some(d) => Some(Fuse::mount(
            &env.dir.join("fuse"),
            &d.sock,
            &env.dir.join("nbdfuse.log"),
        )?),
        None => None,
    };
    let file: PathBuf = match &fuse {
        Some(f) => f.file(),
        None => env.fast.clone(),
    };
    let lo = Loop::attach(&file, cfg.ext4_bytes, sys == Sys::Raw)?;
    let (mkfs_t, mkfs_timeout) = procs::run_timed(
        Command::new("mkfs.ext4")
            .args([
                "-q",
                "-F",
                "-E",
                "lazy_itable_init=0,lazy_journal_init=0,nodiscard",
            ])
            .arg(&lo.dev),
        Duration::from_secs(cfg.ext4_timeout_s),
    )?;
    if mkfs_timeout {
        bail!("mkfs.ext4 took over {} s", cfg.ext4_timeout_s);
    }
    let mnt = Mount::new(&lo.dev, &env.dir.join("mnt"), "sync")?;
    let ticks0 = pid.and_then(procs::cpu_ticks);
    let st0 = if sys.is_cairn() {
        env.cairn_status(&env.fast).ok()
    } else {
        None
    };
    let (t, timed_out) = procs::run_timed(
        Command::new("tar")
            .arg("-xf")
            .arg(tar)
            .arg("-C")
            .arg(&mnt.dir),
        Duration::from_secs(cfg.ext4_timeout_s),
    )?;
    let ticks1 = pid.and_then(procs::cpu_ticks);
    let st1 = if sys.is_cairn() {
        env.cairn_status(&env.fast).ok()
    } else {
        None
    };
    let umount_t = mnt.unmount()?;
    drop(lo);
    drop(fuse);
    let hwm = pid.and_then(|p| procs::status_kib(p, "VmHWM"));
    let load = procs::loadavg();
    if let Some(d) = daemon {
        if sys != Sys::Origin {
            d.stop(Duration::from_secs(60))?;
        }
    }
    let mut m = BTreeMap::new();
    let mut notes = Vec::new();
    m.insert("seconds".into(), t.as_secs_f64());
    if timed_out {
        m.insert("timed_out".into(), 1.0);
        notes.push(format!(
            "tar killed after {} s: time is a lower bound",
            cfg.ext4_timeout_s
        ));
    }
    m.insert("mkfs_s".into(), mkfs_t.as_secs_f64());
    if let (Some(a), Some(b)) = (&st0, &st1) {
        for k in [
            "writes",
            "write_bytes",
            "flushes",
            "fua_writes",
            "cache_barriers",
            "cache_bytes_written",
            "records_sealed",
        ] {
            m.insert(format!("cairn_{k}"), num(b, k) - num(a, k));
        }
    }
    m.insert("umount_s".into(), umount_t.as_secs_f64());
    if let (Some(a), Some(b)) = (ticks0, ticks1) {
        m.insert("daemon_cpu_s".into(), (b - a) as f64 / procs::clk_tck());
    }
    if let Some(h) = hwm {
        m.insert("daemon_peak_rss_mib".into(), h as f64 / 1024.0);
    }
    m.insert("load1".into(), load[0]);
    Ok(Meas {
        w: W::Ext4,
        sys,
        round,
        m,
        notes,
    })
}

/// Writes `bytes` of fio's (incompressible, non-zero) data into `path`.
pub fn fill_file(path: &Path, bytes: u64, direct: bool) -> Result<()> {
    let mut cmd = Command::new("fio");
    cmd.args([
        "--name=fill",
        "--rw=write",
        "--bs=1M",
        "--iodepth=8",
        "--ioengine=io_uring",
    ]);
    cmd.arg(format!("--filename={}", path.display()));
    cmd.arg(format!("--size={bytes}"));
    cmd.arg(format!("--direct={}", u8::from(direct)));
    cmd.arg("--output-format=terse");
    procs::run(&mut cmd).with_context(|| format!("filling {}", path.display()))?;
    Ok(())
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// W5: fill a cache with scattered 4 KiB blocks, read RSS, then kill -9 and
/// time the reopen, `rounds` times.
pub fn memory_test(cfg: &Config, env: &Env) -> Result<Value> {
    let cache = env.dir.join("mem-cache.img");
    let _ = std::fs::remove_file(&cache);
    // Removed however this function ends (the file is as big as the cache).
    let _remove = RemoveOnDrop(cache.clone());
    fill_file(&cache, cfg.mem_cache_bytes, true)?;
    env.cairn_format(&cache)?;
    let sock = env.dir.join("cairn-mem.sock");
    let args = ["--no-writeback"];
    let (mut d, first_open) = env.cairn_serve(&cache, &sock, &args)?;
    let rss_empty = procs::status_kib(d.pid, "VmRSS").unwrap_or(0);
    let st = env.cairn_status(&cache)?;
    let cache_blocks = num(&st, "cache_blocks") as u64;
    let volume = num(&st, "volume_size_bytes") as u64;
    // Leave room for log record headers so the fill never waits for
    // write-back to the 5 ms origin.
    let target_blocks = cache_blocks * cfg.mem_fill_pct / 100;
    let region = (target_blocks * 4096 * 2).min(volume / 4096 * 4096);
    let fill = Job {
        name: "w5-fill",
        rw: "randwrite",
        bs: 4096,
        iodepth: 32,
        size: region,
        io_size: Some(target_blocks * 4096),
        fsync: false,
        end_fsync: true,
        time_based_s: None,
        max_runtime_s: 1800,
        ..Job::default()
    };
    eprintln!(
        "  w5: filling {} of {} cache blocks with random 4 KiB writes over a {} MiB region",
        target_blocks,
        cache_blocks,
        region >> 20
    );
    let r = fio::run(
        &Target::Nbd(sock.clone()),
        &fill,
        &env.dir.join("fio-w5-fill.json"),
    )?;
    let st_full = env.cairn_status(&cache)?;
    let rss_full = procs::status_kib(d.pid, "VmRSS").unwrap_or(0);
    let hwm_full = procs::status_kib(d.pid, "VmHWM").unwrap_or(0);
    let filled = num(&st_full, "dirty_blocks") + num(&st_full, "clean_blocks");
    let cache_gib = cfg.mem_cache_bytes as f64 / (1u64 << 30) as f64;

    let mut recov = Vec::new();
    for i in 0..cfg.rounds {
        procs::check_interrupted()?;
        let before_kill = num(&env.cairn_status(&cache)?, "dirty_blocks");
        d.kill9()?;
        let (d2, ready) = env.cairn_serve(&cache, &sock, &args)?;
        d = d2;
        let st2 = env.cairn_status(&cache)?;
        let after = num(&st2, "dirty_blocks");
        let rb = procs::io_bytes(d.pid).map(|x| x.0).unwrap_or(0);
        let hwm = procs::status_kib(d.pid, "VmHWM").unwrap_or(0);
        let rss = procs::status_kib(d.pid, "VmRSS").unwrap_or(0);
        eprintln!(
            "  w5: reopen {} after kill -9: {:.3} s, dirty blocks {} -> {}, read {} MiB, RSS {} MiB (peak {})",
            i + 1,
            ready.as_secs_f64(),
            before_kill,
            after,
            rb >> 20,
            rss >> 10,
            hwm >> 10
        );
        recov.push(json!({
            "reopen_s": ready.as_secs_f64(),
            "dirty_blocks_before": before_kill as u64,
            "dirty_blocks_after": after as u64,
            "recovery_read_bytes": rb,
            "rss_mib": rss as f64 / 1024.0,
            "peak_rss_mib": hwm as f64 / 1024.0,
        }));
    }
    d.stop(Duration::from_secs(300))?;
    let reopen: Vec<f64> = recov
        .iter()
        .map(|r| r["reopen_s"].as_f64().unwrap())
        .collect();
    let peak_after: Vec<f64> = recov
        .iter()
        .map(|r| r["peak_rss_mib"].as_f64().unwrap())
        .collect();
    Ok(json!({
        "cache_bytes": cfg.mem_cache_bytes,
        "cache_gib": cache_gib,
        "cache_blocks": cache_blocks,
        "filled_blocks": filled as u64,
        "fill_fraction": filled / cache_blocks as f64,
        "fill_iops": r.iops(),
        "first_open_s": first_open.as_secs_f64(),
        "rss_empty_mib": rss_empty as f64 / 1024.0,
        "rss_full_mib": rss_full as f64 / 1024.0,
        "peak_rss_full_mib": hwm_full as f64 / 1024.0,
        "index_memory_bytes": num(&st_full, "index_memory_bytes") as u64,
        "rss_mib_per_gib": rss_full as f64 / 1024.0 / cache_gib,
        "rss_growth_mib_per_gib": (rss_full as f64 - rss_empty as f64) / 1024.0 / cache_gib,
        "peak_rss_mib_per_gib": hwm_full as f64 / 1024.0 / cache_gib,
        "peak_rss_after_recovery_mib_per_gib":
            peak_after.iter().cloned().fold(0.0, f64::max) / cache_gib,
        "reopen_s": reopen,
        "reopen_s_max": reopen.iter().cloned().fold(0.0, f64::max),
        "reopen_s_median": crate::report::median(&reopen),
        "recoveries": recov,
    }))
}
