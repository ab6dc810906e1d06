//! A device that can fail on demand, as a file: nbdkit serves a backing
//! file through the filters a test asks for (protect, error...) and
//! nbdfuse exposes the export as `<mountpoint>/nbd`, so `cairn` opens it
//! like any cache file (io_uring, O_DIRECT) and meets real I/O errors.

use std::path::PathBuf;
use std::time::Duration;

use super::*;

pub struct FuseDevice {
    nbdkit: Proc,
    nbdfuse: Proc,
    mountpoint: PathBuf,
    mounted: bool,
}

impl FuseDevice {
    /// `nbdkit NBDKIT_ARGS` on `<name>.sock`, mounted at `<name>-fuse/`.
    pub fn start(ctx: &Ctx, name: &str, nbdkit_args: &[&str]) -> FuseDevice {
        let socket = ctx.path(&format!("{name}.sock"));
        let nbdkit = start_nbdkit(ctx, &socket, nbdkit_args);
        let mountpoint = ctx.path(&format!("{name}-fuse"));
        std::fs::create_dir_all(&mountpoint).expect("mkdir for the FUSE mount");
        let pidfile = ctx.path(&format!("{name}-nbdfuse.pid"));
        let mut nbdfuse = ctx.spawn(
            "nbdfuse",
            tool("nbdfuse")
                .arg("-P")
                .arg(&pidfile)
                .arg(&mountpoint)
                .arg("--unix")
                .arg(&socket),
        );
        wait_for_path(&pidfile, &mut nbdfuse);
        let file = mountpoint.join("nbd");
        assert!(
            eventually(Duration::from_secs(30), || file.exists()),
            "{} did not appear",
            file.display()
        );
        FuseDevice {
            nbdkit,
            nbdfuse,
            mountpoint,
            mounted: true,
        }
    }

    /// The device, as a file.
    pub fn file(&self) -> PathBuf {
        self.mountpoint.join("nbd")
    }

    /// Unmount, then stop nbdkit.
    pub fn stop(&mut self) {
        if self.mounted {
            run_ok(
                tool("fusermount3").arg("-u").arg(&self.mountpoint),
                TOOL_TIMEOUT,
            );
            self.mounted = false;
            assert!(
                self.nbdfuse.wait_timeout(Duration::from_secs(30)).is_some(),
                "nbdfuse did not exit after fusermount3 -u"
            );
        }
        self.nbdkit.kill9();
    }
}

impl Drop for FuseDevice {
    fn drop(&mut self) {
        if self.mounted {
            for args in [&["-u"][..], &["-u", "-z"][..]] {
                let _ = tool("fusermount3")
                    .args(args)
                    .arg(&self.mountpoint)
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .status();
            }
        }
    }
}

/// nbdkit, nbdfuse, fusermount3 and a usable /dev/fuse, or a skip (a
/// failure under CI=true).
pub fn require_fuse_device(test: &str) -> bool {
    if !require_tools(test, &["nbdkit", "nbdfuse", "fusermount3"]) {
        return false;
    }
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
    {
        return skip(test, &format!("/dev/fuse is unusable: {e}"));
    }
    true
}
