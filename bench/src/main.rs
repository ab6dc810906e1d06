//! cairn-bench: the benchmark harness of issue 8 (W1-W5), with the
//! workloads of issue 14 (W4d, W6, W7, W7r, W8).
//!
//! Runs every workload against cairn and its peers in one run, interleaved
//! (the order of systems rotates each round), takes medians, and writes a
//! Markdown table of figures and ratios, the same data as JSON, and an SVG
//! chart. See bench/README.md. Needs root (loop devices, mount), fio,
//! nbdkit (file, nbd plugins; delay, cache filters), qemu-nbd, nbdfuse,
//! mkfs.ext4, losetup and tar. Nothing here runs under `cargo test`.

mod fio;
mod procs;
mod report;
mod systems;
mod workloads;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use systems::{Env, Sys};
use workloads::W;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
/// How much of the origin holds data (the rest is sparse); covers W4's
/// working set and W6's span so no system reads holes.
const ORIGIN_DATA_BYTES: u64 = 1 << 30;

/// Threads of W6's dedicated origin (issue 14: `nbdkit -t 64`).
const COLD_ORIGIN_THREADS: u32 = 64;

const USAGE: &str = "\
cairn-bench: cairn against its peers (issues 8 and 14). Needs root.

Usage: cairn-bench [--quick] [options]

  --quick               smoke run, about 4 minutes (1 round, 3 s runs, small sizes)
  --rounds N            rounds per workload (default 3; quick 1)
  --runtime S           seconds per fio measurement (default 10; quick 3)
  --only LIST           workloads, comma separated (default all):
                        issue 8:  w1,w2,w3,w3s,w4,w5
                        issue 14: w6 (= w6 and its QD1 variant w6q1),w6q1,w4d,w7,w7r,w8
  --systems LIST        cairn,cairn-nowb,cairn-direct,cairn-tls,nbdkit-file,nbdkit-file-tls,nbdkit-cache,qemu-nbd,origin,raw
                        (default all; cairn-nowb runs W3 only and cairn-direct W4 and
                        W4d only; each workload runs the systems of its table in
                        bench/README.md)
  --dir DIR             scratch directory (default /var/tmp/cairn-bench; avoid tmpfs)
  --out DIR             where latest.{md,json,svg} go (default bench/results)
  --cairn PATH          the cairn binary (default: next to this binary)
  --cache SIZE          the fast file: cairn's cache and the peers' file (default 4G; quick 2G)
  --mem-cache SIZE      cache size for W5 (default 4G; quick 256M)
  --delay-ms N          slow origin delay per read and write (default 5)
  --ext4-files N        files in the W2 tar (default 2000; quick 300)
  --slow-ext4-rounds N  W2 rounds for the slow systems, origin and nbdkit-cache (default 1)
  --w3-bytes SIZE       W3: one sequential pass of this size (default 3G; quick 1G)
  --w3s-region SIZE     W3s: region the sustained writes loop over (default 512M)
  --keep                keep the scratch directory's big files afterwards
";

#[derive(Clone, Debug)]
pub struct Config {
    pub quick: bool,
    pub rounds: usize,
    pub runtime_s: u64,
    pub workloads: Vec<W>,
    pub systems: Vec<Sys>,
    pub dir: PathBuf,
    pub out: PathBuf,
    pub cairn: PathBuf,
    pub cache_bytes: u64,
    pub origin_bytes: u64,
    pub delay_ms: u64,
    pub w1_region: u64,
    pub w3_bytes: u64,
    pub w3s_region: u64,
    pub w4_working_set: u64,
    /// W6: the cold span read at random (every read a miss).
    pub w6_span: u64,
    /// W7, W7r, W8: concurrent clients (fio numjobs).
    pub clients: u32,
    pub ext4_bytes: u64,
    pub ext4_files: usize,
    pub ext4_timeout_s: u64,
    pub slow_ext4_rounds: usize,
    pub mem_cache_bytes: u64,
    pub mem_fill_pct: u64,
    pub keep: bool,
    pub argv: Vec<String>,
}

fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], MIB),
        Some('G' | 'g') => (&s[..s.len() - 1], GIB),
        _ => (s, 1),
    };
    Ok(num
        .parse::<u64>()
        .with_context(|| format!("bad size {s:?}"))?
        * mult)
}

impl Config {
    fn from_args() -> Result<Config> {
        let argv: Vec<String> = std::env::args().collect();
        let quick = argv.iter().any(|a| a == "--quick");
        let exe_dir = std::env::current_exe()?
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let mut c = Config {
            quick,
            rounds: if quick { 1 } else { 3 },
            runtime_s: if quick { 3 } else { 10 },
            workloads: workloads::ALL.to_vec(),
            systems: systems::ALL.to_vec(),
            dir: PathBuf::from("/var/tmp/cairn-bench"),
            out: Path::new(env!("CARGO_MANIFEST_DIR")).join("results"),
            cairn: exe_dir.join("cairn"),
            cache_bytes: if quick { 2 * GIB } else { 4 * GIB },
            origin_bytes: 0,
            delay_ms: 5,
            w1_region: 256 * MIB,
            w3_bytes: if quick { GIB } else { 3 * GIB },
            w3s_region: 512 * MIB,
            w4_working_set: 256 * MIB,
            w6_span: GIB,
            clients: 4,
            ext4_bytes: 768 * MIB,
            ext4_files: if quick { 150 } else { 2000 },
            ext4_timeout_s: if quick { 180 } else { 900 },
            slow_ext4_rounds: 1,
            mem_cache_bytes: if quick { 256 * MIB } else { 4 * GIB },
            mem_fill_pct: 94,
            keep: false,
            argv: argv.clone(),
        };
        let mut it = argv.iter().skip(1);
        while let Some(a) = it.next() {
            let mut val = || it.next().context(format!("{a} needs a value")).cloned();
            match a.as_str() {
                "--quick" => {}
                "--help" | "-h" => {
                    print!("{USAGE}");
                    std::process::exit(0);
                }
                "--rounds" => c.rounds = val()?.parse()?,
                "--runtime" => c.runtime_s = val()?.parse()?,
                "--only" => {
                    let mut ws = Vec::new();
                    for x in val()?.split(',') {
                        for w in W::select(x).with_context(|| format!("unknown workload {x}"))? {
                            if !ws.contains(&w) {
                                ws.push(w);
                            }
                        }
                    }
                    c.workloads = ws;
                }
                "--systems" => {
                    c.systems = val()?
                        .split(',')
                        .map(|x| Sys::from_name(x).with_context(|| format!("unknown system {x}")))
                        .collect::<Result<_>>()?
                }
                "--dir" => c.dir = val()?.into(),
                "--out" => c.out = val()?.into(),
                "--cairn" => c.cairn = val()?.into(),
                "--cache" => c.cache_bytes = parse_size(&val()?)?,
                "--mem-cache" => c.mem_cache_bytes = parse_size(&val()?)?,
                "--delay-ms" => c.delay_ms = val()?.parse()?,
                "--ext4-files" => c.ext4_files = val()?.parse()?,
                "--slow-ext4-rounds" => c.slow_ext4_rounds = val()?.parse()?,
                "--w3-bytes" => c.w3_bytes = parse_size(&val()?)?,
                "--w3s-region" => c.w3s_region = parse_size(&val()?)?,
                "--keep" => c.keep = true,
                other => bail!("unknown argument {other:?}\n\n{USAGE}"),
            }
        }
        if c.rounds == 0 {
            bail!("--rounds must be at least 1");
        }
        // The W5 fill scatters blocks over twice the cache's size.
        c.origin_bytes = (4 * GIB).max(2 * c.mem_cache_bytes);
        let biggest = c
            .w1_region
            .max(c.w3_bytes)
            .max(c.w3s_region)
            .max(c.w4_working_set)
            .max(c.w6_span)
            .max(workloads::W8_WRITE_OFFSET + c.w1_region)
            .max(c.ext4_bytes);
        if biggest > c.cache_bytes
            || c.w4_working_set > ORIGIN_DATA_BYTES
            || c.w6_span > ORIGIN_DATA_BYTES
        {
            bail!(
                "--cache must be at least {} MiB (the largest region)",
                biggest >> 20
            );
        }
        Ok(c)
    }
}

/// The systems W6 runs (whether its origin is needed).
fn w6_sys(s: Sys) -> bool {
    W::ColdRead.applies(s)
}

fn output_of(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .map(|o| {
            let s = if o.stdout.is_empty() {
                o.stderr
            } else {
                o.stdout
            };
            String::from_utf8_lossy(&s)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_string()
        })
        .unwrap_or_else(|_| "?".into())
}

fn machine(cfg: &Config) -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "?".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: f64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0.0);
    let df = output_of(
        "sh",
        &[
            "-c",
            &format!(
                "df -T {} | tail -1 | awk '{{print $1\" (\"$2\")\"}}'",
                cfg.dir.display()
            ),
        ],
    );
    json!({
        "nproc": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu_model": model,
        "mem_gib": (mem_kib / 1048576.0 * 10.0).round() / 10.0,
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
        "scratch_fs": df,
        "fio": output_of("fio", &["--version"]),
        "nbdkit": output_of("nbdkit", &["--version"]),
        "qemu_nbd": output_of("qemu-nbd", &["--version"]),
    })
}

fn now_string() -> String {
    output_of("date", &["-u", "+%Y-%m-%d %H:%M:%S UTC"])
}

fn cairn_commit() -> String {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let rev = output_of(
        "git",
        &[
            "-C",
            &repo.to_string_lossy(),
            "rev-parse",
            "--short",
            "HEAD",
        ],
    );
    let dirty = Command::new("git")
        .arg("-C")
        .arg(&repo)
        .args(["status", "--porcelain", "--", "crates"])
        .output()
        .map(|o| !o.stdout.is_empty())
        .unwrap_or(false);
    format!(
        "commit {rev}{}",
        if dirty {
            " (+ uncommitted changes in crates/)"
        } else {
            ""
        }
    )
}

fn preflight(cfg: &Config) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 && cfg.workloads.contains(&W::Ext4) {
        bail!("W2 (ext4) needs root for losetup and mount; run as root or pass --only w1,w3,w4,w5");
    }
    let mut tools = vec!["fio", "nbdkit"];
    if cfg.systems.contains(&Sys::QemuNbd) {
        tools.push("qemu-nbd");
    }
    if cfg.workloads.contains(&W::Ext4) {
        tools.extend([
            "nbdfuse",
            "fusermount3",
            "losetup",
            "mkfs.ext4",
            "mount",
            "tar",
        ]);
    }
    for t in tools {
        if !procs::tool_exists(t) {
            bail!("{t} not found in PATH");
        }
    }
    if !cfg.cairn.exists() {
        bail!(
            "cairn binary not found at {}; build it first (cargo build --release -p cairn) or pass --cairn, or use bench/run.sh",
            cfg.cairn.display()
        );
    }
    Ok(())
}

/// Builds the W2 tar once: the first N files (sorted) under the Python
/// library trees, files under 256 KiB.
/// `sync`, then a pause for the disk to finish what the host queued.
fn settle_disk() -> Result<()> {
    procs::run(&mut std::process::Command::new("sync")).context("sync after the setup")?;
    std::thread::sleep(std::time::Duration::from_secs(SETTLE_AFTER_SETUP_S));
    Ok(())
}

/// Seconds to wait after the setup's `sync`.
const SETTLE_AFTER_SETUP_S: u64 = 5;

fn build_tar(cfg: &Config) -> Result<(PathBuf, u64)> {
    let tar = cfg.dir.join(format!("files-{}.tar", cfg.ext4_files));
    let list = cfg.dir.join("files.list");
    let script = format!(
        "find /usr/lib/python3* -type f -size -256k 2>/dev/null | LC_ALL=C sort | head -n {} > {}",
        cfg.ext4_files,
        list.display()
    );
    procs::run(Command::new("sh").arg("-c").arg(&script))?;
    let n = std::fs::read_to_string(&list)?.lines().count();
    if n < cfg.ext4_files / 2 {
        bail!("found only {n} files under /usr/lib/python3* for the W2 tar");
    }
    if !tar.exists() {
        procs::run(
            Command::new("tar")
                .arg("-cf")
                .arg(&tar)
                .arg("-T")
                .arg(&list)
                .stderr(std::process::Stdio::null()),
        )?;
    }
    Ok((tar, n as u64))
}

fn main() -> ExitCode {
    procs::install_interrupt_handler();
    match real_main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cairn-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn real_main() -> Result<()> {
    let cfg = Config::from_args()?;
    preflight(&cfg)?;
    std::fs::create_dir_all(&cfg.dir)?;
    std::fs::create_dir_all(&cfg.out)?;
    let _lock = procs::DirLock::acquire(&cfg.dir)?;
    let t_start = Instant::now();
    let load_start = procs::loadavg();
    eprintln!(
        "cairn-bench: {} mode, {} round(s) x {} s, scratch {}, load {:?}",
        if cfg.quick { "quick" } else { "full" },
        cfg.rounds,
        cfg.runtime_s,
        cfg.dir.display(),
        load_start
    );

    // The files: the fast file (fully written, so no system reads holes)
    // and a sparse origin whose first GiB holds data.
    let fast = cfg.dir.join("fast.img");
    let origin_img = cfg.dir.join("origin.img");
    eprintln!(
        "setup: writing {} MiB fast file and the origin's data",
        cfg.cache_bytes >> 20
    );
    let _ = std::fs::remove_file(&fast);
    workloads::fill_file(&fast, cfg.cache_bytes, true)?;
    let _ = std::fs::remove_file(&origin_img);
    workloads::fill_file(&origin_img, ORIGIN_DATA_BYTES, true)?;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&origin_img)?
        .set_len(cfg.origin_bytes)?;
    let tar = if cfg.workloads.contains(&W::Ext4) {
        Some(build_tar(&cfg)?)
    } else {
        None
    };
    // The files' metadata (and the tar) reach the disk now, not during the
    // first measurement: the first round's first system paid for it (W1's
    // first cairn round at 0.6x of its second, 2026-12-07).
    settle_disk()?;
    // Run a private copy of cairn: others may rebuild target/release/cairn
    // during the run.
    let cairn_copy = cfg.dir.join("cairn-under-test");
    let _ = std::fs::remove_file(&cairn_copy);
    std::fs::copy(&cfg.cairn, &cairn_copy)
        .with_context(|| format!("copying {}", cfg.cairn.display()))?;
    let origin_sock = cfg.dir.join("origin.sock");
    let origin = Env::start_origin(
        "origin",
        &origin_img,
        &origin_sock,
        &cfg.dir.join("origin.log"),
        cfg.delay_ms,
        None,
    )?;
    // W6 needs an origin that takes 64 requests at once; the shared one
    // keeps nbdkit's default (16 threads) so the other workloads' origin
    // figures (W1-W4, nbdkit-cache, cairn's write-back) keep their meaning.
    // Same file, its own socket, started only when W6 runs.
    let cold_sock = cfg.dir.join("origin-t64.sock");
    let wants_cold =
        cfg.workloads.iter().any(|w| w.cold_origin()) && cfg.systems.iter().any(|s| w6_sys(*s));
    let cold_origin = if wants_cold {
        Some(Env::start_origin(
            "origin-t64",
            &origin_img,
            &cold_sock,
            &cfg.dir.join("origin-t64.log"),
            cfg.delay_ms,
            Some(COLD_ORIGIN_THREADS),
        )?)
    } else {
        None
    };
    let env = Env {
        dir: cfg.dir.clone(),
        cairn: cairn_copy,
        fast: fast.clone(),
        fast_bytes: cfg.cache_bytes,
        origin_sock: origin_sock.clone(),
        origin_pid: origin.pid,
        cold_origin: cold_origin.as_ref().map(|d| systems::OriginRef {
            sock: cold_sock.clone(),
            pid: d.pid,
        }),
        inflight: procs::inflight_path(&cfg.dir),
        tls: if cfg.systems.iter().any(|s| s.is_tls()) {
            Some(systems::TlsFiles::make(&cfg.dir)?)
        } else {
            None
        },
    };

    let mut fio_cmds = serde_json::Map::new();
    for w in [W::Fsync, W::Seq, W::SeqSustained, W::RandRead] {
        let j = workloads::job(&cfg, w);
        fio_cmds.insert(
            format!("{} (NBD systems)", w.name()),
            json!(fio::command_line(&fio::Target::Nbd(PathBuf::from("S")), &j)),
        );
        fio_cmds.insert(
            format!("{} (raw)", w.name()),
            json!(fio::command_line(
                &fio::Target::File(PathBuf::from("FAST")),
                &j
            )),
        );
    }
    fio_cmds.insert(
        "w4 prewarm (not for raw; also before w4d, w7r, w8)".into(),
        json!(fio::command_line(
            &fio::Target::Nbd(PathBuf::from("S")),
            &workloads::prewarm_job(&cfg)
        )),
    );
    for w in [
        W::ColdRead,
        W::ColdReadQd1,
        W::RandReadDirect,
        W::MultiFsync,
        W::MultiRead,
    ] {
        if !cfg.workloads.contains(&w) {
            continue;
        }
        let j = workloads::job(&cfg, w);
        fio_cmds.insert(
            format!("{} (NBD systems)", w.name()),
            json!(fio::command_line(&fio::Target::Nbd(PathBuf::from("S")), &j)),
        );
        if w.applies(Sys::Raw) {
            fio_cmds.insert(
                format!("{} (raw)", w.name()),
                json!(fio::command_line(
                    &fio::Target::File(PathBuf::from("FAST")),
                    &j
                )),
            );
        }
    }
    if cfg.workloads.contains(&W::ReadUnderWrites) {
        let t = fio::Target::Nbd(PathBuf::from("S"));
        fio_cmds.insert(
            format!("{} (reader alone)", W::ReadUnderWrites.name()),
            json!(fio::command_line(&t, &workloads::w8_reader(&cfg))),
        );
        fio_cmds.insert(
            format!(
                "{} (reader with the writers, one fio run)",
                W::ReadUnderWrites.name()
            ),
            json!(fio::command_line_group(
                &t,
                &[workloads::w8_reader(&cfg), workloads::w8_writers(&cfg)]
            )),
        );
    }
    let mut notes = vec![
        format!("FAST = {} ({} MiB, fully written); ORIGIN = {} ({} MiB sparse, first {} MiB written), served slow on {}", fast.display(), cfg.cache_bytes >> 20, origin_img.display(), cfg.origin_bytes >> 20, ORIGIN_DATA_BYTES >> 20, origin_sock.display()),
        "every system is started fresh for each measurement (cairn is reformatted on FAST first) and stopped after it; the origin daemon runs for the whole run".to_string(),
        format!(
            "origin (shared; W1-W5, W4d, W7, W7r, W8): nbdkit {}",
            Env::origin_args(&origin_img, &origin_sock, cfg.delay_ms, None).join(" ")
        ),
    ];
    if env.cold_origin.is_some() {
        notes.push(format!(
            "W6/W6q1 origin (the same file; cairn is formatted over it and `origin` is fio on its socket): nbdkit {}",
            Env::origin_args(&origin_img, &cold_sock, cfg.delay_ms, Some(COLD_ORIGIN_THREADS)).join(" ")
        ));
        notes.push(format!(
            "W6/W6q1: 4 KiB random reads over the first {} MiB of the volume (fio's random map: no block read twice in a run), cairn freshly formatted before each measurement so every read is a miss (see the hit ratio)",
            cfg.w6_span >> 20
        ));
    }
    if cfg
        .workloads
        .iter()
        .any(|w| matches!(w, W::MultiFsync | W::MultiRead | W::ReadUnderWrites))
    {
        notes.push(format!(
            "W7/W7r/W8: {} clients = fio numjobs={} with group_reporting (one NBD connection each); W7's and W8's writers each on their own {} MiB slice (offset_increment); W8's writers start at {} MiB, past the reader's {} MiB working set",
            cfg.clients,
            cfg.clients,
            (cfg.w1_region / u64::from(cfg.clients)) >> 20,
            workloads::W8_WRITE_OFFSET >> 20,
            cfg.w4_working_set >> 20
        ));
    }
    if let Some((t, n)) = &tar {
        notes.push(format!(
            "W2: {} ({} files, {} MiB); mkfs.ext4 -E lazy_itable_init=0,lazy_journal_init=0,nodiscard on a {} MiB loop (losetup --sizelimit) over nbdfuse's file; mount -o sync; time of tar -xf; slow systems (origin, nbdkit-cache) run {} round(s), timeout {} s",
            t.display(),
            n,
            std::fs::metadata(t).map(|m| m.len() >> 20).unwrap_or(0),
            cfg.ext4_bytes >> 20,
            cfg.slow_ext4_rounds,
            cfg.ext4_timeout_s
        ));
    }

    let mut data = report::Data {
        meas: Vec::new(),
        memory: None,
        errors: Vec::new(),
        header: Value::Null,
        systems: cfg.systems.clone(),
        workloads: cfg.workloads.clone(),
    };
    let cairn_sha = output_of("sha256sum", &[&cfg.cairn.to_string_lossy()]);
    let mut header = json!({
        "cairn_binary": format!("{} (sha256 {})", cfg.cairn.display(), cairn_sha.split_whitespace().next().unwrap_or("?")),
        "date": now_string(),
        "command": cfg.argv.join(" "),
        "mode": if cfg.quick { "quick" } else { "full" },
        "machine": machine(&cfg),
        "cairn_commit": cairn_commit(),
        "load_start": load_start,
        "config": {
            "rounds": cfg.rounds, "runtime_s": cfg.runtime_s, "cache_bytes": cfg.cache_bytes,
            "origin_bytes": cfg.origin_bytes, "delay_ms": cfg.delay_ms, "w1_region": cfg.w1_region,
            "w3_bytes": cfg.w3_bytes, "w3s_region": cfg.w3s_region, "w4_working_set": cfg.w4_working_set, "ext4_bytes": cfg.ext4_bytes,
            "w6_span": cfg.w6_span, "clients": cfg.clients, "cold_origin_threads": COLD_ORIGIN_THREADS,
            "ext4_files": tar.as_ref().map(|t| t.1), "mem_cache_bytes": cfg.mem_cache_bytes,
            "slow_ext4_rounds": cfg.slow_ext4_rounds,
        },
        "fio_commands": fio_cmds,
        "notes": notes,
    });

    let result = run_all(
        &cfg,
        &env,
        tar.as_ref().map(|t| t.0.as_path()),
        &mut data,
        &mut header,
    );
    if let Err(e) = &result {
        data.errors.push(format!("run aborted: {e:#}"));
    }
    origin.stop(std::time::Duration::from_secs(10))?;
    if let Some(o) = cold_origin {
        o.stop(std::time::Duration::from_secs(10))?;
    }
    header["load_end"] = json!(procs::loadavg());
    header["elapsed_s"] = json!(t_start.elapsed().as_secs_f64().round());
    data.header = header;
    let md = write_outputs(&cfg, &data)?;
    println!("{md}");
    eprintln!(
        "cairn-bench: done in {:.0} s; wrote {}/latest.{{md,json,svg}}",
        t_start.elapsed().as_secs_f64(),
        cfg.out.display()
    );
    if !cfg.keep {
        let _ = std::fs::remove_file(&fast);
        let _ = std::fs::remove_file(&origin_img);
        let _ = std::fs::remove_dir_all(cfg.dir.join("nbdkit-cache-tmp"));
    }
    result
}

fn write_outputs(cfg: &Config, data: &report::Data) -> Result<String> {
    let med = data.medians();
    let goals = report::goals(data, &med);
    let md = report::markdown(data, &med, &goals);
    std::fs::write(cfg.out.join("latest.md"), &md)?;
    std::fs::write(
        cfg.out.join("latest.json"),
        serde_json::to_string_pretty(&report::to_json(data, &med, &goals))?,
    )?;
    std::fs::write(cfg.out.join("latest.svg"), report::svg(data, &med, &goals))?;
    Ok(md)
}

fn run_all(
    cfg: &Config,
    env: &Env,
    tar: Option<&Path>,
    data: &mut report::Data,
    header: &mut Value,
) -> Result<()> {
    for &w in &cfg.workloads {
        let t0 = Instant::now();
        eprintln!("== {}", w.name());
        if w == W::Memory {
            if !cfg.systems.contains(&Sys::Cairn) {
                continue;
            }
            match workloads::memory_test(cfg, env) {
                Ok(v) => {
                    eprintln!(
                        "  w5: {:.2} MiB RSS per GiB, worst reopen {:.3} s",
                        v["rss_mib_per_gib"].as_f64().unwrap_or(f64::NAN),
                        v["reopen_s_max"].as_f64().unwrap_or(f64::NAN)
                    );
                    data.memory = Some(v);
                }
                Err(e) => {
                    procs::check_interrupted()?;
                    eprintln!("  w5 failed: {e:#}");
                    data.errors.push(format!("w5: {e:#}"));
                }
            }
            continue;
        }
        for round in 0..cfg.rounds {
            let n = cfg.systems.len();
            for i in 0..n {
                let sys = cfg.systems[(i + round) % n];
                if !w.applies(sys) {
                    continue;
                }
                let slow = matches!(sys, Sys::Origin | Sys::NbdkitCache);
                if w == W::Ext4 && slow && round >= cfg.slow_ext4_rounds {
                    continue;
                }
                procs::check_interrupted()?;
                let r = match (w, tar) {
                    (W::Ext4, Some(tar)) => workloads::measure_ext4(cfg, env, tar, sys, round),
                    (W::Ext4, None) => Err(anyhow::anyhow!("no tar built for w2")),
                    (W::ReadUnderWrites, _) => workloads::measure_w8(cfg, env, sys, round),
                    _ => workloads::measure_fio(cfg, env, w, sys, round),
                };
                match r {
                    Ok(m) => {
                        let (k, unit, _) = w.headline();
                        let v = m.m.get(k).copied().unwrap_or(f64::NAN);
                        let g = |k: &str| m.m.get(k).copied().unwrap_or(f64::NAN);
                        let mut extra = match (w, sys) {
                            (W::Seq | W::SeqSustained, Sys::Cairn | Sys::CairnNoWb) => format!(
                                " read_bytes {} write-amp {:.3}",
                                g("daemon_read_bytes"),
                                g("cache_write_amp")
                            ),
                            (
                                W::RandRead
                                | W::RandReadDirect
                                | W::ColdRead
                                | W::ColdReadQd1
                                | W::MultiRead,
                                Sys::Cairn | Sys::CairnDirect,
                            ) => format!(" hit ratio {:.4}", g("hit_ratio")),
                            (W::MultiFsync, Sys::Cairn) => format!(
                                " flushes/barrier {:.2} ({} flushes, {} barriers, {} group_commit_joins)",
                                g("flushes_per_barrier"),
                                g("cairn_flushes"),
                                g("cairn_flush_barriers"),
                                g("cairn_group_commit_joins")
                            ),
                            _ => String::new(),
                        };
                        if matches!(w, W::Seq | W::SeqSustained) {
                            extra.push_str(&format!(
                                " daemon cpu {:.0} us/MB",
                                g("daemon_cpu_us_per_mb")
                            ));
                        }
                        if matches!(w, W::ColdRead | W::ColdReadQd1) {
                            extra.push_str(&format!(
                                " lat mean {:.0} us p99 {:.0} us",
                                g("lat_mean_us"),
                                g("lat_p99_us")
                            ));
                        }
                        if w == W::ReadUnderWrites {
                            extra.push_str(&format!(
                                " (alone {:.0} us: x{:.2}; reader {:.0} IOPS, writers {:.0} IOPS)",
                                g("alone_lat_p99_us"),
                                g("p99_ratio"),
                                g("iops"),
                                g("writer_iops")
                            ));
                        }
                        eprintln!(
                            "  round {} {:<13} {:>10} {unit}  cpu {:.1} us/io  load {:.2}{extra}{}",
                            round + 1,
                            sys.name(),
                            report::fmt_val(k, v),
                            m.m.get("cpu_us_per_io").copied().unwrap_or(f64::NAN),
                            m.m.get("load1").copied().unwrap_or(f64::NAN),
                            if m.notes.is_empty() {
                                String::new()
                            } else {
                                format!("  ({})", m.notes.join("; "))
                            }
                        );
                        data.meas.push(m);
                    }
                    Err(e) => {
                        procs::check_interrupted()?;
                        eprintln!("  round {} {} FAILED: {e:#}", round + 1, sys.name());
                        data.errors.push(format!(
                            "{} round {} {}: {e:#}",
                            w.id(),
                            round + 1,
                            sys.name()
                        ));
                    }
                }
            }
        }
        eprintln!("  ({:.0} s)", t0.elapsed().as_secs_f64());
        // Keep partial results if a later workload dies.
        header["load_end"] = json!(procs::loadavg());
        data.header = header.clone();
        write_outputs(cfg, data)?;
    }
    Ok(())
}
