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
}

pub const ALL: [Sys; 8] = [
    Sys::Cairn,
    Sys::CairnNoWb,
    Sys::CairnDirect,
    Sys::NbdkitFile,
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
        }
    }

    pub fn from_name(s: &str) -> Option<Sys> {
        ALL.iter().copied().find(|x| x.name() == s)
    }

    pub fn is_cairn(self) -> bool {
        matches!(self, Sys::Cairn | Sys::CairnNoWb | Sys::CairnDirect)
    }

    pub fn describe(self) -> &'static str {
        match self {
            Sys::Cairn => "cairn serve: FAST formatted as the cache, origin = the slow NBD origin",
            Sys::CairnNoWb => "cairn serve --no-writeback (W3 only, diagnostic: the write path without concurrent write-back)",
            Sys::CairnDirect => "cairn serve --no-page-cache-reads (W4 only, diagnostic: cache hits read with O_DIRECT, not through the host page cache)",
            Sys::NbdkitFile => "nbdkit file FAST (the fast file served raw: the practical ceiling)",
            Sys::NbdkitCache => {
                "nbdkit --filter=cache nbd (slow origin), cache-on-read=true, cache-max-size=CACHE"
            }
            Sys::QemuNbd => "qemu-nbd -f raw --cache=none --aio=io_uring FAST",
            Sys::Origin => "the slow origin alone: nbdkit --filter=delay file ORIGIN rdelay wdelay",
            Sys::Raw => "fio io_uring --direct=1 on FAST (no NBD hop; for ext4: loop --direct-io=on on FAST)",
        }
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
    /// The scratch device's /sys inflight file, if found.
    pub inflight: Option<PathBuf>,
}

impl Env {
    pub fn origin_uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.origin_sock.display())
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
        procs::run(
            self.cairn_cmd()
                .arg("format")
                .arg("--cache")
                .arg(cache)
                .arg("--origin")
                .arg(self.origin_uri())
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
        let sock = self.sock(sys);
        let log = self.log(sys);
        let t = Duration::from_secs(60);
        let d = match sys {
            Sys::Raw => return Ok(None),
            Sys::Origin => Daemon::observed("origin", self.origin_pid, &self.origin_sock),
            Sys::Cairn | Sys::CairnNoWb | Sys::CairnDirect => {
                // Overwrite the head of the log first: `format --force` over
                // a cache that held a log can leave it unopenable ("log
                // damaged: record 1 ... unreadable, but record 66 ... shows
                // it had been made durable"): recovery's scan for lost
                // records accepts records of the previous format.
                crate::workloads::fill_file(&self.fast, 64 << 20, true)?;
                self.cairn_format(&self.fast)?;
                let extra: &[&str] = match sys {
                    Sys::CairnNoWb => &["--no-writeback"],
                    Sys::CairnDirect => &["--no-page-cache-reads"],
                    _ => &[],
                };
                self.cairn_serve(&self.fast, &sock, extra)?.0
            }
            Sys::NbdkitFile => {
                let mut c = Command::new("nbdkit");
                c.args(["-f", "--exit-with-parent", "-U"]).arg(&sock);
                c.arg("file").arg(format!("file={}", self.fast.display()));
                Daemon::spawn("nbdkit-file", &mut c, &sock, &log, t)?.0
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

    /// Starts the shared slow origin.
    pub fn start_origin(dir: &Path, img: &Path, sock: &Path, delay_ms: u64) -> Result<Daemon> {
        let mut c = Command::new("nbdkit");
        c.args(["-f", "--exit-with-parent", "-U"]).arg(sock);
        c.arg("--filter=delay");
        c.arg("file").arg(format!("file={}", img.display()));
        c.arg(format!("rdelay={delay_ms}ms"));
        c.arg(format!("wdelay={delay_ms}ms"));
        Ok(Daemon::spawn(
            "origin",
            &mut c,
            sock,
            &dir.join("origin.log"),
            Duration::from_secs(60),
        )?
        .0)
    }
}
