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
    /// The same through TLS (`nbds+unix://`), with `home` as HOME so
    /// libnbd finds the CA in `home/.pki/libnbd`.
    NbdTls { sock: PathBuf, home: PathBuf },
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
    /// Clients: fio `numjobs` (each job its own NBD connection), reported
    /// as one (`group_reporting`). 0 or 1: one client.
    pub numjobs: u32,
    /// Start of the region (fio `offset`).
    pub offset: u64,
    /// Each client's region starts this much after the previous one's
    /// (fio `offset_increment`); 0: all clients share the region.
    pub offset_increment: u64,
    /// Start a new reporting group (fio `new_group`): a second job of one
    /// fio run reported apart from the first.
    pub new_group: bool,
}

impl Default for Job {
    fn default() -> Job {
        Job {
            name: "job",
            rw: "randread",
            bs: 4096,
            iodepth: 1,
            size: 0,
            io_size: None,
            fsync: false,
            end_fsync: false,
            time_based_s: None,
            max_runtime_s: 0,
            numjobs: 1,
            offset: 0,
            offset_increment: 0,
            new_group: false,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct FioResult {
    pub read_ios: u64,
    pub write_ios: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    /// Wall time of the job (of the group: its longest client).
    pub runtime_ms: f64,
    /// fio's `job_runtime`: summed over a group's clients, what its CPU
    /// percentages are relative to.
    pub cpu_runtime_ms: f64,
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
    /// Decimal MB/s, as the issue's references quote them.
    pub fn mb_s(&self) -> f64 {
        (self.read_bytes + self.write_bytes) as f64 / (self.runtime_ms / 1000.0) / 1e6
    }
    /// Two concurrent jobs as one: I/O summed, the longer wall time, CPU
    /// time summed; latencies are `self`'s.
    pub fn merged(&self, o: &FioResult) -> FioResult {
        let cpu_s = self.client_cpu_s() + o.client_cpu_s();
        let runtime_ms = self.runtime_ms.max(o.runtime_ms);
        FioResult {
            read_ios: self.read_ios + o.read_ios,
            write_ios: self.write_ios + o.write_ios,
            read_bytes: self.read_bytes + o.read_bytes,
            write_bytes: self.write_bytes + o.write_bytes,
            runtime_ms,
            cpu_runtime_ms: runtime_ms,
            usr_cpu_pct: cpu_s * 100.0 / (runtime_ms / 1000.0),
            sys_cpu_pct: 0.0,
            ..self.clone()
        }
    }
    /// fio's own (client) CPU time, seconds.
    pub fn client_cpu_s(&self) -> f64 {
        (self.usr_cpu_pct + self.sys_cpu_pct) / 100.0 * self.cpu_runtime_ms / 1000.0
    }
}

/// One job's options (from its `--name`): several of these make one fio
/// run with concurrent jobs.
fn job_args(target: &Target, job: &Job) -> Vec<String> {
    let mut a = vec![format!("--name={}", job.name)];
    if job.new_group {
        a.push("--new_group".into());
    }
    match target {
        // The uri option exists only once the nbd engine is chosen.
        Target::Nbd(sock) => {
            a.push("--ioengine=nbd".into());
            a.push(format!("--uri=nbd+unix:///?socket={}", sock.display()));
        }
        Target::NbdTls { sock, .. } => {
            a.push("--ioengine=nbd".into());
            a.push(format!("--uri=nbds+unix:///?socket={}", sock.display()));
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
    if job.offset > 0 {
        a.push(format!("--offset={}", job.offset));
    }
    if job.numjobs > 1 {
        a.push(format!("--numjobs={}", job.numjobs));
        a.push("--group_reporting".into());
        if job.offset_increment > 0 {
            a.push(format!("--offset_increment={}", job.offset_increment));
        }
    }
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
    a
}

pub fn command_line(target: &Target, job: &Job) -> String {
    command_line_group(target, std::slice::from_ref(job))
}

/// The command line of one fio run of `jobs`, run concurrently.
pub fn command_line_group(target: &Target, jobs: &[Job]) -> String {
    let mut s = String::from("fio");
    for a in group_args(target, jobs) {
        s.push(' ');
        if a.contains('?') || a.contains('&') {
            s.push_str(&format!("'{a}'"));
        } else {
            s.push_str(&a);
        }
    }
    s
}

fn group_args(target: &Target, jobs: &[Job]) -> Vec<String> {
    let mut a: Vec<String> = jobs.iter().flat_map(|j| job_args(target, j)).collect();
    a.push("--output-format=json".into());
    a
}

pub fn run(target: &Target, job: &Job, out_json: &Path) -> Result<FioResult> {
    let mut r = run_group(target, std::slice::from_ref(job), out_json)?;
    r.pop().context("fio reported no job")
}

/// One fio run of `jobs` at the same time (each its own reporting group:
/// give every job after the first `new_group`); one result per job, in
/// order, found by job name.
pub fn run_group(target: &Target, jobs: &[Job], out_json: &Path) -> Result<Vec<FioResult>> {
    procs::check_interrupted()?;
    let longest = jobs
        .iter()
        .map(|j| j.time_based_s.unwrap_or(j.max_runtime_s))
        .max()
        .unwrap_or(0);
    let timeout = Duration::from_secs(longest + 120);
    let names: Vec<&str> = jobs.iter().map(|j| j.name).collect();
    let mut cmd = Command::new("fio");
    if let Target::NbdTls { home, .. } = target {
        cmd.env("HOME", home);
    }
    cmd.args(group_args(target, jobs));
    cmd.arg(format!("--output={}", out_json.display()));
    let (_, timed_out) = procs::run_timed(&mut cmd, timeout)?;
    if timed_out {
        bail!("fio {} did not finish within {timeout:?}", names.join("+"));
    }
    let text = std::fs::read_to_string(out_json)
        .with_context(|| format!("reading {}", out_json.display()))?;
    let all = parse_all(&text).with_context(|| format!("parsing {}", out_json.display()))?;
    names
        .iter()
        .map(|n| {
            all.iter()
                .find(|(name, _)| name == n)
                .map(|(_, r)| r.clone())
                .with_context(|| format!("{} has no job {n}", out_json.display()))
        })
        .collect()
}

/// Every job (or group, with `group_reporting`) of a fio JSON report, with
/// its name.
pub fn parse_all(text: &str) -> Result<Vec<(String, FioResult)>> {
    // fio may print notes before the JSON object.
    let start = text.find('{').context("no JSON in fio output")?;
    let v: Value = serde_json::from_str(&text[start..])?;
    let jobs = v["jobs"].as_array().context("fio JSON has no jobs")?;
    jobs.iter().map(parse_job).collect()
}

fn parse_job(job: &Value) -> Result<(String, FioResult)> {
    let name = job["jobname"].as_str().unwrap_or("").to_string();
    if job["error"].as_i64().unwrap_or(0) != 0 {
        bail!("fio job {name} error {}", job["error"]);
    }
    let f = |x: &Value| x.as_f64().unwrap_or(0.0);
    let u = |x: &Value| x.as_u64().unwrap_or(0);
    let (rd, wr) = (&job["read"], &job["write"]);
    let dominant = if u(&rd["total_ios"]) >= u(&wr["total_ios"]) {
        rd
    } else {
        wr
    };
    let job_runtime = f(&job["job_runtime"]).max(1.0);
    // With group_reporting, job_runtime is the sum over the clients; the
    // wall time is the longest client's, per direction.
    let clients: u64 = job["job options"]["numjobs"]
        .as_str()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1);
    let wall = if clients > 1 {
        f(&rd["runtime"]).max(f(&wr["runtime"])).max(1.0)
    } else {
        job_runtime
    };
    let r = FioResult {
        read_ios: u(&rd["total_ios"]),
        write_ios: u(&wr["total_ios"]),
        read_bytes: u(&rd["io_bytes"]),
        write_bytes: u(&wr["io_bytes"]),
        runtime_ms: wall,
        cpu_runtime_ms: job_runtime,
        usr_cpu_pct: f(&job["usr_cpu"]),
        sys_cpu_pct: f(&job["sys_cpu"]),
        lat_mean_us: f(&dominant["lat_ns"]["mean"]) / 1000.0,
        lat_p99_us: f(&dominant["clat_ns"]["percentile"]["99.000000"]) / 1000.0,
        sync_lat_mean_us: f(&job["sync"]["lat_ns"]["mean"]) / 1000.0,
    };
    Ok((name, r))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape of fio 3.33's JSON for a QD1 reader and a group of four
    /// writers (group_reporting): job_runtime is summed over the group.
    const TWO_GROUPS: &str = r#"w8-reader: (g=0): rw=randread, bs=(R) 4096B-4096B
{
  "jobs" : [
    {"jobname": "w8-reader", "groupid": 0, "error": 0, "job options": {"name": "w8-reader"},
     "read": {"io_bytes": 4096000, "total_ios": 1000, "runtime": 1001,
              "lat_ns": {"mean": 50000.0}, "clat_ns": {"percentile": {"99.000000": 120000}}},
     "write": {"io_bytes": 0, "total_ios": 0, "runtime": 0, "lat_ns": {"mean": 0.0}, "clat_ns": {}},
     "sync": {"lat_ns": {"mean": 0.0}},
     "job_runtime": 1000, "usr_cpu": 10.0, "sys_cpu": 10.0},
    {"jobname": "w8-writers", "groupid": 1, "error": 0, "job options": {"name": "w8-writers", "numjobs": "4"},
     "read": {"io_bytes": 0, "total_ios": 0, "runtime": 0, "lat_ns": {"mean": 0.0}, "clat_ns": {}},
     "write": {"io_bytes": 8192000, "total_ios": 2000, "runtime": 1001,
               "lat_ns": {"mean": 30000.0}, "clat_ns": {"percentile": {"99.000000": 90000}}},
     "sync": {"lat_ns": {"mean": 70000.0}},
     "job_runtime": 4000, "usr_cpu": 5.0, "sys_cpu": 5.0}
  ]
}"#;

    #[test]
    fn groups_parse_by_name_with_wall_time() {
        let all = parse_all(TWO_GROUPS).expect("parses");
        assert_eq!(all.len(), 2);
        let (rn, rd) = &all[0];
        let (wn, wr) = &all[1];
        assert_eq!((rn.as_str(), wn.as_str()), ("w8-reader", "w8-writers"));
        assert_eq!(rd.lat_p99_us, 120.0);
        assert_eq!(rd.runtime_ms, 1000.0);
        // The group's IOPS use the wall time, not the summed job_runtime.
        assert_eq!(wr.runtime_ms, 1001.0);
        assert!((wr.iops() - 2000.0 / 1.001).abs() < 1e-6);
        // CPU: 10 % of the summed 4 s.
        assert!((wr.client_cpu_s() - 0.4).abs() < 1e-9);
        assert_eq!(wr.sync_lat_mean_us, 70.0);
        let m = wr.merged(rd);
        assert_eq!(m.ios(), 3000);
        assert!((m.client_cpu_s() - 0.6).abs() < 1e-9);
    }

    #[test]
    fn group_command_line() {
        let t = Target::Nbd(PathBuf::from("S"));
        let reader = Job {
            name: "r",
            size: 1 << 20,
            time_based_s: Some(5),
            ..Job::default()
        };
        let writers = Job {
            name: "w",
            rw: "randwrite",
            size: 1 << 20,
            fsync: true,
            time_based_s: Some(5),
            numjobs: 4,
            offset: 1 << 29,
            offset_increment: 1 << 20,
            new_group: true,
            ..Job::default()
        };
        let cl = command_line_group(&t, &[reader, writers]);
        assert!(cl.starts_with("fio --name=r --ioengine=nbd"), "{cl}");
        assert!(cl.contains(
            "--name=w --new_group --ioengine=nbd '--uri=nbd+unix:///?socket=S' --rw=randwrite"
        ));
        assert!(cl.contains(
            "--offset=536870912 --numjobs=4 --group_reporting --offset_increment=1048576"
        ));
        assert!(cl.ends_with("--output-format=json"));
        assert_eq!(cl.matches("--output-format").count(), 1);
    }
}
