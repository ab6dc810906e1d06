//! Whole-volume integrity through the real binary: `format --integrity`
//! over an origin that already holds data, background recalculation,
//! corruption and a misdirected write on the origin file behind cairn's
//! back (EIO over NBD, counted in status, listed by `check --origin`),
//! repair from a clean cached copy, and no device reads for tags while
//! writing (`/proc/PID/io`).

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use common::*;

const MIB: u64 = 1 << 20;
const BS: u64 = 4096;

fn qemu_io_text(uri: &str, commands: &[&str]) -> (bool, String) {
    let mut cmd = tool("qemu-io");
    cmd.args(["-f", "raw", uri]);
    for c in commands {
        cmd.args(["-c", c]);
    }
    let out = run(&mut cmd, TOOL_TIMEOUT);
    (
        out.status.success(),
        format!("{}{}", stdout(&out), stderr(&out)),
    )
}

fn origin_block(origin: &Path, lba: u64) -> Vec<u8> {
    let f = std::fs::File::open(origin).expect("open origin");
    let mut buf = vec![0u8; BS as usize];
    f.read_exact_at(&mut buf, lba * BS).expect("read origin");
    buf
}

fn write_origin(origin: &Path, offset: u64, data: &[u8]) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(origin)
        .expect("open origin for writing");
    f.write_all_at(data, offset).expect("write origin");
    f.sync_all().expect("sync origin");
}

/// The `check --origin` summary's numbers, in order: checked, verified,
/// not yet tagged, discarded, skipped, repaired, bad. Asserts that every
/// checked block is in one category.
fn scrub_totals(text: &str) -> [u64; 7] {
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("origin scrub: "))
        .unwrap_or_else(|| panic!("no summary line: {text}"));
    let numbers: Vec<u64> = line
        .split(", ")
        .map(|part| {
            part.split(' ')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{part:?} in {line:?}"))
        })
        .collect();
    let totals: [u64; 7] = numbers
        .try_into()
        .unwrap_or_else(|n| panic!("not 7 numbers: {n:?} in {line:?}"));
    assert_eq!(
        totals[1..].iter().sum::<u64>(),
        totals[0],
        "the categories do not add up to the blocks checked: {line}"
    );
    totals
}

fn wait_recalc_complete(ctx: &Ctx, cache: &Path) -> serde_json::Value {
    let mut last = serde_json::Value::Null;
    let done = eventually(Duration::from_secs(120), || {
        last = ctx.status(cache);
        last["recalc_state"] == "complete"
    });
    assert!(done, "recalculation did not complete: {last}");
    last
}

#[test]
fn corrupt_and_misdirected_origin_blocks_are_caught_and_repaired() {
    if !require_tools("integrity_cli", &["qemu-io"]) {
        return;
    }
    let ctx = Ctx::new("integrity_cli");
    let cache = ctx.file("cache.img", 16 * MIB);
    let origin = ctx.file("origin.img", 32 * MIB);
    // The origin already holds data before the format.
    let original = pattern(0x0417, (32 * MIB) as usize);
    write_origin(&origin, 0, &original);
    let out = ctx.cairn_ok(&[
        "format",
        "--cache",
        &cache.to_string_lossy(),
        "--origin",
        &origin.to_string_lossy(),
        "--integrity",
    ]);
    assert!(
        stdout(&out).contains("integrity on"),
        "format does not say integrity is on: {}",
        describe(&out)
    );
    let mut server = ctx.serve(&cache, &ctx.path("nbd.sock"), &[]);
    let uri = server.uri();
    let status = wait_recalc_complete(&ctx, &cache);
    assert_eq!(status["integrity"], true, "{status}");
    assert_eq!(status["recalc_position_blocks"], 8192, "{status}");
    assert!(status["tag_algorithm"].is_string(), "{status}");

    // Intact data reads back.
    let (ok, text) = qemu_io_text(&uri, &["read 409600 4096"]);
    assert!(ok && !text.contains("error"), "{text}");
    // 64 blocks discarded and written back: their origin copy is not
    // judged, and they are counted as such.
    let (ok, text) = qemu_io_text(&uri, &["discard 4M 256k"]);
    assert!(ok && !text.contains("error"), "{text}");
    ctx.flush(&cache);

    // 1. One byte flipped behind cairn's back: EIO, counted, listed.
    let mut byte = [original[(200 * BS + 17) as usize]];
    byte[0] ^= 0x01;
    write_origin(&origin, 200 * BS + 17, &byte);
    let (_, text) = qemu_io_text(&uri, &[&format!("read {} 4096", 200 * BS)]);
    assert!(
        text.contains("Input/output error"),
        "a corrupt origin block was returned: {text}"
    );
    let status = ctx.status(&cache);
    assert!(
        status["origin_mismatches"].as_u64().unwrap_or(0) >= 1,
        "{status}"
    );
    let c = cache.to_string_lossy().to_string();
    let out = ctx.cairn(&["check", "--cache", &c, "--origin"]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(
        stdout(&out).contains("origin block 200 (byte offset 819200)"),
        "check --origin does not list the address: {}",
        describe(&out)
    );
    let [checked, _, _, discarded, _, _, bad] = scrub_totals(&stdout(&out));
    assert_eq!(
        (checked, discarded, bad),
        (8192, 64, 1),
        "{}",
        describe(&out)
    );

    // 2. Block A's bytes written over block B: caught at B.
    write_origin(
        &origin,
        500 * BS,
        &original[(400 * BS) as usize..(401 * BS) as usize],
    );
    let (_, text) = qemu_io_text(&uri, &[&format!("read {} 4096", 500 * BS)]);
    assert!(text.contains("Input/output error"), "misdirected: {text}");

    // 3. A block with a clean cached copy: the read succeeds from the
    //    cache, and the scrub rewrites the origin from it.
    let (ok, text) = qemu_io_text(&uri, &[&format!("read {} 4096", 300 * BS)]);
    assert!(ok && !text.contains("error"), "{text}");
    let mut rotten = original[(300 * BS) as usize..(301 * BS) as usize].to_vec();
    rotten[4000] ^= 0x80;
    write_origin(&origin, 300 * BS, &rotten);
    let (_, text) = qemu_io_text(&uri, &[&format!("read {} 4096", 300 * BS)]);
    assert!(
        !text.contains("error"),
        "cached clean copy not served: {text}"
    );
    // Without repair: not claimed to have no copy; told how to repair.
    let out = ctx.cairn(&["check", "--cache", &c, "--origin", "--no-repair"]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let text = stdout(&out);
    for needle in [
        "origin block 300 (byte offset 1228800) of volume \"\" does not match its tag (the cache holds a clean copy)",
        "check FAILED: 3 origin blocks are corrupt; repair was not attempted (--no-repair)",
        &format!("1 of them have a clean cached copy; to rewrite the origin from it, run: cairn check --cache {c} --origin"),
        "2 of them have no clean cached copy",
    ] {
        assert!(text.contains(needle), "no {needle:?}: {}", describe(&out));
    }
    assert!(!text.contains("repaired:"), "{}", describe(&out));
    assert_eq!(scrub_totals(&text)[6], 3, "{}", describe(&out));
    assert_ne!(
        origin_block(&origin, 300),
        original[(300 * BS) as usize..(301 * BS) as usize],
        "--no-repair rewrote the origin"
    );
    let out = ctx.cairn(&["check", "--cache", &c, "--origin", "--rate", "64M"]);
    assert!(
        stdout(&out).contains("repaired: origin block 300"),
        "no repair: {}",
        describe(&out)
    );
    assert_eq!(
        origin_block(&origin, 300),
        original[(300 * BS) as usize..(301 * BS) as usize],
        "the origin was not repaired"
    );
    let status = ctx.status(&cache);
    assert!(
        status["origin_repairs"].as_u64().unwrap_or(0) >= 1,
        "{status}"
    );
    assert!(
        server
            .proc
            .log_text()
            .contains("does not match its integrity tag"),
        "no log line names the bad block"
    );
    assert!(server.terminate().success());

    // Offline, the scrub still finds blocks 200 and 500.
    let out = ctx.cairn(&["check", "--cache", &c, "--origin"]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let text = stdout(&out);
    assert!(
        text.contains("origin block 200 ") && text.contains("origin block 500 "),
        "{text}"
    );
}

#[test]
fn sequential_writes_read_nothing_for_tags() {
    if !require_tools("integrity_io", &["fio"]) {
        return;
    }
    let ctx = Ctx::new("integrity_io");
    // A fully written cache file, like a real device: writes into the holes
    // of a sparse file make the filesystem allocate, and reading its
    // allocation metadata would be counted against the daemon too.
    let cache = ctx.path("cache.img");
    {
        use std::io::Write as _;
        let mut f = std::fs::File::create(&cache).expect("create cache file");
        let zeroes = vec![0u8; MIB as usize];
        for _ in 0..256 {
            f.write_all(&zeroes).expect("fill cache file");
        }
        f.sync_all().expect("sync cache file");
    }
    let origin = ctx.file("origin.img", 256 * MIB);
    ctx.format(&cache, &origin.to_string_lossy(), &["--integrity"]);
    let mut server = ctx.serve(&cache, &ctx.path("nbd.sock"), &["--no-writeback"]);
    wait_recalc_complete(&ctx, &cache);
    let read_bytes = |pid: i32| -> u64 {
        let io = std::fs::read_to_string(format!("/proc/{pid}/io")).expect("/proc/PID/io");
        io.lines()
            .find_map(|l| l.strip_prefix("read_bytes: "))
            .and_then(|v| v.trim().parse().ok())
            .expect("read_bytes in /proc/PID/io")
    };
    let pid = server.proc.pid();
    let fio_run = |offset: &str, size: &str| {
        let mut fio = tool("fio");
        fio.args([
            "--name=seq",
            "--ioengine=nbd",
            &format!("--uri={}", server.uri()),
            "--rw=write",
            "--bs=64k",
            "--iodepth=8",
            &format!("--offset={offset}"),
            &format!("--size={size}"),
            "--end_fsync=1",
        ]);
        run_ok(&mut fio, TOOL_TIMEOUT);
    };
    // A short warm-up first: the first run of a code path may fault pages
    // of the binary in from disk, which /proc/PID/io also counts.
    fio_run("0", "8M");
    let before = read_bytes(pid);
    fio_run("8M", "96M");
    let after = read_bytes(pid);
    assert_eq!(
        after - before,
        0,
        "the daemon read {} bytes from its devices during sequential writes",
        after - before
    );
    let status = ctx.status(&cache);
    assert_eq!(status["dirty_blocks"], 104 * MIB / BS, "{status}");
    {
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "integrity: 96 MiB of 64 KiB sequential writes with integrity on: read_bytes delta 0"
        );
    }
    // Write-back then sets the tags; a scrub verifies the new data.
    ctx.flush(&cache);
    let c = cache.to_string_lossy().to_string();
    let out = ctx.cairn_ok(&["check", "--cache", &c, "--origin"]);
    assert!(stdout(&out).contains("0 bad"), "{}", describe(&out));
    assert!(server.terminate().success());
}

/// `cairn format --integrity-reserve`, then `cairn volume add --integrity`
/// while serving: the added volume's existing data is tagged in the
/// background, a block rotten behind cairn's back reads as EIO over its
/// NBD export and `check --origin` names the volume; a volume whose tags
/// do not fit the rest of the reserve is refused with the fix.
#[test]
fn a_volume_added_with_integrity_has_its_origin_checked() {
    if !require_tools("integrity_added_volume", &["qemu-io"]) {
        return;
    }
    let ctx = Ctx::new("integrity_added_volume");
    let cache = ctx.file("cache.img", 32 * MIB);
    let first = ctx.file("first.img", 8 * MIB);
    let second = ctx.file("second.img", 16 * MIB);
    let original = pattern(0x0418, (16 * MIB) as usize);
    write_origin(&second, 0, &original);
    let c = cache.to_string_lossy().to_string();
    let out = ctx.cairn_ok(&[
        "format",
        "--cache",
        &c,
        "--origin",
        &first.to_string_lossy(),
        "--integrity-reserve",
        "24M",
    ]);
    assert!(
        stdout(&out).contains("integrity reserve"),
        "{}",
        describe(&out)
    );
    let socket = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &socket, &[]);
    let status = ctx.status(&cache);
    assert_eq!(status["tag_area_pages"], 7, "24 MiB of origin: {status}");
    assert_eq!(status["tag_area_free_pages"], 7, "{status}");
    ctx.cairn_ok(&[
        "volume",
        "add",
        "--cache",
        &c,
        "--name",
        "second",
        "--origin",
        &second.to_string_lossy(),
        "--integrity",
    ]);
    let status = wait_recalc_complete(&ctx, &cache);
    assert_eq!(status["recalc_total_blocks"], 4096, "{status}");
    assert_eq!(status["tag_area_free_pages"], 2, "{status}");
    let out = ctx.cairn_ok(&["volume", "list", "--cache", &c, "--json"]);
    let list: serde_json::Value = serde_json::from_str(&stdout(&out))
        .unwrap_or_else(|e| panic!("volume list --json ({e}): {}", describe(&out)));
    let added = &list[1];
    assert_eq!(added["integrity"], true, "{list}");
    assert_eq!(added["recalc_position_blocks"], 4096, "{list}");

    let uri = format!("nbd+unix:///second?socket={}", socket.display());
    // Block 50 reads (and is cached); block 100 is left uncached.
    let (ok, text) = qemu_io_text(&uri, &["read 204800 4096"]);
    assert!(ok && !text.contains("error"), "{text}");
    let mut byte = [original[(100 * BS + 9) as usize]];
    byte[0] ^= 0x10;
    write_origin(&second, 100 * BS + 9, &byte);
    let (_, text) = qemu_io_text(&uri, &[&format!("read {} 4096", 100 * BS)]);
    assert!(
        text.contains("Input/output error"),
        "a corrupt block of the added volume was returned: {text}"
    );
    let out = ctx.cairn(&["check", "--cache", &c, "--origin"]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(
        stdout(&out).contains("origin block 100 (byte offset 409600) of volume \"second\""),
        "check --origin does not name the volume: {}",
        describe(&out)
    );

    // 12 MiB more would need 4 pages; 2 are left.
    let third = ctx.file("third.img", 12 * MIB);
    let out = ctx.cairn(&[
        "volume",
        "add",
        "--cache",
        &c,
        "--name",
        "third",
        "--origin",
        &third.to_string_lossy(),
        "--integrity",
    ]);
    assert_clean_failure(&out, &["tag area", "--integrity-reserve"]);
    assert!(server.terminate().success());
}
