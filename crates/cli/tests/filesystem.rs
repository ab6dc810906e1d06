//! A real filesystem on the cairn volume: nbdfuse exposes the export as a
//! file, a loop device turns it into a block device, ext4 goes on top.
//! Needs root, /dev/fuse and loop devices; skips without them (fails
//! under CI=true).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

const MIB: u64 = 1 << 20;

/// Undo every mount, loop device and FUSE mount on drop, in that order,
/// also when the test fails half way.
#[derive(Default)]
struct Teardown {
    mounts: Vec<PathBuf>,
    loops: Vec<String>,
    fuse: Vec<PathBuf>,
}

impl Teardown {
    fn umount(&mut self, dir: &Path) {
        run_ok(tool("umount").arg(dir), TOOL_TIMEOUT);
        self.mounts.retain(|m| m != dir);
    }

    fn detach(&mut self, dev: &str) {
        run_ok(tool("losetup").args(["-d", dev]), TOOL_TIMEOUT);
        self.loops.retain(|l| l != dev);
    }

    fn fuse_unmount(&mut self, dir: &Path) {
        run_ok(tool("fusermount3").arg("-u").arg(dir), TOOL_TIMEOUT);
        self.fuse.retain(|m| m != dir);
    }
}

impl Drop for Teardown {
    fn drop(&mut self) {
        let quiet = |cmd: &mut Command| {
            let _ = cmd
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
        };
        for m in self.mounts.drain(..).rev() {
            quiet(tool("umount").arg(&m));
            quiet(tool("umount").arg("-l").arg(&m));
        }
        for l in self.loops.drain(..) {
            quiet(tool("losetup").args(["-d", &l]));
        }
        for f in self.fuse.drain(..) {
            quiet(tool("fusermount3").arg("-u").arg(&f));
            quiet(tool("fusermount3").args(["-u", "-z"]).arg(&f));
        }
    }
}

fn environment_ok(test: &str) -> bool {
    if !require_tools(
        test,
        &[
            "nbdfuse",
            "fusermount3",
            "losetup",
            "mkfs.ext4",
            "fsck.ext4",
            "mount",
            "umount",
            "diff",
            "cp",
        ],
    ) {
        return false;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip(test, "mount and losetup need root");
    }
    let fuse = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse");
    if let Err(e) = fuse {
        return skip(test, &format!("/dev/fuse is unusable: {e}"));
    }
    if !Path::new("/dev/loop-control").exists() {
        return skip(test, "no loop devices (/dev/loop-control is missing)");
    }
    true
}

/// A deterministic tree: nested directories, files of awkward sizes, empty
/// files, a symlink and a hard link. About 20 MiB.
fn make_tree(root: &Path) {
    let sizes = [
        0usize,
        1,
        511,
        512,
        4095,
        4096,
        4097,
        65_537,
        300_000,
        1 << 20,
        3 << 20,
    ];
    let mut seed = 0u64;
    for d in 0..4 {
        for e in 0..3 {
            let dir = root.join(format!("dir{d}/sub{e}"));
            std::fs::create_dir_all(&dir).expect("mkdir");
            for (k, size) in sizes.iter().enumerate() {
                seed += 1;
                // Big files only in some directories, to stay near 20 MiB.
                if *size >= 1 << 20 && (d + e + k) % 3 != 0 {
                    continue;
                }
                std::fs::write(dir.join(format!("f{k}.bin")), pattern(seed, *size))
                    .expect("write file");
            }
        }
    }
    std::os::unix::fs::symlink("dir0/sub0/f5.bin", root.join("link")).expect("symlink");
    std::fs::hard_link(root.join("dir1/sub1/f6.bin"), root.join("hard")).expect("hard link");
}

struct Stack {
    fuse_dir: PathBuf,
    loop_dev: String,
    nbdfuse: Proc,
}

/// nbdfuse on the cairn socket, then a loop device on its file.
fn attach(ctx: &Ctx, t: &mut Teardown, socket: &Path, n: u32) -> Stack {
    let fuse_dir = ctx.path(&format!("fuse{n}"));
    std::fs::create_dir_all(&fuse_dir).expect("mkdir fuse");
    let pidfile = ctx.path(&format!("nbdfuse{n}.pid"));
    let mut nbdfuse = ctx.spawn(
        "nbdfuse",
        tool("nbdfuse")
            .arg("-P")
            .arg(&pidfile)
            .arg(&fuse_dir)
            .arg("--unix")
            .arg(socket),
    );
    t.fuse.push(fuse_dir.clone());
    wait_for_path(&pidfile, &mut nbdfuse);
    let file = fuse_dir.join("nbd");
    assert!(
        eventually(Duration::from_secs(30), || file.exists()),
        "{} did not appear",
        file.display()
    );
    let out = run_ok(
        tool("losetup").args(["-f", "--show"]).arg(&file),
        TOOL_TIMEOUT,
    );
    let loop_dev = stdout(&out).trim().to_string();
    assert!(loop_dev.starts_with("/dev/loop"), "{}", describe(&out));
    t.loops.push(loop_dev.clone());
    Stack {
        fuse_dir,
        loop_dev,
        nbdfuse,
    }
}

fn detach(t: &mut Teardown, mut s: Stack) {
    t.detach(&s.loop_dev);
    t.fuse_unmount(&s.fuse_dir);
    // nbdfuse exits by itself once unmounted.
    assert!(
        s.nbdfuse.wait_timeout(Duration::from_secs(30)).is_some(),
        "nbdfuse did not exit after fusermount3 -u"
    );
}

fn mount(t: &mut Teardown, dev: &str, dir: &Path, opts: &[&str]) {
    std::fs::create_dir_all(dir).expect("mkdir mountpoint");
    run_ok(tool("mount").args(opts).arg(dev).arg(dir), TOOL_TIMEOUT);
    t.mounts.push(dir.to_path_buf());
}

fn fsck_clean(dev: &str) {
    let out = run(tool("fsck.ext4").args(["-fn", dev]), TOOL_TIMEOUT);
    assert_eq!(
        out.status.code(),
        Some(0),
        "fsck.ext4 -fn: {}",
        describe(&out)
    );
}

fn diff_same(a: &Path, b: &Path) {
    let out = run(tool("diff").arg("-r").arg(a).arg(b), TOOL_TIMEOUT);
    assert!(out.status.success(), "diff -r: {}", describe(&out));
}

#[test]
fn ext4_on_nbdfuse_loop_survives_remount_and_kill9() {
    if !environment_ok("ext4_on_cairn") {
        return;
    }
    let ctx = Ctx::new("ext4");
    // 96 MiB volume, 16 MiB cache: the copy does not fit in the cache.
    let (cache, _origin) = ctx.setup(16 * MIB, 96 * MIB);
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &[]);
    let src = ctx.path("src");
    make_tree(&src);
    let fs = ctx.path("fs");
    let mut t = Teardown::default();

    let stack = attach(&ctx, &mut t, &sock, 0);
    let dev = stack.loop_dev.clone();
    run_ok(tool("mkfs.ext4").args(["-q", &dev]), TOOL_TIMEOUT);
    mount(&mut t, &dev, &fs, &[]);
    run_ok(
        tool("cp").arg("-a").arg(&src).arg(fs.join("tree")),
        TOOL_TIMEOUT,
    );
    t.umount(&fs);
    fsck_clean(&dev);
    mount(&mut t, &dev, &fs, &[]);
    diff_same(&src, &fs.join("tree"));
    t.umount(&fs);
    detach(&mut t, stack);

    let st = ctx.status(&cache);
    assert!(
        u64_of(&st, "writeback_blocks") > 0,
        "the copy should not fit in the cache: {st}"
    );
    assert_eq!(u64_of(&st, "checksum_mismatches"), 0, "{st}");

    // The unmounted filesystem survives kill -9 of the daemon.
    server.kill9();
    let mut server = ctx.serve(&cache, &sock, &[]);
    let stack = attach(&ctx, &mut t, &sock, 1);
    fsck_clean(&stack.loop_dev);
    mount(&mut t, &stack.loop_dev, &fs, &["-o", "ro"]);
    diff_same(&src, &fs.join("tree"));
    t.umount(&fs);
    detach(&mut t, stack);
    assert!(server.terminate().success());
}
