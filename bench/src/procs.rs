//! Processes, sockets, mounts and /proc: the plumbing of the harness.
//!
//! Every resource the harness creates (daemon, FUSE mount, loop device,
//! filesystem mount) is held by a guard whose `Drop` releases it, so an
//! error or an interrupted run leaves nothing behind.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// SIGINT/SIGTERM set a flag; the harness checks it between steps and
/// unwinds through the guards.
pub fn install_interrupt_handler() {
    let handler = on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

pub fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    Ok(())
}

/// Runs a command to completion; fails on a non-zero exit. Returns stdout.
pub fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs a command, killing it after `timeout`. Returns (elapsed, timed_out).
pub fn run_timed(cmd: &mut Command, timeout: Duration) -> Result<(Duration, bool)> {
    let t0 = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {cmd:?}"))?;
    loop {
        if let Some(st) = child.try_wait()? {
            let elapsed = t0.elapsed();
            if !st.success() {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    use std::io::Read;
                    let _ = e.read_to_string(&mut err);
                }
                bail!("{cmd:?} failed ({st}): {}", err.trim());
            }
            return Ok((elapsed, false));
        }
        if t0.elapsed() > timeout || INTERRUPTED.load(Ordering::SeqCst) {
            let _ = child.kill();
            let _ = child.wait();
            check_interrupted()?;
            return Ok((t0.elapsed(), true));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub fn tool_exists(name: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {name}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

pub fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: plain kill(2) on a pid we spawned.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// A server process the harness started (or, if `owned` is false, one it
/// only observes, such as the shared slow origin).
pub struct Daemon {
    pub name: String,
    pub pid: u32,
    pub sock: PathBuf,
    pub log: PathBuf,
    child: Option<Child>,
}

impl Daemon {
    /// Spawns `cmd` with its output in `log` and waits until `sock` accepts
    /// a connection. Returns the daemon and how long the socket took.
    pub fn spawn(
        name: &str,
        cmd: &mut Command,
        sock: &Path,
        log: &Path,
        timeout: Duration,
    ) -> Result<(Daemon, Duration)> {
        let _ = std::fs::remove_file(sock);
        let f =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let f2 = f.try_clone()?;
        let t0 = Instant::now();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(f)
            .stderr(f2)
            .spawn()
            .with_context(|| format!("spawning {name}: {cmd:?}"))?;
        let mut d = Daemon {
            name: name.to_string(),
            pid: child.id(),
            sock: sock.to_path_buf(),
            log: log.to_path_buf(),
            child: Some(child),
        };
        d.wait_ready(t0, timeout)?;
        Ok((d, t0.elapsed()))
    }

    /// An observed process: never stopped by the harness through this value.
    pub fn observed(name: &str, pid: u32, sock: &Path) -> Daemon {
        Daemon {
            name: name.to_string(),
            pid,
            sock: sock.to_path_buf(),
            log: PathBuf::new(),
            child: None,
        }
    }

    fn wait_ready(&mut self, t0: Instant, timeout: Duration) -> Result<()> {
        loop {
            if UnixStream::connect(&self.sock).is_ok() {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut() {
                if let Some(st) = c.try_wait()? {
                    self.child = None;
                    bail!(
                        "{} exited ({st}) before its socket appeared; log {}:\n{}",
                        self.name,
                        self.log.display(),
                        tail(&self.log, 20)
                    );
                }
            }
            if t0.elapsed() > timeout {
                bail!(
                    "{}: socket {} did not appear within {timeout:?}; log:\n{}",
                    self.name,
                    self.sock.display(),
                    tail(&self.log, 20)
                );
            }
            check_interrupted()?;
            std::thread::sleep(Duration::from_micros(500));
        }
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub fn stop(mut self, grace: Duration) -> Result<()> {
        let Some(mut c) = self.child.take() else {
            return Ok(());
        };
        signal(self.pid, libc::SIGTERM);
        let t0 = Instant::now();
        loop {
            if let Some(st) = c.try_wait()? {
                if !st.success() && st.code().is_some() {
                    eprintln!("  note: {} exited with {st} on SIGTERM", self.name);
                }
                return Ok(());
            }
            if t0.elapsed() > grace {
                eprintln!(
                    "  note: {} ignored SIGTERM for {grace:?}; SIGKILL",
                    self.name
                );
                let _ = c.kill();
                let _ = c.wait();
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGKILL and reap (the crash half of the recovery test).
    pub fn kill9(mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            signal(self.pid, libc::SIGKILL);
            c.wait()?;
        }
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn tail(path: &Path, lines: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// nbdfuse exposing an NBD socket as a file `DIR/nbd`.
pub struct Fuse {
    dir: PathBuf,
    child: Option<Child>,
}

impl Fuse {
    pub fn mount(dir: &Path, sock: &Path, log: &Path) -> Result<Fuse> {
        std::fs::create_dir_all(dir)?;
        let f = std::fs::File::create(log)?;
        let f2 = f.try_clone()?;
        let child = Command::new("nbdfuse")
            .arg(dir.join("nbd"))
            .arg("--unix")
            .arg(sock)
            .stdin(Stdio::null())
            .stdout(f)
            .stderr(f2)
            .spawn()
            .context("spawning nbdfuse")?;
        let mut fuse = Fuse {
            dir: dir.to_path_buf(),
            child: Some(child),
        };
        let t0 = Instant::now();
        loop {
            if std::fs::metadata(fuse.file())
                .map(|m| m.len() > 0)
                .unwrap_or(false)
            {
                return Ok(fuse);
            }
            if let Some(st) = fuse.child.as_mut().unwrap().try_wait()? {
                fuse.child = None;
                bail!("nbdfuse exited ({st}): {}", tail(log, 10));
            }
            if t0.elapsed() > Duration::from_secs(20) {
                bail!("nbdfuse did not mount within 20 s: {}", tail(log, 10));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn file(&self) -> PathBuf {
        self.dir.join("nbd")
    }
}

impl Drop for Fuse {
    fn drop(&mut self) {
        let _ = Command::new("fusermount3")
            .arg("-u")
            .arg(&self.dir)
            .stderr(Stdio::null())
            .status();
        if let Some(mut c) = self.child.take() {
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(10) {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A loop device over a file.
pub struct Loop {
    pub dev: String,
}

impl Loop {
    pub fn attach(file: &Path, size_bytes: u64, direct_io: bool) -> Result<Loop> {
        let mut cmd = Command::new("losetup");
        cmd.arg("-f").arg("--show");
        cmd.arg(format!("--sizelimit={size_bytes}"));
        if direct_io {
            cmd.arg("--direct-io=on");
        }
        cmd.arg(file);
        let dev = run(&mut cmd)?.trim().to_string();
        if !dev.starts_with("/dev/loop") {
            bail!("losetup printed {dev:?}");
        }
        Ok(Loop { dev })
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

/// A mounted filesystem.
pub struct Mount {
    pub dir: PathBuf,
    mounted: bool,
}

impl Mount {
    pub fn new(dev: &str, dir: &Path, opts: &str) -> Result<Mount> {
        std::fs::create_dir_all(dir)?;
        run(Command::new("mount").arg("-o").arg(opts).arg(dev).arg(dir))?;
        Ok(Mount {
            dir: dir.to_path_buf(),
            mounted: true,
        })
    }

    /// Unmounts; returns how long it took.
    pub fn unmount(mut self) -> Result<Duration> {
        let t0 = Instant::now();
        run(Command::new("umount").arg(&self.dir))?;
        self.mounted = false;
        Ok(t0.elapsed())
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new("umount").arg(&self.dir).status();
        }
    }
}

// ---- /proc ----

/// utime + stime of the whole process (all threads, live and dead), ticks.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the comm field: state is field 3, utime 14, stime 15.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

pub fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// (read_bytes, write_bytes) from /proc/PID/io: bytes this process caused
/// to be fetched from / sent to the storage layer.
pub fn io_bytes(pid: u32) -> Option<(u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    let get = |k: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    Some((get("read_bytes:")?, get("write_bytes:")?))
}

/// A `kB` field of /proc/PID/status (VmRSS, VmHWM, ...), in KiB.
pub fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find_map(|l| {
        let v = l.strip_prefix(key)?.strip_prefix(':')?;
        v.trim().trim_end_matches("kB").trim().parse().ok()
    })
}

pub fn loadavg() -> [f64; 3] {
    let s = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut it = s.split_whitespace().map(|x| x.parse().unwrap_or(f64::NAN));
    [
        it.next().unwrap_or(f64::NAN),
        it.next().unwrap_or(f64::NAN),
        it.next().unwrap_or(f64::NAN),
    ]
}

/// `/sys/dev/block/MAJ:MIN/inflight` of the block device holding `dir`.
pub fn inflight_path(dir: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(dir).ok()?.dev();
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let p = PathBuf::from(format!("/sys/dev/block/{major}:{minor}/inflight"));
    p.exists().then_some(p)
}

/// Samples the device's in-flight reads and writes every 2 ms while a
/// measurement runs: the queue depth the device actually sees.
pub struct InflightSampler {
    stop: std::sync::Arc<AtomicBool>,
    handle: std::thread::JoinHandle<(u64, u64, u64, u64)>,
}

pub struct Inflight {
    pub reads_mean: f64,
    pub writes_mean: f64,
    pub busy_fraction: f64,
}

impl InflightSampler {
    pub fn start(path: Option<&Path>) -> Option<InflightSampler> {
        let path = path?.to_path_buf();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let handle = std::thread::spawn(move || {
            let (mut n, mut r, mut w, mut busy) = (0u64, 0u64, 0u64, 0u64);
            while !stop2.load(Ordering::Relaxed) {
                if let Ok(s) = std::fs::read_to_string(&path) {
                    let mut it = s.split_whitespace().map(|x| x.parse::<u64>().unwrap_or(0));
                    let (a, b) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
                    n += 1;
                    r += a;
                    w += b;
                    busy += u64::from(a + b > 0);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            (n, r, w, busy)
        });
        Some(InflightSampler { stop, handle })
    }

    pub fn finish(self) -> Option<Inflight> {
        self.stop.store(true, Ordering::Relaxed);
        let (n, r, w, busy) = self.handle.join().ok()?;
        (n > 0).then(|| Inflight {
            reads_mean: r as f64 / n as f64,
            writes_mean: w as f64 / n as f64,
            busy_fraction: busy as f64 / n as f64,
        })
    }
}

/// An exclusive lock on the scratch directory, held for the whole run: two
/// harnesses sharing one directory would delete each other's files and
/// replace each other's sockets.
pub struct DirLock {
    _file: std::fs::File,
}

impl DirLock {
    pub fn acquire(dir: &Path) -> Result<DirLock> {
        use std::os::unix::io::AsRawFd;
        let path = dir.join(".cairn-bench.lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: flock on a descriptor we own.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            bail!(
                "another cairn-bench is using {} (lock {} is held); wait for it or pass --dir",
                dir.display(),
                path.display()
            );
        }
        Ok(DirLock { _file: file })
    }
}
