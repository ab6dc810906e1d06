//! Shared helpers for the end-to-end tests of the real `cairn` binary.
//!
//! - [`Ctx`]: a unique temporary directory per test, with its own
//!   `CAIRN_RUNTIME_DIR` (admin sockets live there), so parallel tests never
//!   see each other's daemons.
//! - [`Proc`]: a child process that is always killed (SIGKILL) and reaped
//!   when the guard is dropped, also when the test panics.
//! - [`Server`]: `cairn serve` started as a child; ready once its socket
//!   appears and accepts connections.
//! - [`require_tools`]: a missing external tool skips the test with a
//!   printed message, except with `CI=true`, where it fails the test.
//! - [`FuseDevice`]: a file served by nbdkit (with filters that make it
//!   fail) through nbdfuse, for a cache device that really fails.
//! - Small clients for NBD through python3-libnbd (`nbd_write`, `nbd_read`).
#![allow(dead_code)]

mod ceph;
mod fuse_device;
pub mod raw_nbd;
pub mod tls;
#[allow(unused_imports)]
pub use ceph::{require_ceph, CephCluster};
#[allow(unused_imports)]
pub use fuse_device::{require_fuse_device, FuseDevice};

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub const CAIRN: &str = env!("CARGO_BIN_EXE_cairn");

/// Default bound for one cairn command or one client tool run.
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(120);

// ------------------------------------------------------------ skipping ---

pub fn in_ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// A precondition is missing: skip the test with a message (returns false),
/// or, under `CI=true`, fail it.
pub fn skip(test: &str, why: &str) -> bool {
    if in_ci() {
        panic!("{test}: {why}; CI=true requires this test to run, so it fails instead of skipping");
    }
    // Straight to fd 2: libtest captures eprintln! of passing tests, and a
    // skip must be visible in the normal test output.
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
    false
}

/// Where an external tool lives: PATH, then the sbin directories (mkfs,
/// losetup and fsck live there and are not always on a user's PATH).
///
/// `CAIRN_TEST_HIDE_TOOLS=fio,nbdkit` pretends those are not installed, to
/// exercise the skip (and, with CI=true, fail) paths on a full machine.
pub fn tool_path(name: &str) -> Option<PathBuf> {
    if std::env::var("CAIRN_TEST_HIDE_TOOLS")
        .unwrap_or_default()
        .split(',')
        .any(|t| t.trim() == name)
    {
        return None;
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    for extra in ["/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        dirs.push(PathBuf::from(extra));
    }
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}

/// True if every tool is installed; else skip (or fail under CI).
pub fn require_tools(test: &str, tools: &[&str]) -> bool {
    let missing: Vec<&str> = tools
        .iter()
        .copied()
        .filter(|t| tool_path(t).is_none())
        .collect();
    if missing.is_empty() {
        return true;
    }
    skip(test, &format!("missing tool(s): {}", missing.join(", ")))
}

/// The python that has python3-libnbd (the system one, not a pyenv shim).
pub fn python() -> PathBuf {
    let system = PathBuf::from("/usr/bin/python3");
    if system.is_file() {
        system
    } else {
        tool_path("python3").unwrap_or(system)
    }
}

/// Run a python3-libnbd `script` with `args` (`sys.argv[1:]`) to its end;
/// it must succeed.
pub fn python_ok(script: &str, args: &[&str]) -> Output {
    run_ok(
        Command::new(python()).arg("-c").arg(script).args(args),
        TOOL_TIMEOUT,
    )
}

/// True if `nbdsh` is installed and python3-libnbd imports.
pub fn require_python_nbd(test: &str) -> bool {
    if !require_tools(test, &["nbdsh"]) {
        return false;
    }
    let ok = Command::new(python())
        .args(["-c", "import nbd"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    ok || skip(test, "python3-libnbd (import nbd) is not importable")
}

// ---------------------------------------------------------- directories ---

static DIR_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A unique temporary directory, removed on drop unless the test failed
/// (then it is kept and its path printed) or CAIRN_TEST_KEEP is set.
pub struct TestDir {
    pub path: PathBuf,
}

impl TestDir {
    pub fn new(test: &str) -> TestDir {
        // Unix socket paths are limited to 108 bytes: keep the name short.
        let short: String = test
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
            .take(20)
            .collect();
        let n = DIR_COUNTER.fetch_add(1, Ordering::SeqCst);
        let path =
            std::env::temp_dir().join(format!("cairn-e2e-{}-{n}-{short}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
        TestDir { path }
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var_os("CAIRN_TEST_KEEP").is_some() {
            eprintln!("test files kept in {}", self.path.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

// ------------------------------------------------------------ processes ---

/// A child process with its stdout and stderr in a log file. Dropping the
/// guard kills it with SIGKILL and reaps it; if the test is failing, the
/// log is printed.
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    pub log: PathBuf,
    status: Option<ExitStatus>,
}

impl Proc {
    pub fn spawn(name: &str, cmd: &mut Command, log: PathBuf) -> Proc {
        let out = std::fs::File::create(&log)
            .unwrap_or_else(|e| panic!("creating {}: {e}", log.display()));
        let err = out.try_clone().expect("cloning a log file handle");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}"));
        Proc {
            name: name.to_string(),
            child: Some(child),
            log,
            status: None,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map(|c| c.id() as i32).unwrap_or(-1)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: kill(2) on our own child's pid; it is not reaped yet,
            // so the pid cannot have been reused.
            unsafe {
                libc::kill(c.id() as i32, sig);
            }
        }
    }

    /// Exited already? Returns its status without blocking.
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(s)) = c.try_wait() {
                    self.status = Some(s);
                    self.child = None;
                }
            }
        }
        self.status
    }

    /// Wait (bounded) for the process to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_status() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            if let Ok(s) = c.wait() {
                self.status = Some(s);
            }
        }
    }

    /// SIGTERM, then wait for the exit status (SIGKILL after `timeout`,
    /// which fails the test).
    pub fn terminate(&mut self, timeout: Duration) -> ExitStatus {
        self.signal(libc::SIGTERM);
        match self.wait_timeout(timeout) {
            Some(s) => s,
            None => {
                self.kill9();
                panic!(
                    "{} did not exit within {timeout:?} of SIGTERM; log:\n{}",
                    self.name,
                    self.log_text()
                );
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            eprintln!(
                "--- log of {} ({}):\n{}",
                self.name,
                self.log.display(),
                self.log_text()
            );
        }
    }
}

/// Run a command to completion with a bound on its run time; stdin gets
/// `input`. A command that overruns is killed and fails the test.
pub fn run_with_input(cmd: &mut Command, input: &[u8], timeout: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let mut stdin = child.stdin.take().expect("piped stdin");
    let input = input.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let mut so = child.stdout.take().expect("piped stdout");
    let mut se = child.stderr.take().expect("piped stderr");
    let r_out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = so.read_to_end(&mut v);
        v
    });
    let r_err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = se.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                let err = r_err.join().unwrap_or_default();
                panic!(
                    "{cmd:?} did not finish within {timeout:?}; stderr:\n{}",
                    String::from_utf8_lossy(&err)
                );
            }
        }
    };
    let _ = writer.join();
    Output {
        status,
        stdout: r_out.join().unwrap_or_default(),
        stderr: r_err.join().unwrap_or_default(),
    }
}

pub fn run(cmd: &mut Command, timeout: Duration) -> Output {
    run_with_input(cmd, &[], timeout)
}

pub fn describe(out: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Run and require success.
pub fn run_ok(cmd: &mut Command, timeout: Duration) -> Output {
    let out = run(cmd, timeout);
    assert!(out.status.success(), "{cmd:?} failed: {}", describe(&out));
    out
}

/// An external tool by its resolved path, with the system python first on
/// PATH (nbdsh and friends need python3-libnbd).
pub fn tool(name: &str) -> Command {
    let path = tool_path(name).unwrap_or_else(|| PathBuf::from(name));
    let mut cmd = Command::new(path);
    let old = std::env::var("PATH").unwrap_or_default();
    cmd.env("PATH", format!("/usr/bin:/bin:/usr/sbin:/sbin:{old}"));
    cmd
}

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A command failed the way a user error should: non-zero exit code (not
/// a signal, not a panic), stderr free of "panicked", and naming each of
/// `needles` (case-insensitive).
pub fn assert_clean_failure(out: &Output, needles: &[&str]) {
    let err = stderr(out);
    assert!(!out.status.success(), "expected failure: {}", describe(out));
    assert!(
        out.status.signal().is_none(),
        "killed by a signal: {}",
        describe(out)
    );
    assert_ne!(
        out.status.code(),
        Some(101),
        "exit code 101 is a panic: {}",
        describe(out)
    );
    assert!(!err.contains("panicked"), "panicked: {}", describe(out));
    let lower = err.to_lowercase();
    for n in needles {
        assert!(
            lower.contains(&n.to_lowercase()),
            "stderr does not mention {n:?}: {}",
            describe(out)
        );
    }
}

// ---------------------------------------------------------------- cairn ---

/// One test's world: a temporary directory and a runtime directory for the
/// daemons it starts.
pub struct Ctx {
    pub name: String,
    pub runtime: PathBuf,
    serial: AtomicU64,
    pub dir: TestDir,
}

impl Ctx {
    pub fn new(name: &str) -> Ctx {
        let dir = TestDir::new(name);
        let runtime = dir.path.join("run");
        std::fs::create_dir_all(&runtime).expect("creating the runtime dir");
        Ctx {
            name: name.to_string(),
            runtime,
            serial: AtomicU64::new(0),
            dir,
        }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path.join(rel)
    }

    /// A sparse file of `size_bytes` (zeroes).
    pub fn file(&self, rel: &str, size_bytes: u64) -> PathBuf {
        let p = self.path(rel);
        let f = std::fs::File::create(&p).unwrap_or_else(|e| panic!("creating {rel}: {e}"));
        f.set_len(size_bytes).expect("sizing a test file");
        p
    }

    /// `cairn ARGS` with this test's runtime dir and plain logs.
    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(CAIRN);
        cmd.args(args)
            .env("CAIRN_RUNTIME_DIR", &self.runtime)
            .env("NO_COLOR", "1")
            .env_remove("LISTEN_FDS")
            .env_remove("LISTEN_PID")
            .current_dir(&self.dir.path);
        cmd
    }

    pub fn cairn(&self, args: &[&str]) -> Output {
        run(&mut self.cmd(args), TOOL_TIMEOUT)
    }

    pub fn cairn_ok(&self, args: &[&str]) -> Output {
        let out = self.cairn(args);
        assert!(
            out.status.success(),
            "cairn {args:?} failed: {}",
            describe(&out)
        );
        out
    }

    pub fn format(&self, cache: &Path, origin: &str, extra: &[&str]) {
        let c = cache.to_string_lossy();
        let mut args = vec!["format", "--cache", &c, "--origin", origin];
        args.extend_from_slice(extra);
        self.cairn_ok(&args);
    }

    /// A formatted pair of sparse files: (cache, origin).
    pub fn setup(&self, cache_bytes: u64, origin_bytes: u64) -> (PathBuf, PathBuf) {
        let cache = self.file("cache.img", cache_bytes);
        let origin = self.file("origin.img", origin_bytes);
        self.format(&cache, &origin.to_string_lossy(), &[]);
        (cache, origin)
    }

    /// `cairn status --cache C --json`, parsed.
    pub fn status(&self, cache: &Path) -> serde_json::Value {
        let out = self.cairn_ok(&["status", "--cache", &cache.to_string_lossy(), "--json"]);
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("status --json is not JSON ({e}): {}", describe(&out)))
    }

    pub fn flush(&self, cache: &Path) -> Output {
        self.cairn_ok(&["flush", "--cache", &cache.to_string_lossy()])
    }

    fn next_serial(&self) -> u64 {
        self.serial.fetch_add(1, Ordering::SeqCst)
    }

    /// Spawn `cairn serve --cache C --socket S EXTRA` without waiting.
    pub fn spawn_serve(&self, cache: &Path, socket: &Path, extra: &[&str]) -> Proc {
        self.spawn_serve_env(cache, socket, extra, &[])
    }

    /// [`Ctx::spawn_serve`] with more environment variables.
    pub fn spawn_serve_env(
        &self,
        cache: &Path,
        socket: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Proc {
        let c = cache.to_string_lossy();
        let s = socket.to_string_lossy();
        let mut args = vec!["serve", "--cache", &c, "--socket", &s];
        args.extend_from_slice(extra);
        let mut cmd = self.cmd(&args);
        cmd.env("CAIRN_LOG", serve_log_filter());
        cmd.envs(env.iter().copied());
        let log = self.path(&format!("serve-{}.log", self.next_serial()));
        Proc::spawn("cairn serve", &mut cmd, log)
    }

    /// Start `cairn serve` and wait until it accepts connections.
    pub fn serve(&self, cache: &Path, socket: &Path, extra: &[&str]) -> Server {
        self.serve_env(cache, socket, extra, &[])
    }

    /// [`Ctx::serve`] with more environment variables.
    pub fn serve_env(
        &self,
        cache: &Path,
        socket: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Server {
        let proc = self.spawn_serve_env(cache, socket, extra, env);
        let mut server = Server {
            proc,
            socket: socket.to_path_buf(),
            cache: cache.to_path_buf(),
        };
        server.wait_ready();
        server
    }

    /// Start `cairn serve --listen 127.0.0.1:PORT` (a free port) and wait
    /// until it accepts; returns the process and the address.
    pub fn serve_tcp(&self, cache: &Path, extra: &[&str]) -> (Proc, String) {
        let addr = format!("127.0.0.1:{}", free_port());
        let c = cache.to_string_lossy();
        let mut args = vec!["serve", "--cache", &c, "--listen", &addr];
        args.extend_from_slice(extra);
        let mut cmd = self.cmd(&args);
        cmd.env("CAIRN_LOG", serve_log_filter());
        let mut proc = self.spawn("serve-tcp", &mut cmd);
        let up = eventually(Duration::from_secs(60), || {
            std::net::TcpStream::connect(&addr).is_ok() || proc.try_status().is_some()
        });
        assert!(
            up && proc.try_status().is_none(),
            "cairn serve --listen {addr} did not start: {}",
            proc.log_text()
        );
        (proc, addr)
    }

    /// Start any helper process (nbdkit, fio...) with a log in the test dir.
    pub fn spawn(&self, name: &str, cmd: &mut Command) -> Proc {
        let log = self.path(&format!("{name}-{}.log", self.next_serial()));
        Proc::spawn(name, cmd, log)
    }
}

/// `cairn serve` running as a child.
pub struct Server {
    pub proc: Proc,
    pub socket: PathBuf,
    pub cache: PathBuf,
}

impl Server {
    pub fn uri(&self) -> String {
        nbd_unix_uri(&self.socket)
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(s) = self.proc.try_status() {
                panic!(
                    "cairn serve exited ({s:?}) before its socket appeared; log:\n{}",
                    self.proc.log_text()
                );
            }
            if self.socket.exists() && UnixStream::connect(&self.socket).is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "cairn serve: socket {} did not appear within 60 s; log:\n{}",
                self.socket.display(),
                self.proc.log_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn kill9(&mut self) {
        self.proc.kill9();
    }

    pub fn terminate(&mut self) -> ExitStatus {
        self.proc.terminate(Duration::from_secs(60))
    }
}

pub fn nbd_unix_uri(socket: &Path) -> String {
    format!("nbd+unix:///?socket={}", socket.display())
}

/// Wait (bounded) until `path` exists.
pub fn wait_for_path(path: &Path, proc: &mut Proc) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        if let Some(s) = proc.try_status() {
            panic!(
                "{} exited ({s:?}) before {} appeared; log:\n{}",
                proc.name,
                path.display(),
                proc.log_text()
            );
        }
        assert!(
            Instant::now() < deadline,
            "{} did not appear within 30 s; {} log:\n{}",
            path.display(),
            proc.name,
            proc.log_text()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Poll `cond` until it holds or `timeout` passes; returns whether it held.
pub fn eventually(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Start `nbdkit -f -U SOCK ARGS` and wait for its socket.
pub fn start_nbdkit(ctx: &Ctx, socket: &Path, args: &[&str]) -> Proc {
    let mut cmd = tool("nbdkit");
    cmd.arg("-f").arg("-U").arg(socket).args(args);
    let mut p = ctx.spawn("nbdkit", &mut cmd);
    wait_for_path(socket, &mut p);
    // The file appears at bind(), a moment before listen(): wait until a
    // connection is accepted.
    assert!(
        eventually(Duration::from_secs(30), || UnixStream::connect(socket)
            .is_ok()),
        "nbdkit does not accept connections on {}; log:\n{}",
        socket.display(),
        p.log_text()
    );
    p
}

/// fio over `uri`: 4 KiB random writes over [0, 8 MiB), each followed by
/// a flush, with crc32c verify headers and a fixed seed, to completion
/// (`verify_only`: the verify pass of those same writes). The region is
/// written and flushed whole before anything is cut, so every block of it
/// may be verified after a crash.
pub fn fio_verified_args(uri: &str, seed: u64, verify_only: bool) -> Vec<String> {
    let mut a: Vec<String> = [
        "--name=verified",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=1",
        "--offset=0",
        "--size=8M",
        "--fsync=1",
        // fio's fsync=1 flushes before the next write, so the last write
        // would go unflushed (found when a kill -9 right after fio lost
        // exactly fio's last block): a final flush ends the job.
        "--end_fsync=1",
        "--verify=crc32c",
        &format!("--randseed={seed}"),
        "--output-format=json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.push(
        if verify_only {
            "--verify_only"
        } else {
            "--do_verify=0"
        }
        .into(),
    );
    a
}

// ---------------------------------------------------------------- data ---

/// Deterministic pseudo-random bytes (splitmix64), so every run writes the
/// same data and a failure reproduces.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xdead_beef;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        out.extend_from_slice(&z.to_le_bytes());
    }
    out.truncate(len);
    out
}

pub fn read_range(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, offset)
        .unwrap_or_else(|e| panic!("reading {} at {offset}: {e}", path.display()));
    buf
}

/// Assert two byte strings are equal, reporting the first difference
/// instead of dumping megabytes.
#[track_caller]
pub fn assert_same_bytes(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i}: got {:#04x}, want {:#04x}",
            got[i], want[i]
        );
    }
}

// ------------------------------------------------------ python3-libnbd ---

const PY_WRITE: &str = r#"
import nbd, sys
uri, off, flush = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
data = sys.stdin.buffer.read()
h = nbd.NBD()
h.connect_uri(uri)
step = 4 << 20
for i in range(0, len(data), step):
    h.pwrite(data[i:i + step], off + i)
if flush:
    h.flush()
h.shutdown()
"#;

const PY_READ: &str = r#"
import nbd, sys
uri, off, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
h = nbd.NBD()
h.connect_uri(uri)
step = 4 << 20
out = sys.stdout.buffer
for i in range(0, n, step):
    out.write(h.pread(min(step, n - i), off + i))
out.flush()
h.shutdown()
"#;

/// Write `data` at `offset` through NBD (python3-libnbd), then FLUSH if
/// asked.
pub fn nbd_write(uri: &str, offset: u64, data: &[u8], flush: bool) {
    let out = try_nbd_write(uri, offset, data, flush);
    assert!(
        out.status.success(),
        "nbd write at {offset} failed: {}",
        describe(&out)
    );
}

/// Read `len` bytes at `offset` through NBD.
pub fn nbd_read(uri: &str, offset: u64, len: usize) -> Vec<u8> {
    let out = try_nbd_read(uri, offset, len);
    assert!(
        out.status.success(),
        "nbd read at {offset} failed: {}",
        describe(&out)
    );
    assert_eq!(out.stdout.len(), len, "short NBD read");
    out.stdout
}

/// [`nbd_write`], whatever its outcome.
pub fn try_nbd_write(uri: &str, offset: u64, data: &[u8], flush: bool) -> Output {
    let mut cmd = Command::new(python());
    cmd.args([
        "-c",
        PY_WRITE,
        uri,
        &offset.to_string(),
        if flush { "1" } else { "0" },
    ]);
    run_with_input(&mut cmd, data, TOOL_TIMEOUT)
}

pub fn try_nbd_read(uri: &str, offset: u64, len: usize) -> Output {
    let mut cmd = Command::new(python());
    cmd.args(["-c", PY_READ, uri, &offset.to_string(), &len.to_string()]);
    run(&mut cmd, TOOL_TIMEOUT)
}

/// A free TCP port on loopback (bound, then released).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("binding an ephemeral port");
    l.local_addr().expect("local addr").port()
}

/// The JSON object in a tool's stdout (fio prints a line before it).
pub fn json_in(text: &str) -> serde_json::Value {
    let start = text
        .find('{')
        .unwrap_or_else(|| panic!("no JSON in:\n{text}"));
    serde_json::from_str(&text[start..]).unwrap_or_else(|e| panic!("bad JSON ({e}):\n{text}"))
}

pub fn u64_of(v: &serde_json::Value, key: &str) -> u64 {
    v.get(key)
        .and_then(|x| x.as_u64())
        .unwrap_or_else(|| panic!("{key} missing or not a number in {v}"))
}

/// The daemon's log filter in tests: `info`, or `CAIRN_TEST_LOG` when set
/// (e.g. `cairn_nbd=trace,info` to see every request and reply of a
/// failing run in its serve log).
pub fn serve_log_filter() -> String {
    std::env::var("CAIRN_TEST_LOG").unwrap_or_else(|_| "info".to_string())
}

/// A loop device over a file, detached when dropped.
pub struct LoopDevice(pub String);

impl LoopDevice {
    /// Attach `backing` (read-only if asked), or skip `test` (and fail
    /// under CI) without losetup, root, or loop devices (a container may
    /// deny them even to root).
    pub fn attach(test: &str, backing: &Path, read_only: bool) -> Option<LoopDevice> {
        if !require_tools(test, &["losetup"]) {
            return None;
        }
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            skip(test, "losetup needs root");
            return None;
        }
        let mut cmd = tool("losetup");
        if read_only {
            cmd.arg("--read-only");
        }
        let out = run(cmd.args(["--find", "--show"]).arg(backing), TOOL_TIMEOUT);
        if !out.status.success() {
            skip(test, &format!("losetup failed: {}", describe(&out)));
            return None;
        }
        Some(LoopDevice(stdout(&out).trim().to_string()))
    }

    /// Attach `backing` at the loop device `path` (free), or skip `test`
    /// (and fail under CI) as [`LoopDevice::attach`] does.
    pub fn attach_at(test: &str, path: &str, backing: &Path) -> Option<LoopDevice> {
        if !require_tools(test, &["losetup"]) {
            return None;
        }
        let out = run(tool("losetup").arg(path).arg(backing), TOOL_TIMEOUT);
        if !out.status.success() {
            skip(test, &format!("losetup {path} failed: {}", describe(&out)));
            return None;
        }
        Some(LoopDevice(path.to_string()))
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = tool("losetup").args(["-d", &self.0]).status();
    }
}
