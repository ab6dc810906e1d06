//! The systems under test and how each is started on the same files.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;

use crate::procs::{self, Daemon};

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, PartialOrd, Ord)]
pub enum Sys {
    Cairn,
    /// cairn with `--no-writeback`: the write path without concurrent
    /// write-back (a diagnostic for W3, not a peer).
    CairnNoWb,
    /// cairn with `--no-page-cache-reads`: cache hits read with O_DIRECT
    /// only (a diagnostic for W4, not a peer).
    CairnDirect,
    NbdkitFile,
    NbdkitCache,
    QemuNbd,
    Origin,
    Raw,
    /// cairn serving with `--tls=require --tls-certificates` (W3, W4).
    CairnTls,
    /// `nbdkit --tls=require --tls-certificates file FAST`: what TLS costs
    /// a peer (W3, W4).
    NbdkitFileTls,
}

pub const ALL: [Sys; 10] = [
    Sys::Cairn,
    Sys::CairnNoWb,
    Sys::CairnDirect,
    Sys::CairnTls,
    Sys::NbdkitFile,
    Sys::NbdkitFileTls,
    Sys::NbdkitCache,
    Sys::QemuNbd,
    Sys::Origin,
    Sys::Raw,
];

impl Sys {
    pub fn name(self) -> &'static str {
        match self {
            Sys::Cairn => "cairn",
            Sys::CairnNoWb => "cairn-nowb",
            Sys::CairnDirect => "cairn-direct",
            Sys::NbdkitFile => "nbdkit-file",
            Sys::NbdkitCache => "nbdkit-cache",
            Sys::QemuNbd => "qemu-nbd",
            Sys::Origin => "origin",
            Sys::Raw => "raw",
            Sys::CairnTls => "cairn-tls",
            Sys::NbdkitFileTls => "nbdkit-file-tls",
        }
    }

    /// Served with TLS: fio connects with `nbds+unix://`.
    pub fn is_tls(self) -> bool {
        matches!(self, Sys::CairnTls | Sys::NbdkitFileTls)
    }

    pub fn from_name(s: &str) -> Option<Sys> {
        ALL.iter().copied().find(|x| x.name() == s)
    }

    pub fn is_cairn(self) -> bool {
        matches!(
            self,
            Sys::Cairn | Sys::CairnNoWb | Sys::CairnDirect | Sys::CairnTls
        )
    }

    pub fn describe(self) -> &'static str {
        match self {
            Sys::Cairn => "cairn serve: FAST formatted as the cache, origin = the slow NBD origin",
            Sys::CairnNoWb => "cairn serve --no-writeback (W3 only, diagnostic: the write path without concurrent write-back)",
            Sys::CairnDirect => "cairn serve --no-page-cache-reads (W4, as a diagnostic, and W4d, as the system under test: cache hits read with O_DIRECT, not through the host page cache)",
            Sys::NbdkitFile => "nbdkit file FAST (the fast file served raw: the practical ceiling)",
            Sys::NbdkitCache => {
                "nbdkit --filter=cache nbd (slow origin), cache-on-read=true, cache-max-size=CACHE"
            }
            Sys::QemuNbd => "qemu-nbd -f raw --cache=none --aio=io_uring FAST",
            Sys::Origin => "the slow origin alone: nbdkit --filter=delay file ORIGIN rdelay wdelay (for W6/W6q1 a second one with -t 64)",
            Sys::Raw => "fio io_uring --direct=1 on FAST (no NBD hop; for ext4: loop --direct-io=on on FAST)",
            Sys::CairnTls => "cairn serve --tls=require --tls-certificates (X.509, TLS 1.3); fio through nbds+unix:// (W3, W4)",
            Sys::NbdkitFileTls => "nbdkit --tls=require --tls-certificates file FAST (GnuTLS): the TLS peer (W3, W4)",
        }
    }
}

/// A running slow origin: its socket and pid (the harness owns it; the
/// measurements only observe it).
#[derive(Clone, Debug)]
pub struct OriginRef {
    pub sock: PathBuf,
    pub pid: u32,
}

impl OriginRef {
    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.sock.display())
    }
}

/// Files, sockets and tools shared by every measurement.
pub struct Env {
    pub dir: PathBuf,
    pub cairn: PathBuf,
    /// The fast file: cairn's cache, and what nbdkit-file, qemu-nbd and raw
    /// fio use (cairn reformats it before each of its measurements).
    pub fast: PathBuf,
    pub fast_bytes: u64,
    pub origin_sock: PathBuf,
    pub origin_pid: u32,
    /// W6's origin: the same file behind `nbdkit -t 64` (the shared one
    /// runs with nbdkit's default thread count), if W6 is selected.
    pub cold_origin: Option<OriginRef>,
    /// The scratch device's /sys inflight file, if found.
    pub inflight: Option<PathBuf>,
    /// TLS credentials, if a TLS system is selected.
    pub tls: Option<TlsFiles>,
}

/// A throwaway CA and server certificate for the TLS systems, and a HOME
/// whose `.pki/libnbd/ca-cert.pem` makes fio's libnbd trust it (fio's nbd
/// engine cannot pass `tls-certificates=`: libnbd refuses local files in
/// URIs unless the caller allows them).
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub server_dir: PathBuf,
    pub client_home: PathBuf,
}

impl TlsFiles {
    /// Made by `scripts/tls-test-pki.sh` (shared with the tests).
    pub fn make(dir: &Path) -> Result<TlsFiles> {
        let root = dir.join("tls");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/tls-test-pki.sh");
        procs::run(Command::new("sh").arg(&script).arg(&root))
            .context("scripts/tls-test-pki.sh: making the bench's certificates")?;
        Ok(TlsFiles {
            server_dir: root.join("server"),
            client_home: root.join("libnbd-home"),
        })
    }
}

impl Env {
    pub fn origin(&self) -> OriginRef {
        OriginRef {
            sock: self.origin_sock.clone(),
            pid: self.origin_pid,
        }
    }

    pub fn sock(&self, sys: Sys) -> PathBuf {
        self.dir.join(format!("{}.sock", sys.name()))
    }

    fn log(&self, sys: Sys) -> PathBuf {
        self.dir.join(format!("{}.log", sys.name()))
    }

    pub fn cairn_cmd(&self) -> Command {
        let mut c = Command::new(&self.cairn);
        // The admin socket lives here, next to everything else of this run.
        c.env("CAIRN_RUNTIME_DIR", &self.dir);
        c
    }

    pub fn cairn_format(&self, cache: &Path) -> Result<()> {
        self.cairn_format_on(cache, &self.origin())
    }

    pub fn cairn_format_on(&self, cache: &Path, origin: &OriginRef) -> Result<()> {
        procs::run(
            self.cairn_cmd()
                .arg("format")
                .arg("--cache")
                .arg(cache)
                .arg("--origin")
                .arg(origin.uri())
                .arg("--force"),
        )
        .context("cairn format")?;
        Ok(())
    }

    pub fn cairn_serve(
        &self,
        cache: &Path,
        sock: &Path,
        extra: &[&str],
    ) -> Result<(Daemon, Duration)> {
        let mut cmd = self.cairn_cmd();
        cmd.arg("serve")
            .arg("--cache")
            .arg(cache)
            .arg("--socket")
            .arg(sock);
        cmd.args(extra);
        Daemon::spawn(
            "cairn",
            &mut cmd,
            sock,
            &self.dir.join("cairn.log"),
            Duration::from_secs(300),
        )
    }

    pub fn cairn_status(&self, cache: &Path) -> Result<Value> {
        let out = procs::run(
            self.cairn_cmd()
                .arg("status")
                .arg("--cache")
                .arg(cache)
                .arg("--json"),
        )?;
        Ok(serde_json::from_str(&out)?)
    }

    /// Starts `sys` fresh. `None` for raw (no daemon). The origin is shared
    /// and returned as an observed daemon (not stopped afterwards).
    pub fn start(&self, sys: Sys) -> Result<Option<Daemon>> {
        self.start_on(sys, &self.origin())
    }

    /// `start` with `origin` as the slow origin: what cairn is formatted
    /// over and what `Sys::Origin` is.
    pub fn start_on(&self, sys: Sys, origin: &OriginRef) -> Result<Option<Daemon>> {
        let sock = self.sock(sys);
        let log = self.log(sys);
        let t = Duration::from_secs(60);
        let d = match sys {
            Sys::Raw => return Ok(None),
            Sys::Origin => Daemon::observed("origin", origin.pid, &origin.sock),
            Sys::Cairn | Sys::CairnNoWb | Sys::CairnDirect | Sys::CairnTls => {
                // Overwrite the head of the log first: `format --force` over
                // a cache that held a log can leave it unopenable ("log
                // damaged: record 1 ... unreadable, but record 66 ... shows
                // it had been made durable"): recovery's scan for lost
                // records accepts records of the previous format.
                crate::workloads::fill_file(&self.fast, 64 << 20, true)?;
                self.cairn_format_on(&self.fast, origin)?;
                let tls_dir = self.tls_server_dir(sys)?;
                let extra: Vec<&str> = match sys {
                    Sys::CairnNoWb => vec!["--no-writeback"],
                    Sys::CairnDirect => vec!["--no-page-cache-reads"],
                    Sys::CairnTls => vec!["--tls=require", "--tls-certificates", &tls_dir],
                    _ => vec![],
                };
                self.cairn_serve(&self.fast, &sock, &extra)?.0
            }
            Sys::NbdkitFile | Sys::NbdkitFileTls => {
                let mut c = Command::new("nbdkit");
                c.args(["-f", "--exit-with-parent", "-U"]).arg(&sock);
                if sys == Sys::NbdkitFileTls {
                    c.arg("--tls=require");
                    c.arg(format!("--tls-certificates={}", self.tls_server_dir(sys)?));
                }
                c.arg("file").arg(format!("file={}", self.fast.display()));
                Daemon::spawn(sys.name(), &mut c, &sock, &log, t)?.0
            }
            Sys::NbdkitCache => {
                // Its cache file lives in TMPDIR: on the same disk as FAST.
                let tmp = self.dir.join("nbdkit-cache-tmp");
                std::fs::create_dir_all(&tmp)?;
                let mut c = Command::new("nbdkit");
                c.env("TMPDIR", &tmp);
                c.args(["-f", "--exit-with-parent", "-U"]).arg(&sock);
                c.arg("--filter=cache");
                c.arg("nbd")
                    .arg(format!("socket={}", self.origin_sock.display()));
                c.arg("cache-on-read=true");
                c.arg(format!("cache-max-size={}", self.fast_bytes));
                Daemon::spawn("nbdkit-cache", &mut c, &sock, &log, t)?.0
            }
            Sys::QemuNbd => {
                let mut c = Command::new("qemu-nbd");
                c.arg("-k").arg(&sock);
                c.args([
                    "-f",
                    "raw",
                    "--cache=none",
                    "--aio=io_uring",
                    "-t",
                    "--shared=8",
                ]);
                c.arg(&self.fast);
                Daemon::spawn("qemu-nbd", &mut c, &sock, &log, t)?.0
            }
        };
        Ok(Some(d))
    }

    /// The server credentials' directory for a TLS system ("" otherwise).
    fn tls_server_dir(&self, sys: Sys) -> Result<String> {
        if !sys.is_tls() {
            return Ok(String::new());
        }
        let tls = self
            .tls
            .as_ref()
            .context("a TLS system without TLS credentials")?;
        Ok(tls.server_dir.display().to_string())
    }

    /// nbdkit's arguments for a slow origin; `threads`: `-t N`, else
    /// nbdkit's default (16).
    pub fn origin_args(
        img: &Path,
        sock: &Path,
        delay_ms: u64,
        threads: Option<u32>,
    ) -> Vec<String> {
        let mut a: Vec<String> = vec!["-f".into(), "--exit-with-parent".into()];
        if let Some(t) = threads {
            a.push("-t".into());
            a.push(t.to_string());
        }
        a.push("-U".into());
        a.push(sock.display().to_string());
        a.push("--filter=delay".into());
        a.push("file".into());
        a.push(format!("file={}", img.display()));
        a.push(format!("rdelay={delay_ms}ms"));
        a.push(format!("wdelay={delay_ms}ms"));
        a
    }

    /// Starts a slow origin (nbdkit with `origin_args`), its log in `log`.
    pub fn start_origin(
        name: &str,
        img: &Path,
        sock: &Path,
        log: &Path,
        delay_ms: u64,
        threads: Option<u32>,
    ) -> Result<Daemon> {
        let mut c = Command::new("nbdkit");
        c.args(Self::origin_args(img, sock, delay_ms, threads));
        Ok(Daemon::spawn(name, &mut c, sock, log, Duration::from_secs(60))?.0)
    }
}
