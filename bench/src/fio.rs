//! Running fio and reading its JSON.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::procs;

/// Where fio sends its I/O.
#[derive(Clone, Debug)]
pub enum Target {
    /// fio's nbd engine (libnbd) over a unix socket.
    Nbd(PathBuf),
    /// fio's io_uring engine with O_DIRECT straight on a file.
    File(PathBuf),
}

#[derive(Clone, Debug)]
pub struct Job {
    pub name: &'static str,
    pub rw: &'static str,
    pub bs: u64,
    pub iodepth: u32,
    /// The region of the volume the job covers, from offset 0.
    pub size: u64,
    /// Total bytes to transfer (fio `io_size`); `None`: one pass of `size`.
    pub io_size: Option<u64>,
    pub fsync: bool,
    /// Flush once at the end (fio `end_fsync`).
    pub end_fsync: bool,
    /// `Some(s)`: time-based for s seconds (looping over the region).
    pub time_based_s: Option<u64>,
    /// Upper bound on a size-based job's run time.
    pub max_runtime_s: u64,
}

#[derive(Clone, Debug, Default)]
pub struct FioResult {
    pub read_ios: u64,
    pub write_ios: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub runtime_ms: f64,
    pub usr_cpu_pct: f64,
    pub sys_cpu_pct: f64,
    pub lat_mean_us: f64,
    pub lat_p99_us: f64,
    /// Mean latency of fio's fsync (NBD flush) calls, if any.
    pub sync_lat_mean_us: f64,
}

impl FioResult {
    pub fn ios(&self) -> u64 {
        self.read_ios + self.write_ios
    }
    pub fn iops(&self) -> f64 {
        self.ios() as f64 / (self.runtime_ms / 1000.0)
    }
    /// Decimal MB/s, as the references quote them.
    pub fn mb_s(&self) -> f64 {
        (self.read_bytes + self.write_bytes) as f64 / (self.runtime_ms / 1000.0) / 1e6
    }
    /// fio's own (client) CPU time, seconds.
    pub fn client_cpu_s(&self) -> f64 {
        (self.usr_cpu_pct + self.sys_cpu_pct) / 100.0 * self.runtime_ms / 1000.0
    }
}

pub fn args(target: &Target, job: &Job) -> Vec<String> {
    let mut a = vec![format!("--name={}", job.name)];
    match target {
        // The uri option exists only once the nbd engine is chosen.
        Target::Nbd(sock) => {
            a.push("--ioengine=nbd".into());
            a.push(format!("--uri=nbd+unix:///?socket={}", sock.display()));
        }
        Target::File(f) => {
            a.push("--ioengine=io_uring".into());
            a.push("--direct=1".into());
            a.push(format!("--filename={}", f.display()));
        }
    }
    a.push(format!("--rw={}", job.rw));
    a.push(format!("--bs={}", job.bs));
    a.push(format!("--iodepth={}", job.iodepth));
    a.push(format!("--size={}", job.size));
    if let Some(n) = job.io_size {
        a.push(format!("--io_size={n}"));
    }
    if job.fsync {
        a.push("--fsync=1".into());
    }
    if job.end_fsync {
        a.push("--end_fsync=1".into());
    }
    match job.time_based_s {
        Some(s) => {
            a.push("--time_based".into());
            a.push(format!("--runtime={s}"));
        }
        None => a.push(format!("--runtime={}", job.max_runtime_s)),
    }
    a.push("--randrepeat=1".into());
    a.push("--output-format=json".into());
    a
}

pub fn command_line(target: &Target, job: &Job) -> String {
    let mut s = String::from("fio");
    for a in args(target, job) {
        s.push(' ');
        if a.contains('?') || a.contains('&') {
            s.push_str(&format!("'{a}'"));
        } else {
            s.push_str(&a);
        }
    }
    s
}

pub fn run(target: &Target, job: &Job, out_json: &Path) -> Result<FioResult> {
    procs::check_interrupted()?;
    let timeout = Duration::from_secs(job.time_based_s.unwrap_or(job.max_runtime_s) + 120);
    let mut cmd = Command::new("fio");
    cmd.args(args(target, job));
    cmd.arg(format!("--output={}", out_json.display()));
    let (_, timed_out) = procs::run_timed(&mut cmd, timeout)?;
    if timed_out {
        bail!("fio {} did not finish within {timeout:?}", job.name);
    }
    let text = std::fs::read_to_string(out_json)
        .with_context(|| format!("reading {}", out_json.display()))?;
    parse(&text).with_context(|| format!("parsing {}", out_json.display()))
}

pub fn parse(text: &str) -> Result<FioResult> {
    // fio may print notes before the JSON object.
    let start = text.find('{').context("no JSON in fio output")?;
    let v: Value = serde_json::from_str(&text[start..])?;
    let job = &v["jobs"][0];
    if job.is_null() {
        bail!("fio JSON has no jobs");
    }
    if job["error"].as_i64().unwrap_or(0) != 0 {
        bail!("fio job error {}", job["error"]);
    }
    let f = |x: &Value| x.as_f64().unwrap_or(0.0);
    let u = |x: &Value| x.as_u64().unwrap_or(0);
    let (rd, wr) = (&job["read"], &job["write"]);
    let dominant = if u(&rd["total_ios"]) >= u(&wr["total_ios"]) {
        rd
    } else {
        wr
    };
    Ok(FioResult {
        read_ios: u(&rd["total_ios"]),
        write_ios: u(&wr["total_ios"]),
        read_bytes: u(&rd["io_bytes"]),
        write_bytes: u(&wr["io_bytes"]),
        runtime_ms: f(&job["job_runtime"]).max(1.0),
        usr_cpu_pct: f(&job["usr_cpu"]),
        sys_cpu_pct: f(&job["sys_cpu"]),
        lat_mean_us: f(&dominant["lat_ns"]["mean"]) / 1000.0,
        lat_p99_us: f(&dominant["clat_ns"]["percentile"]["99.000000"]) / 1000.0,
        sync_lat_mean_us: f(&job["sync"]["lat_ns"]["mean"]) / 1000.0,
    })
}
