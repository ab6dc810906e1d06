//! Bad input to the real binary: every case must exit non-zero with a clear
//! message on stderr that names the problem and the fix, and never panic.

mod common;

use std::os::fd::{FromRawFd, OwnedFd};
use std::process::Stdio;
use std::time::Duration;

use common::*;

const MIB: u64 = 1 << 20;

#[test]
fn missing_cache_path_is_a_clear_error_for_every_command() {
    let ctx = Ctx::new("missing_cache");
    let origin = ctx.file("origin.img", 64 * MIB);
    let o = origin.to_string_lossy();
    let missing = ctx.path("no-such-dir/cache.img");
    let m = missing.to_string_lossy();
    let sock = ctx.path("nbd.sock");
    let s = sock.to_string_lossy();
    for args in [
        vec!["serve", "--cache", &m, "--socket", &s],
        vec!["status", "--cache", &m],
        vec!["status", "--cache", &m, "--json"],
        vec!["flush", "--cache", &m],
        vec!["check", "--cache", &m],
        vec!["format", "--cache", &m, "--origin", &o],
    ] {
        let out = ctx.cairn(&args);
        // The problem (path, no such file) and the fix (check the path).
        assert_clean_failure(&out, &[&m, "no such file", "check the path exists"]);
    }
    assert!(!sock.exists(), "a failed serve must not leave a socket");
}

#[test]
fn unusable_cache_path_is_a_clear_error() {
    let ctx = Ctx::new("unusable_cache");
    let origin = ctx.file("origin.img", 64 * MIB);
    let o = origin.to_string_lossy();
    // A directory where a device or file is expected.
    let dir = ctx.path("a-directory");
    std::fs::create_dir(&dir).expect("mkdir");
    let d = dir.to_string_lossy();
    let out = ctx.cairn(&["format", "--cache", &d, "--origin", &o]);
    assert_clean_failure(&out, &[&d, "is a directory", "check the path"]);
    let out = ctx.cairn(&["status", "--cache", &d]);
    assert_clean_failure(&out, &[&d, "is a directory"]);

    // Unreadable: root ignores file modes, so this half needs a normal user.
    let unreadable = ctx.file("unreadable.img", 64 * MIB);
    std::fs::set_permissions(
        &unreadable,
        std::os::unix::fs::PermissionsExt::from_mode(0o000),
    )
    .expect("chmod 000");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        eprintln!("note: running as root, the mode-000 cache case is not meaningful; skipped");
        return;
    }
    let u = unreadable.to_string_lossy();
    let out = ctx.cairn(&["status", "--cache", &u]);
    assert_clean_failure(
        &out,
        &[&u, "permission denied", "you may read and write it"],
    );
}

#[test]
fn cache_smaller_than_the_minimum_is_refused() {
    let ctx = Ctx::new("small_cache");
    let cache = ctx.file("cache.img", MIB);
    let origin = ctx.file("origin.img", 64 * MIB);
    let out = ctx.cairn(&[
        "format",
        "--cache",
        &cache.to_string_lossy(),
        "--origin",
        &origin.to_string_lossy(),
    ]);
    // Names the size it has and the size it needs.
    assert_clean_failure(&out, &["too small", "1048576 bytes", "needs at least"]);
    // One statement of the problem, not the same sentence twice.
    let err = stderr(&out);
    assert_eq!(
        err.matches("too small").count(),
        1,
        "the message repeats itself: {err}"
    );
    // Nothing was written: still not a cairn cache.
    let out = ctx.cairn(&["status", "--cache", &cache.to_string_lossy()]);
    assert_clean_failure(&out, &["not a cairn cache"]);
}

#[test]
fn unformatted_cache_is_refused_with_the_format_command() {
    let ctx = Ctx::new("blank_cache");
    let blank = ctx.file("blank.img", 64 * MIB);
    let b = blank.to_string_lossy();
    let sock = ctx.path("nbd.sock");
    let s = sock.to_string_lossy();
    for args in [
        vec!["serve", "--cache", &b, "--socket", &s],
        vec!["status", "--cache", &b, "--json"],
        vec!["flush", "--cache", &b],
        vec!["check", "--cache", &b],
    ] {
        let out = ctx.cairn(&args);
        assert_clean_failure(
            &out,
            &["not a cairn cache", &format!("cairn format --cache {b}")],
        );
    }
    assert!(!sock.exists(), "a failed serve must not leave a socket");
    // Refusing must not have written anything.
    assert!(
        read_range(&blank, 0, 1 << 20).iter().all(|&x| x == 0),
        "a refused command wrote to the blank device"
    );
}

#[test]
fn cache_formatted_for_another_origin_is_refused() {
    let ctx = Ctx::new("other_origin");
    let (cache, origin_a) = ctx.setup(32 * MIB, 64 * MIB);
    let origin_b = ctx.file("origin-b.img", 64 * MIB);
    let sock = ctx.path("nbd.sock");
    let out = ctx.cairn(&[
        "serve",
        "--cache",
        &cache.to_string_lossy(),
        "--origin",
        &origin_b.to_string_lossy(),
        "--socket",
        &sock.to_string_lossy(),
    ]);
    let a = std::fs::canonicalize(&origin_a).expect("canonical A");
    let b = std::fs::canonicalize(&origin_b).expect("canonical B");
    assert_clean_failure(
        &out,
        &[
            &format!("formatted for origin file:{}", a.display()),
            &b.display().to_string(),
            "--force",
        ],
    );
    assert!(!sock.exists());
    // The recorded origin still works.
    let mut server = ctx.serve(&cache, &sock, &[]);
    assert!(server.terminate().success());
}

/// Another file put at the origin's path (a backup restored, an image
/// moved over it) is not the origin: serving it would mix the cache's
/// blocks with another disk's and write dirty data into it. It is refused
/// with or without --origin, named as replaced; --force adopts it; the
/// original put back is served again.
#[test]
fn an_origin_file_replaced_at_the_same_path_is_refused() {
    let ctx = Ctx::new("origin_replaced");
    let (cache, origin) = ctx.setup(32 * MIB, 64 * MIB);
    let c = cache.to_string_lossy();
    let o = origin.to_string_lossy();
    let sock = ctx.path("nbd.sock");
    let s = sock.to_string_lossy();
    let kept = ctx.path("origin-original.img");
    std::fs::rename(&origin, &kept).expect("move the origin away");
    let impostor = ctx.file("origin.img", 64 * MIB);
    assert_eq!(impostor, origin);
    for args in [
        vec!["serve", "--cache", &c, "--socket", &s],
        vec!["serve", "--cache", &c, "--origin", &o, "--socket", &s],
        vec!["flush", "--cache", &c],
    ] {
        let out = ctx.cairn(&args);
        assert_clean_failure(
            &out,
            &[
                "not the one this cache was formatted for",
                "replaced",
                "--force",
            ],
        );
    }
    assert!(!sock.exists());
    std::fs::rename(&origin, ctx.path("impostor.img")).expect("move the impostor away");
    std::fs::rename(&kept, &origin).expect("put the original back");
    let mut server = ctx.serve(&cache, &sock, &[]);
    assert!(server.terminate().success());
    // A copy of the original is a new file; --force adopts it.
    std::fs::copy(&origin, ctx.path("copy.img")).expect("copy");
    std::fs::rename(ctx.path("copy.img"), &origin).expect("copy over");
    let mut server = ctx.serve(&cache, &sock, &["--force"]);
    assert!(server.terminate().success());
    let mut server = ctx.serve(&cache, &sock, &[]);
    assert!(server.terminate().success());
}

/// A block device is known by its lasting id as well as its path: a loop
/// device attached to another file (as a disk renamed at a reboot) is
/// refused, named as another disk with how to find the right one; the
/// right file attached again is served; found under another name it is
/// said to be the same disk, and --force records its new path.
#[test]
fn a_block_device_that_is_now_another_disk_is_refused() {
    let test = "blockdev_swapped";
    let ctx = Ctx::new(test);
    let first = ctx.file("disk-a.img", 64 * MIB);
    let second = ctx.file("disk-b.img", 64 * MIB);
    let Some(device) = LoopDevice::attach(test, &first, false) else {
        return;
    };
    let dev = device.0.clone();
    let cache = ctx.file("cache.img", 32 * MIB);
    let c = cache.to_string_lossy();
    let sock = ctx.path("nbd.sock");
    let s = sock.to_string_lossy();
    ctx.format(&cache, &dev, &[]);
    let mut server = ctx.serve(&cache, &sock, &[]);
    assert!(server.terminate().success());

    // The same node, now the other file.
    drop(device);
    let Some(swapped) = LoopDevice::attach_at(test, &dev, &second) else {
        return;
    };
    for args in [
        vec!["serve", "--cache", &c, "--socket", &s],
        vec!["flush", "--cache", &c],
    ] {
        let out = ctx.cairn(&args);
        assert_clean_failure(
            &out,
            &[
                "not the disk this cache was formatted for",
                "lsblk",
                "--force",
            ],
        );
    }
    assert!(!sock.exists());
    drop(swapped);

    // The right file again, at the same node: served.
    let Some(back) = LoopDevice::attach_at(test, &dev, &first) else {
        return;
    };
    let mut server = ctx.serve(&cache, &sock, &[]);
    assert!(server.terminate().success());
    drop(back);

    // The right file under another node (the old one taken by the other
    // file): the same disk, and --force records its new path.
    let Some(_placeholder) = LoopDevice::attach_at(test, &dev, &second) else {
        return;
    };
    let Some(moved) = LoopDevice::attach(test, &first, false) else {
        return;
    };
    let other = moved.0.clone();
    let out = ctx.cairn(&["serve", "--cache", &c, "--origin", &other, "--socket", &s]);
    assert_clean_failure(&out, &["same disk under another name", "--force"]);
    let mut server = ctx.serve(&cache, &sock, &["--origin", &other, "--force"]);
    assert!(server.terminate().success());
    let mut server = ctx.serve(&cache, &sock, &[]);
    assert!(server.terminate().success());
}

/// The cache given as its own origin, by its name, a symlink or a hard
/// link: said as such (it read "in use by another process").
#[test]
fn the_cache_given_as_its_own_origin_is_named_as_such() {
    let ctx = Ctx::new("same_file");
    let cache = ctx.file("cache.img", 64 * MIB);
    let c = cache.to_string_lossy();
    let link = ctx.path("link.img");
    std::os::unix::fs::symlink(&cache, &link).expect("symlink");
    let hard = ctx.path("hard.img");
    std::fs::hard_link(&cache, &hard).expect("hard link");
    let sock = ctx.path("nbd.sock");
    let s = sock.to_string_lossy();
    let origins = [cache.clone(), link, hard];
    for origin in &origins {
        let o = origin.to_string_lossy();
        let out = ctx.cairn(&["format", "--cache", &c, "--origin", &o]);
        assert_clean_failure(&out, &["are the same file", "--origin"]);
    }
    // Formatted for a real origin, then served with itself as the origin.
    let real = ctx.file("origin.img", 64 * MIB);
    ctx.format(&cache, &real.to_string_lossy(), &[]);
    for origin in &origins {
        let o = origin.to_string_lossy();
        let out = ctx.cairn(&["serve", "--cache", &c, "--origin", &o, "--socket", &s]);
        assert_clean_failure(&out, &["are the same file"]);
    }
}

#[test]
fn origin_that_shrank_is_refused() {
    let ctx = Ctx::new("origin_shrunk");
    let (cache, origin) = ctx.setup(32 * MIB, 64 * MIB);
    let c = cache.to_string_lossy();
    let sock = ctx.path("nbd.sock");
    let s = sock.to_string_lossy();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&origin)
        .and_then(|f| f.set_len(32 * MIB))
        .expect("shrinking the origin");
    for args in [
        vec!["serve", "--cache", &c, "--socket", &s],
        vec!["serve", "--cache", &c, "--socket", &s, "--force"],
        vec!["flush", "--cache", &c],
    ] {
        let out = ctx.cairn(&args);
        assert_clean_failure(
            &out,
            &[
                &format!("is {} bytes", 32 * MIB),
                &format!("recorded {} bytes", 64 * MIB),
                &format!(
                    "give the origin its recorded size back ({} bytes)",
                    64 * MIB
                ),
            ],
        );
    }
    assert!(!sock.exists());
    // Status reads the cache alone (the origin is not opened), so it
    // answers, with the size recorded.
    let st = ctx.status(&cache);
    assert_eq!(st["served"], false, "{st}");
    assert_eq!(u64_of(&st, "volume_size_bytes"), 64 * MIB, "{st}");
}

/// An origin file that grew (the same inode: `truncate -s`, an LV or image
/// made larger) still holds every block where the cache knows it: served
/// at the size the cache was formatted for, with a warning, its data and
/// the cache's dirty blocks intact.
#[test]
fn origin_file_that_grew_is_served_at_its_recorded_size() {
    let ctx = Ctx::new("origin_grown");
    let (cache, origin) = ctx.setup(32 * MIB, 64 * MIB);
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &[]);
    let data = pattern(7, 64 * 1024);
    nbd_write(&server.uri(), 60 * MIB, &data, true);
    server.kill9();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&origin)
        .and_then(|f| f.set_len(128 * MIB))
        .expect("growing the origin");
    let mut server = ctx.serve(&cache, &sock, &[]);
    assert_eq!(nbd_read(&server.uri(), 60 * MIB, data.len()), data);
    let st = ctx.status(&cache);
    assert_eq!(st["served"], true, "{st}");
    assert_eq!(u64_of(&st, "volume_size_bytes"), 64 * MIB, "{st}");
    let past_end = try_nbd_read(&server.uri(), 64 * MIB, 4096);
    assert!(
        !past_end.status.success(),
        "a read past the recorded size: {}",
        describe(&past_end)
    );
    let out = ctx.flush(&cache);
    assert!(out.status.success(), "{}", describe(&out));
    server.terminate();
    assert!(
        server.proc.log_text().contains("the origin grew"),
        "the grown origin is logged:\n{}",
        server.proc.log_text()
    );
    assert_same_bytes(
        "the origin after write-back",
        &read_range(&origin, 60 * MIB, data.len()),
        &data,
    );
}

/// An NBD export is known by its URI alone: when it answers with a larger
/// size, nothing says it is the same export, so it is refused with advice;
/// `--force` (the operator saying it is) serves it at the recorded size.
#[test]
fn nbd_origin_that_grew_needs_force() {
    if !require_tools("nbd_origin_that_grew_needs_force", &["nbdkit"]) {
        return;
    }
    let ctx = Ctx::new("nbd_origin_grown");
    let origin_sock = ctx.path("origin.sock");
    let origin_file = ctx.file("origin.img", 64 * MIB);
    let file_arg = format!("file={}", origin_file.display());
    let mut nbdkit = start_nbdkit(&ctx, &origin_sock, &["file", &file_arg]);
    let cache = ctx.file("cache.img", 32 * MIB);
    ctx.format(&cache, &nbd_unix_uri(&origin_sock), &[]);
    nbdkit.terminate(Duration::from_secs(10));
    std::fs::OpenOptions::new()
        .write(true)
        .open(&origin_file)
        .and_then(|f| f.set_len(128 * MIB))
        .expect("growing the origin");
    let _ = std::fs::remove_file(&origin_sock);
    let _nbdkit = start_nbdkit(&ctx, &origin_sock, &["file", &file_arg]);
    let (c, sock) = (cache.to_string_lossy(), ctx.path("nbd.sock"));
    let s = sock.to_string_lossy();
    let out = ctx.cairn(&["serve", "--cache", &c, "--socket", &s]);
    assert_clean_failure(
        &out,
        &[
            &format!("recorded {} bytes", 64 * MIB),
            "start cairn with --force",
        ],
    );
    let mut server = ctx.serve(&cache, &sock, &["--force"]);
    let st = ctx.status(&cache);
    assert_eq!(u64_of(&st, "volume_size_bytes"), 64 * MIB, "{st}");
    server.terminate();
}

#[test]
fn unknown_mode_is_refused() {
    let ctx = Ctx::new("bogus_mode");
    let (cache, _) = ctx.setup(32 * MIB, 64 * MIB);
    let sock = ctx.path("nbd.sock");
    let out = ctx.cairn(&[
        "serve",
        "--cache",
        &cache.to_string_lossy(),
        "--socket",
        &sock.to_string_lossy(),
        "--mode",
        "bogus",
    ]);
    assert_clean_failure(&out, &["bogus", "--mode", "possible values", "writeback"]);
    assert!(!sock.exists());
}

/// Usage errors clap finds (an unknown flag or command, a missing
/// argument, a bad value) say so on a `cairn: error:` line like every other
/// cairn error (they said `error:`), keep clap's tip, usage and pointer to
/// `--help` and its exit code 2; `--help` and `--version` print on stdout
/// and exit 0.
#[test]
fn usage_errors_are_cairn_errors_and_help_is_not_an_error() {
    let ctx = Ctx::new("usage_errors");
    for (args, says) in [
        (
            vec!["status", "--cache", "c.img", "--bogus"],
            "cairn: error: unexpected argument '--bogus' found",
        ),
        (
            vec!["status"],
            "cairn: error: the following required arguments were not provided",
        ),
        (
            vec!["bogus-command"],
            "cairn: error: unrecognized subcommand 'bogus-command'",
        ),
        (
            vec!["serve", "--cache", "c.img", "--mode", "bogus"],
            "cairn: error: invalid value 'bogus' for '--mode <MODE>'",
        ),
    ] {
        let out = ctx.cairn(&args);
        let err = stderr(&out);
        assert_eq!(
            out.status.code(),
            Some(2),
            "cairn {args:?}: {}",
            describe(&out)
        );
        assert!(err.starts_with(says), "cairn {args:?}: {}", describe(&out));
        assert!(
            err.lines().all(|l| !l.starts_with("error:")),
            "cairn {args:?}: a bare error: line: {err}"
        );
        assert!(
            err.contains("try '--help'"),
            "cairn {args:?}: no pointer to --help: {err}"
        );
        assert!(
            stdout(&out).is_empty(),
            "cairn {args:?}: {}",
            describe(&out)
        );
    }
    for (args, says) in [
        (vec!["--help"], "Usage: cairn"),
        (vec!["status", "--help"], "Usage: cairn status"),
        (vec!["--version"], "cairn "),
    ] {
        let out = ctx.cairn(&args);
        assert_eq!(
            out.status.code(),
            Some(0),
            "cairn {args:?}: {}",
            describe(&out)
        );
        assert!(
            stdout(&out).contains(says),
            "cairn {args:?}: {}",
            describe(&out)
        );
        assert!(
            stderr(&out).is_empty(),
            "cairn {args:?}: {}",
            describe(&out)
        );
    }
}

#[test]
fn block_size_must_be_a_power_of_two_in_range() {
    let ctx = Ctx::new("block_size");
    let cache = ctx.file("cache.img", 32 * MIB);
    let origin = ctx.file("origin.img", 64 * MIB);
    let c = cache.to_string_lossy();
    let o = origin.to_string_lossy();
    for bad in ["6K", "2K", "128K", "12288", "four"] {
        let out = ctx.cairn(&["format", "--cache", &c, "--origin", &o, "--block-size", bad]);
        assert_clean_failure(&out, &[bad, "--block-size", "4K"]);
    }
    let out = ctx.cairn(&[
        "format",
        "--cache",
        &c,
        "--origin",
        &o,
        "--block-size",
        "6K",
    ]);
    assert_clean_failure(&out, &["not a power of two"]);
    // Nothing was formatted by the refusals.
    assert_clean_failure(
        &ctx.cairn(&["status", "--cache", &c]),
        &["not a cairn cache"],
    );
    // Good sizes work, with or without the suffix.
    for good in ["8K", "65536"] {
        ctx.cairn_ok(&[
            "format",
            "--cache",
            &c,
            "--origin",
            &o,
            "--block-size",
            good,
            "--force",
        ]);
    }
    let st = ctx.status(&cache);
    assert_eq!(u64_of(&st, "block_size_bytes"), 65536);
    // 32 MiB holds 8 records of 1 MiB: 16 blocks of 64 KiB each.
    assert_eq!(u64_of(&st, "record_data_max_bytes"), 1 << 20, "{st}");
}

#[test]
fn format_over_a_formatted_cache_needs_force() {
    let ctx = Ctx::new("reformat");
    let (cache, origin) = ctx.setup(32 * MIB, 64 * MIB);
    let c = cache.to_string_lossy();
    let o = origin.to_string_lossy();
    let before = std::fs::read(&cache).expect("read cache");
    let out = ctx.cairn(&["format", "--cache", &c, "--origin", &o]);
    assert_clean_failure(&out, &["already holds a cairn cache", "--force"]);
    assert!(
        std::fs::read(&cache).expect("read cache") == before,
        "a refused format changed the cache"
    );
    let out = ctx.cairn_ok(&["format", "--cache", &c, "--origin", &o, "--force"]);
    assert!(stdout(&out).contains("formatted"), "{}", describe(&out));
}

/// Write `bytes` at `offset` of `path`, in place.
fn poke(path: &std::path::Path, offset: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open for poke");
    f.write_all_at(bytes, offset).expect("poke");
}

/// A damaged checkpoint (one byte flipped in the header of the one the
/// superblock names) is refused by `status` and `serve` with an error that
/// names it (its number, slot and bytes on the device) and says why the
/// older one is not used instead, and a hint: keep the device, the origin
/// holds an earlier flush, the reformat that gives up the writes since.
/// (It said "checkpoint damaged: header: checksum mismatch ... The cache
/// cannot be opened safely", with neither.)
#[test]
fn a_damaged_checkpoint_is_named_with_what_to_do() {
    let ctx = Ctx::new("damaged_checkpoint");
    let (cache, _) = ctx.setup(32 * MIB, 64 * MIB);
    let c = cache.to_string_lossy().to_string();
    let layout = cairn_format::Layout::compute(32 * MIB, 4096).expect("the layout");
    let at = layout.checkpoint_offset_bytes(0);
    assert_eq!(
        read_range(&cache, at, 8),
        b"CAIRNCKP",
        "format leaves its checkpoint in slot 0"
    );
    let byte = read_range(&cache, at + 40, 1)[0];
    poke(&cache, at + 40, &[!byte]);
    let sock = ctx.path("nbd.sock");
    let s = sock.to_string_lossy().to_string();
    let named = format!(
        "checkpoint damaged: the newest checkpoint (number 1 in slot 0, bytes {at}..{} of the device): header: checksum mismatch",
        at + layout.checkpoint_slot_bytes
    );
    let fix = format!("cairn format --force --cache {c} --origin origin");
    for args in [
        vec!["status", "--cache", &c],
        vec!["serve", "--cache", &c, "--socket", &s],
    ] {
        let out = ctx.cairn(&args);
        assert_clean_failure(
            &out,
            &[
                &named,
                "the older checkpoint in the other slot may describe log space written over since",
                "cairn: hint:",
                &format!("keep {c} as it is"),
                "the origin alone holds the volume as of an earlier flush",
                &fix,
            ],
        );
    }
    assert!(!sock.exists(), "a refused serve left its socket");
}

/// Both superblock copies damaged (one byte flipped in each, past the
/// magic): `status` and `serve` fail (exit 2) with an error that names the
/// device and both copies, and a hint: neither copy is usable, the data
/// not yet written back is still on the device, do not format it, copy the
/// device first, and that `cairn check` cannot read it either. The refusal
/// writes nothing. (There was no hint at all.)
#[test]
fn a_cache_whose_superblocks_are_damaged_is_named_with_what_to_do() {
    let ctx = Ctx::new("damaged_superblocks");
    let (cache, _) = ctx.setup(32 * MIB, 64 * MIB);
    let c = cache.to_string_lossy().to_string();
    for copy_at in cairn_format::SUPERBLOCK_OFFSETS {
        assert_eq!(
            read_range(&cache, copy_at, 8),
            b"CAIRNSB1",
            "format wrote a superblock copy at byte {copy_at}"
        );
        let byte = read_range(&cache, copy_at + 40, 1)[0];
        poke(&cache, copy_at + 40, &[!byte]);
    }
    let before = std::fs::read(&cache).expect("read cache");
    let sock = ctx.path("nbd.sock");
    let s = sock.to_string_lossy().to_string();
    for args in [
        vec!["status", "--cache", &c],
        vec!["serve", "--cache", &c, "--socket", &s],
    ] {
        let out = ctx.cairn(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", describe(&out));
        assert_clean_failure(
            &out,
            &[
                &format!("cairn: error: {c}: both superblock copies are damaged (copy A: "),
                "cairn: hint: both superblock copies (bytes 0..4096 and 4096..8192 of",
                "so neither is usable",
                &format!("still on {c}"),
                "do not format it",
                &format!("dd if={c} of=BACKUP bs=1M"),
                "`cairn check` opens it as `cairn serve` does",
            ],
        );
    }
    assert!(!sock.exists(), "a refused serve left its socket");
    assert!(
        std::fs::read(&cache).expect("read cache") == before,
        "a refused open wrote to the cache"
    );
}

/// A filesystem's or a partition table's signature on the cache: format
/// refuses without --force and names what it found, as mkfs does, and
/// leaves every byte as it was.
#[test]
fn format_over_a_filesystem_or_a_partition_table_needs_force() {
    let ctx = Ctx::new("format_over_fs");
    let origin = ctx.file("origin.img", 64 * MIB);
    let o = origin.to_string_lossy();
    for (name, offset, magic, what) in [
        (
            "ext4",
            1080u64,
            &[0x53u8, 0xEF][..],
            "an ext2/ext3/ext4 filesystem",
        ),
        ("xfs", 0, &b"XFSB"[..], "an XFS filesystem"),
        ("gpt", 512, &b"EFI PART"[..], "a GPT partition table"),
        ("lvm", 512, &b"LABELONE"[..], "an LVM physical volume"),
    ] {
        let cache = ctx.file(&format!("{name}.img"), 32 * MIB);
        poke(&cache, offset, magic);
        let c = cache.to_string_lossy();
        let before = std::fs::read(&cache).expect("read cache");
        let out = ctx.cairn(&["format", "--cache", &c, "--origin", &o]);
        assert_clean_failure(&out, &[&c, what, "refusing to format", "--force", "blkid"]);
        assert!(
            std::fs::read(&cache).expect("read cache") == before,
            "a refused format changed {name}"
        );
        ctx.cairn_ok(&["format", "--cache", &c, "--origin", &o, "--force"]);
    }
}

/// A cache whose two superblocks were overwritten still holds its volume
/// table, checkpoints and dirty records: `status` says the superblocks
/// are gone (not "format it first"), and format refuses without --force.
#[test]
fn a_cache_whose_superblocks_were_overwritten_is_not_offered_for_format() {
    let ctx = Ctx::new("superblocks_lost");
    let (cache, origin) = ctx.setup(32 * MIB, 64 * MIB);
    let c = cache.to_string_lossy();
    let o = origin.to_string_lossy();
    poke(&cache, 0, &vec![0u8; 8192]);
    let out = ctx.cairn(&["status", "--cache", &c]);
    assert_clean_failure(
        &out,
        &[
            &c,
            "superblocks were overwritten",
            "restore the first 8 KiB",
        ],
    );
    assert!(
        !stderr(&out).contains("format it first"),
        "{}",
        describe(&out)
    );
    let out = ctx.cairn(&["format", "--cache", &c, "--origin", &o]);
    assert_clean_failure(
        &out,
        &[
            "structures of a cairn cache",
            "not yet written back",
            "--force",
        ],
    );
    ctx.cairn_ok(&["format", "--cache", &c, "--origin", &o, "--force"]);
    ctx.cairn_ok(&["status", "--cache", &c]);
}

/// A read-only block device (root can open it for writing, and its
/// writes then fail) is refused as origin and as cache when it is opened,
/// before a client is told a write is safe that could never be written
/// back.
#[test]
fn a_read_only_block_device_is_refused_as_origin_and_as_cache() {
    let test = "read_only_blockdev";
    let ctx = Ctx::new(test);
    let backing = ctx.file("ro-backing.img", 64 * MIB);
    let Some(device) = LoopDevice::attach(test, &backing, true) else {
        return;
    };
    let loop_dev = device.0.clone();
    let cache = ctx.file("cache.img", 32 * MIB);
    let c = cache.to_string_lossy();
    let origin = ctx.file("origin.img", 64 * MIB);
    let o = origin.to_string_lossy();
    let out = ctx.cairn(&["format", "--cache", &c, "--origin", &loop_dev]);
    assert_clean_failure(
        &out,
        &["origin", &loop_dev, "read-only", "blockdev --setrw"],
    );
    let out = ctx.cairn(&["format", "--cache", &loop_dev, "--origin", &o]);
    assert_clean_failure(&out, &["cache", &loop_dev, "read-only"]);
}

#[test]
fn socket_in_use_by_a_live_server_is_refused_and_not_stolen() {
    if !require_python_nbd("socket_in_use") {
        return;
    }
    let ctx = Ctx::new("socket_in_use");
    let (cache, _) = ctx.setup(32 * MIB, 64 * MIB);
    let cache2 = ctx.file("cache2.img", 32 * MIB);
    let origin2 = ctx.file("origin2.img", 64 * MIB);
    ctx.format(&cache2, &origin2.to_string_lossy(), &[]);
    let sock = ctx.path("nbd.sock");
    let mut first = ctx.serve(&cache, &sock, &[]);
    nbd_write(&first.uri(), 0, &[0x5au8; 4096], true);

    let out = ctx.cairn(&[
        "serve",
        "--cache",
        &cache2.to_string_lossy(),
        "--socket",
        &sock.to_string_lossy(),
    ]);
    assert_clean_failure(
        &out,
        &[&sock.display().to_string(), "already listening", "stop it"],
    );
    // The first server still owns the socket and serves its own volume.
    assert!(first.proc.try_status().is_none(), "first server died");
    assert_eq!(nbd_read(&first.uri(), 0, 4096), vec![0x5au8; 4096]);
    // The failed daemon left no admin socket that answers for cache2.
    let st = ctx.status(&cache2);
    assert_eq!(st["served"], false, "{st}");
    assert!(first.terminate().success());
}

#[test]
fn second_serve_of_the_same_cache_is_refused() {
    let ctx = Ctx::new("second_serve");
    let (cache, _) = ctx.setup(32 * MIB, 64 * MIB);
    let sock = ctx.path("nbd.sock");
    let sock2 = ctx.path("other.sock");
    let mut first = ctx.serve(&cache, &sock, &[]);
    let out = ctx.cairn(&[
        "serve",
        "--cache",
        &cache.to_string_lossy(),
        "--socket",
        &sock2.to_string_lossy(),
    ]);
    assert_clean_failure(&out, &["already being served", "stop that daemon first"]);
    assert!(!sock2.exists(), "the refused daemon created its socket");
    assert!(first.proc.try_status().is_none(), "first server died");
    // The first daemon still answers its admin socket.
    assert_eq!(ctx.status(&cache)["served"], true);

    // Same with the daemon's admin socket unreachable (another runtime
    // dir): the cache lock alone must refuse the second daemon.
    let other_run = ctx.path("other-run");
    std::fs::create_dir(&other_run).expect("mkdir");
    let mut cmd = ctx.cmd(&[
        "serve",
        "--cache",
        &cache.to_string_lossy(),
        "--socket",
        &sock2.to_string_lossy(),
    ]);
    cmd.env("CAIRN_RUNTIME_DIR", &other_run);
    let out = run(&mut cmd, TOOL_TIMEOUT);
    assert_clean_failure(&out, &["in use by another process", "stop the other cairn"]);
    assert!(!sock2.exists());
    assert!(first.terminate().success());
}

#[test]
fn metrics_address_in_use_is_a_clean_error() {
    let ctx = Ctx::new("metrics_in_use");
    let (cache, _) = ctx.setup(32 * MIB, 64 * MIB);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let sock = ctx.path("nbd.sock");
    let mut p = ctx.spawn_serve(&cache, &sock, &["--metrics", &addr]);
    let status = p
        .wait_timeout(Duration::from_secs(30))
        .expect("serve with a taken metrics port must exit, not hang");
    let log = p.log_text();
    assert!(!status.success(), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    assert!(log.contains(&addr) && log.contains("metrics"), "{log}");
    // A daemon that failed to start leaves neither socket behind, and the
    // cache opens again.
    assert!(!sock.exists(), "stale NBD socket left behind");
    assert_eq!(ctx.status(&cache)["served"], false);
}

#[test]
fn status_into_a_closed_pipe_does_not_panic() {
    let ctx = Ctx::new("closed_pipe");
    let (cache, _) = ctx.setup(32 * MIB, 64 * MIB);
    for args in [
        vec!["status", "--cache", &*cache.to_string_lossy()],
        vec!["status", "--json", "--cache", &*cache.to_string_lossy()],
        vec!["check", "--cache", &*cache.to_string_lossy()],
        vec!["--help"],
    ] {
        let mut fds = [0i32; 2];
        // SAFETY: pipe(2) fills two fds we then own.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: fds[0] and fds[1] are fresh fds owned by nobody else.
        let (read_end, write_end) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        drop(read_end); // like `cairn status | head -0`
        let out = ctx
            .cmd(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(write_end))
            .stderr(Stdio::piped())
            .spawn()
            .and_then(|c| c.wait_with_output())
            .expect("running cairn");
        let err = stderr(&out);
        assert!(!err.contains("panicked"), "cairn {args:?}: {err}");
        assert_ne!(out.status.code(), Some(101), "cairn {args:?}: {err}");
    }
}
