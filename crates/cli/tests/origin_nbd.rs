//! The origin served over NBD by nbdkit: a slow origin (delay filter), a
//! failing origin (error filter), and an origin that is not there.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

const MIB: u64 = 1 << 20;

/// An origin file of `size` bytes filled with `pattern(seed)`, served by
/// nbdkit's file plugin behind `filters` on a unix socket.
struct NbdOrigin {
    file: PathBuf,
    socket: PathBuf,
    proc: Proc,
    args: Vec<String>,
}

impl NbdOrigin {
    fn start(ctx: &Ctx, size: u64, seed: u64, filter_args: &[&str]) -> NbdOrigin {
        let file = ctx.path("origin.img");
        std::fs::write(&file, pattern(seed, size as usize)).expect("write origin");
        let socket = ctx.path("origin.sock");
        let file_arg = format!("file={}", file.display());
        let mut args: Vec<String> = filter_args
            .iter()
            .filter(|a| a.starts_with("--"))
            .map(|a| a.to_string())
            .collect();
        args.push("file".into());
        args.push(file_arg);
        args.extend(
            filter_args
                .iter()
                .filter(|a| !a.starts_with("--"))
                .map(|a| a.to_string()),
        );
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let proc = start_nbdkit(ctx, &socket, &argv);
        NbdOrigin {
            file,
            socket,
            proc,
            args,
        }
    }

    /// Start nbdkit again on the same file and socket (after `kill9`).
    fn restart(&mut self, ctx: &Ctx) {
        assert!(self.proc.try_status().is_some(), "nbdkit still runs");
        // A killed nbdkit leaves its socket file behind.
        let _ = std::fs::remove_file(&self.socket);
        let argv: Vec<&str> = self.args.iter().map(String::as_str).collect();
        self.proc = start_nbdkit(ctx, &self.socket, &argv);
    }

    fn uri(&self) -> String {
        nbd_unix_uri(&self.socket)
    }
}

fn format_for(ctx: &Ctx, origin: &NbdOrigin, cache_bytes: u64) -> PathBuf {
    let cache = ctx.file("cache.img", cache_bytes);
    ctx.format(&cache, &origin.uri(), &[]);
    cache
}

fn origin_bytes(path: &Path) -> Vec<u8> {
    std::fs::read(path).expect("read origin file")
}

/// A slow origin (5 ms per I/O, like a disk seek) behind nbdkit: reads of
/// data that only the origin has, writes through cairn, `cairn flush`, and
/// the origin file holds exactly what was written.
#[test]
fn slow_nbd_origin_write_back() {
    if !require_tools("nbd_delay", &["nbdkit"]) || !require_python_nbd("nbd_delay") {
        return;
    }
    let ctx = Ctx::new("nbd_delay");
    let size = 16 * MIB;
    let origin = NbdOrigin::start(
        &ctx,
        size,
        0x0A,
        &["--filter=delay", "rdelay=5ms", "wdelay=5ms"],
    );
    let cache = format_for(&ctx, &origin, 8 * MIB);
    let st = ctx.status(&cache);
    assert_eq!(st["origin"], origin.uri(), "{st}");
    assert_eq!(u64_of(&st, "volume_size_bytes"), size);

    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &[]);
    let uri = server.uri();
    let mut image = pattern(0x0A, size as usize);
    // Reads of untouched data come from the origin.
    assert_same_bytes(
        "origin data through cairn",
        &nbd_read(&uri, 3 * MIB, MIB as usize),
        &image[3 * MIB as usize..4 * MIB as usize],
    );
    for (offset, len, seed) in [(0u64, 2 << 20, 1u64), (5 * MIB + 512, 300_000, 2)] {
        let len = len / 512 * 512;
        let data = pattern(seed, len);
        nbd_write(&uri, offset, &data, true);
        image[offset as usize..offset as usize + len].copy_from_slice(&data);
    }
    let out = ctx.flush(&cache);
    assert!(
        stdout(&out).contains("write-back complete"),
        "{}",
        describe(&out)
    );
    let st = ctx.status(&cache);
    assert_eq!(u64_of(&st, "dirty_blocks"), 0, "{st}");
    assert_eq!(u64_of(&st, "origin_write_errors"), 0, "{st}");
    assert_same_bytes("origin file", &origin_bytes(&origin.file), &image);
    assert!(server.terminate().success());
    drop(origin);
}

/// The origin starts failing every write: dirty data stays in the cache
/// and readable, errors are counted, `cairn flush` fails cleanly; once the
/// origin recovers, `cairn flush` writes everything back.
#[test]
fn failing_nbd_origin_keeps_dirty_data_until_it_recovers() {
    if !require_tools("nbd_error", &["nbdkit"]) || !require_python_nbd("nbd_error") {
        return;
    }
    let ctx = Ctx::new("nbd_error");
    let size = 16 * MIB;
    let error_file = ctx.path("origin-errors-on");
    let error_file_arg = format!("error-file={}", error_file.display());
    let origin = NbdOrigin::start(
        &ctx,
        size,
        0x0B,
        &["--filter=error", "error-pwrite-rate=100%", &error_file_arg],
    );
    let cache = format_for(&ctx, &origin, 8 * MIB);
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &[]);
    let uri = server.uri();
    let mut image = pattern(0x0B, size as usize);

    // Healthy origin: write, flush through.
    let a = pattern(0xA1, MIB as usize);
    nbd_write(&uri, 0, &a, true);
    image[..a.len()].copy_from_slice(&a);
    ctx.flush(&cache);
    assert_same_bytes(
        "origin after the first flush",
        &origin_bytes(&origin.file),
        &image,
    );

    // Errors on.
    std::fs::write(&error_file, b"").expect("create the error file");
    let b = pattern(0xB2, 512 << 10);
    let b_at = 4 * MIB;
    nbd_write(&uri, b_at, &b, true);
    let mut last = serde_json::Value::Null;
    // A failed write is tried again a few times before its group fails
    // and the origin is called failing.
    let failing = eventually(Duration::from_secs(30), || {
        last = ctx.status(&cache);
        u64_of(&last, "origin_write_errors") > 0
            && last.get("origin_state").is_none_or(|s| s == "failing")
    });
    assert!(failing, "write-back never hit the origin's errors: {last}");
    let st = ctx.status(&cache);
    assert_eq!(u64_of(&st, "dirty_blocks"), 128, "{st}");
    assert_eq!(st["state"], "ok", "the cache itself is fine: {st}");
    if let Some(state) = st.get("origin_state") {
        assert_eq!(state, "failing", "{st}");
    }
    // Reads of the new data still succeed (from the cache).
    assert_same_bytes(
        "dirty data while the origin fails",
        &nbd_read(&uri, b_at, b.len()),
        &b,
    );
    // Writes keep being accepted.
    let c = pattern(0xC3, 64 << 10);
    let c_at = 9 * MIB;
    nbd_write(&uri, c_at, &c, true);
    assert_eq!(nbd_read(&uri, c_at, c.len()), c);
    // A flush cannot finish: it fails with a clear error, and the daemon
    // stays up.
    let out = ctx.cairn(&["flush", "--cache", &cache.to_string_lossy()]);
    assert_clean_failure(&out, &["origin", "input/output error"]);
    assert!(server.proc.try_status().is_none(), "the daemon died");
    // Nothing of the new data reached the origin.
    assert_same_bytes(
        "origin while failing",
        &origin_bytes(&origin.file)[b_at as usize..b_at as usize + b.len()],
        &image[b_at as usize..b_at as usize + b.len()],
    );

    // The origin recovers.
    std::fs::remove_file(&error_file).expect("remove the error file");
    image[b_at as usize..b_at as usize + b.len()].copy_from_slice(&b);
    image[c_at as usize..c_at as usize + c.len()].copy_from_slice(&c);
    ctx.flush(&cache);
    let st = ctx.status(&cache);
    assert_eq!(u64_of(&st, "dirty_blocks"), 0, "{st}");
    if let Some(state) = st.get("origin_state") {
        assert_eq!(state, "ok", "{st}");
    }
    assert_same_bytes("origin after recovery", &origin_bytes(&origin.file), &image);
    assert!(server.terminate().success());
}

/// Writes `argv[2]`'s 4 KiB blocks to `argv[1]`, block k at `k * 3`
/// blocks (each a run of its own on the origin), then one FLUSH: one
/// write-back group of many runs.
const PY_SCATTERED_BLOCKS: &str = r#"
import nbd, sys
h = nbd.NBD()
h.connect_uri(sys.argv[1])
data = open(sys.argv[2], "rb").read()
for k in range(len(data) // 4096):
    h.pwrite(data[k * 4096:(k + 1) * 4096], k * 3 * 4096)
h.flush()
h.shutdown()
"#;

/// An origin that fails one write in ten (nbdkit's error filter, EIO):
/// write-back writes each failed one again instead of failing its whole
/// group, so every group reaches the origin, and `cairn flush` ends with
/// the origin holding exactly what was written. Before, one failed write
/// failed a group of hundreds, the group never went through, the cache
/// filled, and clients got ENOSPC.
#[test]
fn flaky_nbd_origin_takes_every_group() {
    if !require_tools("nbd_flaky", &["nbdkit"]) || !require_python_nbd("nbd_flaky") {
        return;
    }
    let ctx = Ctx::new("nbd_flaky");
    let size = 16 * MIB;
    let origin = NbdOrigin::start(
        &ctx,
        size,
        0x0F,
        &[
            "--filter=error",
            "error-pwrite-rate=10%",
            "error-pwrite=EIO",
        ],
    );
    let cache = format_for(&ctx, &origin, 8 * MIB);
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &[]);
    let uri = server.uri();
    let mut image = pattern(0x0F, size as usize);
    // 600 blocks, three apart: one group of 600 runs.
    let blocks = 600usize;
    let data = pattern(0x5CA7, blocks * 4096);
    let data_file = ctx.path("blocks.bin");
    std::fs::write(&data_file, &data).expect("write the blocks file");
    python_ok(PY_SCATTERED_BLOCKS, &[&uri, &data_file.to_string_lossy()]);
    for k in 0..blocks {
        let at = k * 3 * 4096;
        image[at..at + 4096].copy_from_slice(&data[k * 4096..(k + 1) * 4096]);
    }
    // Then a few groups of one large run each.
    for (i, at) in [9 * MIB, 11 * MIB + 4096, 13 * MIB].into_iter().enumerate() {
        let chunk = pattern(0xB10C + i as u64, 256 << 10);
        nbd_write(&uri, at, &chunk, true);
        image[at as usize..at as usize + chunk.len()].copy_from_slice(&chunk);
    }
    // A whole group may still fail now and then (a run failing all four
    // of its attempts): `cairn flush` then fails cleanly, and the next
    // one writes the group again.
    let c = cache.to_string_lossy();
    let mut flushed = false;
    for _ in 0..5 {
        let out = ctx.cairn(&["flush", "--cache", &c]);
        if out.status.success() {
            flushed = true;
            break;
        }
        assert_clean_failure(&out, &["origin"]);
    }
    assert!(
        flushed,
        "cairn flush never completed over a 10% flaky origin"
    );
    let st = ctx.status(&cache);
    assert_eq!(u64_of(&st, "dirty_blocks"), 0, "{st}");
    assert!(
        u64_of(&st, "origin_write_errors") > 0,
        "no write failed: {st}"
    );
    assert!(
        u64_of(&st, "origin_write_retries") > 0,
        "no failed write was written again: {st}"
    );
    assert_same_bytes(
        "origin after the flush",
        &origin_bytes(&origin.file),
        &image,
    );
    assert!(server.terminate().success());
}

/// The NBD origin is not there when `cairn serve` starts: a clear error
/// and a non-zero exit, for a missing socket and for a dead server's stale
/// socket; flush says the same, and status answers from the cache alone.
#[test]
fn unreachable_nbd_origin_at_start() {
    if !require_tools("nbd_gone", &["nbdkit"]) {
        return;
    }
    let ctx = Ctx::new("nbd_gone");
    let mut origin = NbdOrigin::start(&ctx, 16 * MIB, 0x0C, &[]);
    let cache = format_for(&ctx, &origin, 8 * MIB);
    let sock = ctx.path("nbd.sock");
    let c = cache.to_string_lossy().into_owned();
    let s = sock.to_string_lossy().into_owned();

    // Dead server, stale socket file left behind.
    origin.proc.kill9();
    assert!(origin.socket.exists());
    for args in [
        vec!["serve", "--cache", &c, "--socket", &s],
        vec!["flush", "--cache", &c],
    ] {
        let out = ctx.cairn(&args);
        assert_clean_failure(&out, &[&origin.uri(), "cannot connect", "refused"]);
        assert!(!sock.exists());
    }
    // Status needs only the cache: the offline view, the origin unopened.
    let st = ctx.status(&cache);
    assert_eq!(st["served"], false, "{st}");
    assert_eq!(st["origin"], origin.uri(), "{st}");
    // No socket at all.
    std::fs::remove_file(&origin.socket).expect("remove stale socket");
    let out = ctx.cairn(&["serve", "--cache", &c, "--socket", &s]);
    assert_clean_failure(&out, &[&origin.uri(), "cannot connect", "no such file"]);
    assert!(!sock.exists());
    // The cache is unharmed: with the origin back, it serves.
    let origin = NbdOrigin::start(&ctx, 16 * MIB, 0x0C, &[]);
    let mut server = ctx.serve(&cache, &sock, &[]);
    assert!(server.terminate().success());
    drop(origin);
}

/// `cairn status` answers while `cairn flush` drains to a slow origin on
/// another admin connection (it used to wait for the whole drain).
#[test]
fn status_answers_during_a_long_online_flush() {
    if !require_tools("status_busy", &["nbdkit"]) || !require_python_nbd("status_busy") {
        return;
    }
    let ctx = Ctx::new("status_busy");
    let size = 16 * MIB;
    let origin = NbdOrigin::start(&ctx, size, 0x0D, &["--filter=delay", "wdelay=100ms"]);
    let cache = format_for(&ctx, &origin, 8 * MIB);
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &["--no-writeback"]);
    let uri = server.uri();
    let mut image = pattern(0x0D, size as usize);
    // 30 scattered blocks, each in its own flush epoch: write-back goes
    // epoch by epoch, so that is 30 serial origin writes of 100 ms each.
    for i in 0..30u64 {
        let at = i * 512 * 1024;
        let block = pattern(100 + i, 4096);
        nbd_write(&uri, at, &block, true);
        image[at as usize..at as usize + 4096].copy_from_slice(&block);
    }
    let c = cache.to_string_lossy().into_owned();
    let mut flush = ctx.spawn("cairn flush", &mut ctx.cmd(&["flush", "--cache", &c]));
    std::thread::sleep(Duration::from_millis(300));
    let started = std::time::Instant::now();
    let st = ctx.status(&cache);
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(1500),
        "status took {took:?} while a flush was running"
    );
    assert_eq!(st["served"], true, "{st}");
    assert!(
        flush.try_status().is_none(),
        "the flush ended before status answered; the check means nothing"
    );
    let done = flush
        .wait_timeout(Duration::from_secs(60))
        .expect("flush finishes");
    assert!(done.success(), "{}", flush.log_text());
    assert_eq!(u64_of(&ctx.status(&cache), "dirty_blocks"), 0);
    assert_same_bytes(
        "origin after the flush",
        &origin_bytes(&origin.file),
        &image,
    );
    assert!(server.terminate().success());
}

const PY_EPOCHS: &str = r#"
import nbd, sys
uri, count, stride = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
h = nbd.NBD()
h.connect_uri(uri)
for i in range(count):
    unit = b"epoch%06d." % i
    # Later epochs at lower addresses: a write-back that merged epochs and
    # sorted them by address would show up as a non-prefix on the origin.
    h.pwrite((unit * (4096 // len(unit) + 1))[:4096], (count - 1 - i) * stride)
    h.flush()
h.shutdown()
"#;

const EPOCHS: u64 = 60;
const STRIDE: u64 = 256 * 1024;

/// Where the python writer puts epoch i's block (descending addresses).
fn epoch_offset(i: u64) -> u64 {
    (EPOCHS - 1 - i) * STRIDE
}

fn epoch_block(i: u64) -> Vec<u8> {
    let unit = format!("epoch{i:06}.");
    unit.as_bytes().iter().copied().cycle().take(4096).collect()
}

/// kill -9 of an offline `cairn flush` half way through: the origin holds
/// the volume as of some past client FLUSH (write-back is ordered epoch by
/// epoch), nothing is lost from the volume, and a new flush completes.
#[test]
fn kill9_during_offline_flush_keeps_the_origin_ordered() {
    if !require_tools("flush_kill9", &["nbdkit"]) || !require_python_nbd("flush_kill9") {
        return;
    }
    let ctx = Ctx::new("flush_kill9");
    let size = 32 * MIB;
    let origin = NbdOrigin::start(&ctx, size, 0x0E, &["--filter=delay", "wdelay=20ms"]);
    let cache = format_for(&ctx, &origin, 8 * MIB);
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &["--no-writeback"]);
    // One block per epoch, each followed by a FLUSH.
    let mut cmd = std::process::Command::new(python());
    cmd.args([
        "-c",
        PY_EPOCHS,
        &server.uri(),
        &EPOCHS.to_string(),
        &STRIDE.to_string(),
    ]);
    let out = run(&mut cmd, TOOL_TIMEOUT);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(server.terminate().success());
    let mut image = pattern(0x0E, size as usize);
    for i in 0..EPOCHS {
        let at = epoch_offset(i) as usize;
        image[at..at + 4096].copy_from_slice(&epoch_block(i));
    }

    // Offline flush against a slow origin; kill it part way.
    let c = cache.to_string_lossy().into_owned();
    let mut flush = ctx.spawn("cairn flush", &mut ctx.cmd(&["flush", "--cache", &c]));
    // Kill once the first epochs are on the origin (each takes 20 ms+).
    let first = epoch_block(0);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while read_range(&origin.file, epoch_offset(0), 4096) != first {
        assert!(
            std::time::Instant::now() < deadline,
            "write-back never started"
        );
        assert!(
            flush.try_status().is_none(),
            "flush ended: {}",
            flush.log_text()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        flush.try_status().is_none(),
        "the flush finished before the kill; slow the origin down"
    );
    flush.kill9();

    // Ordered write-back: epochs 0..k on the origin, none after.
    let on_origin = origin_bytes(&origin.file);
    let done: Vec<bool> = (0..EPOCHS)
        .map(|i| {
            let at = epoch_offset(i) as usize;
            let b = &on_origin[at..at + 4096];
            if b == epoch_block(i).as_slice() {
                true
            } else {
                assert_eq!(
                    b,
                    &pattern(0x0E, size as usize)[at..at + 4096],
                    "epoch {i}: neither old nor new"
                );
                false
            }
        })
        .collect();
    let k = done.iter().take_while(|&&d| d).count();
    assert!(
        done[k..].iter().all(|&d| !d),
        "epochs reached the origin out of order: {done:?}"
    );
    assert!(
        k > 0 && k < EPOCHS as usize,
        "kill did not land mid-flush: {k} epochs written"
    );
    eprintln!("kill -9 after {k} of {EPOCHS} epochs were written back");

    // The volume is whole, and a new flush completes.
    let mut server = ctx.serve(&cache, &sock, &["--no-writeback"]);
    assert_same_bytes(
        "volume after the killed flush",
        &nbd_read(&server.uri(), 0, size as usize),
        &image,
    );
    assert!(server.terminate().success());
    ctx.flush(&cache);
    assert_eq!(u64_of(&ctx.status(&cache), "dirty_blocks"), 0);
    assert_same_bytes(
        "origin after the second flush",
        &origin_bytes(&origin.file),
        &image,
    );
}

/// The origin's nbdkit dies while cairn serves (kill -9) and comes back
/// later on the same socket: cached data keeps reading correctly, new
/// writes are absorbed and flushed by the cache, status reports the origin
/// failing with its errors counted, and once nbdkit is back cairn
/// reconnects, write-back drains, and the origin file equals everything
/// written.
#[test]
fn origin_lost_while_serving_and_back() {
    if !require_tools("nbd_lost", &["nbdkit"]) || !require_python_nbd("nbd_lost") {
        return;
    }
    let ctx = Ctx::new("nbd_lost");
    let size = 16 * MIB;
    let mut origin = NbdOrigin::start(&ctx, size, 0x10, &[]);
    let cache = format_for(&ctx, &origin, 8 * MIB);
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &[]);
    let uri = server.uri();
    let mut image = pattern(0x10, size as usize);

    // Written and flushed (dirty, then written back), and origin data read
    // once (promoted): both are cached.
    let a = pattern(0xA0, MIB as usize);
    let a_at = MIB;
    nbd_write(&uri, a_at, &a, true);
    image[a_at as usize..(a_at + MIB) as usize].copy_from_slice(&a);
    let r_at = 8 * MIB;
    let r_len = 2 * MIB as usize;
    assert_same_bytes(
        "origin data through cairn",
        &nbd_read(&uri, r_at, r_len),
        &image[r_at as usize..r_at as usize + r_len],
    );
    assert_same_bytes("a, cached", &nbd_read(&uri, a_at, a.len()), &a);

    // The origin dies.
    origin.proc.kill9();

    // Cached data still reads correctly.
    assert_same_bytes("a, origin gone", &nbd_read(&uri, a_at, a.len()), &a);
    assert_same_bytes(
        "promoted origin data, origin gone",
        &nbd_read(&uri, r_at, r_len),
        &image[r_at as usize..r_at as usize + r_len],
    );
    // New writes are accepted and flushed (to the cache).
    let b = pattern(0xB0, 512 << 10);
    let b_at = 4 * MIB + 4096;
    nbd_write(&uri, b_at, &b, true);
    image[b_at as usize..b_at as usize + b.len()].copy_from_slice(&b);
    assert_same_bytes("b, origin gone", &nbd_read(&uri, b_at, b.len()), &b);
    // A read of data only the origin has fails, for that request only.
    let miss = try_nbd_read(&uri, 14 * MIB, 4096);
    assert!(
        !miss.status.success(),
        "a read miss succeeded without an origin"
    );
    // Status: the origin is failing, errors counted; the cache is fine.
    let mut st = serde_json::Value::Null;
    let failing = eventually(Duration::from_secs(30), || {
        st = ctx.status(&cache);
        st["origin_state"] == "failing" && u64_of(&st, "origin_write_errors") > 0
    });
    assert!(failing, "status never reported the origin failing: {st}");
    assert_eq!(st["cache_state"], "ok", "{st}");
    assert_eq!(st["served"], true, "{st}");
    assert!(u64_of(&st, "dirty_blocks") >= 128, "{st}");
    assert!(u64_of(&st, "origin_read_errors") >= 1, "{st}");
    assert!(server.proc.try_status().is_none(), "the daemon died");

    // More writes while it is still down, unflushed this time.
    let c = pattern(0xC0, 64 << 10);
    let c_at = 12 * MIB;
    nbd_write(&uri, c_at, &c, false);
    image[c_at as usize..c_at as usize + c.len()].copy_from_slice(&c);

    // The origin comes back on the same socket: cairn reconnects and
    // write-back drains on its own.
    origin.restart(&ctx);
    let mut st = serde_json::Value::Null;
    let drained = eventually(Duration::from_secs(60), || {
        st = ctx.status(&cache);
        st["origin_state"] == "ok" && u64_of(&st, "dirty_blocks") == 0
    });
    assert!(
        drained,
        "write-back did not drain after the origin came back: {st}"
    );
    // Everything, the unflushed write included, once flushed.
    ctx.flush(&cache);
    assert_same_bytes("origin after recovery", &origin_bytes(&origin.file), &image);
    assert_same_bytes(
        "the volume after recovery",
        &nbd_read(&uri, 0, size as usize),
        &image,
    );
    assert!(server.terminate().success());
}

/// One connection, the origin gone: a read miss waits for the origin's
/// reconnect window, and a cached read sent after it on the same
/// connection. Prints, per round, how long each took and how it ended.
const MISS_AND_HIT_ON_ONE_CONNECTION: &str = r#"
import nbd, sys, time
h = nbd.NBD()
h.connect_uri(sys.argv[1])
hit_at, miss_at = int(sys.argv[2]), int(sys.argv[3])
for round in range(4):
    t0 = time.monotonic()
    miss = h.aio_pread(nbd.Buffer(4096), miss_at + round * 65536)
    time.sleep(0.05)
    hit_buf = nbd.Buffer(4096)
    hit = h.aio_pread(hit_buf, hit_at)
    done = {}
    while len(done) < 2:
        h.poll(1)
        for name, cookie in (("hit", hit), ("miss", miss)):
            if name in done:
                continue
            try:
                if h.aio_command_completed(cookie):
                    done[name] = ("ok", time.monotonic() - t0)
            except nbd.Error:
                done[name] = ("err", time.monotonic() - t0)
    print(round, done["hit"][0], "%.3f" % done["hit"][1], done["miss"][0], "%.3f" % done["miss"][1], flush=True)
"#;

#[test]
fn a_miss_waiting_for_the_origin_does_not_hold_up_its_connection() {
    let test = "nbd_miss_hit";
    if !require_tools(test, &["nbdkit"]) || !require_python_nbd(test) {
        return;
    }
    let ctx = Ctx::new(test);
    let size = 16 * MIB;
    let mut origin = NbdOrigin::start(&ctx, size, 0x21, &[]);
    let cache = format_for(&ctx, &origin, 8 * MIB);
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &[]);
    let uri = server.uri();
    let image = pattern(0x21, size as usize);
    // Cached: read once through cairn.
    assert_same_bytes("promoted", &nbd_read(&uri, 0, 64 << 10), &image[..64 << 10]);
    origin.proc.kill9();
    let out = python_ok(
        MISS_AND_HIT_ON_ONE_CONNECTION,
        &[&uri, "4096", &(8 * MIB).to_string()],
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let mut waited = 0;
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(fields.len(), 5, "{text}");
        let (hit_ok, hit_s, miss_ok, miss_s) = (
            fields[1],
            fields[2].parse::<f64>().unwrap(),
            fields[3],
            fields[4].parse::<f64>().unwrap(),
        );
        assert_eq!(
            hit_ok, "ok",
            "a cached read failed with the origin gone: {text}"
        );
        assert_eq!(miss_ok, "err", "a miss succeeded with no origin: {text}");
        // A miss that waited for reconnect attempts: the cached read sent
        // after it was answered long before it. With the attempts on the
        // connection's own thread, both came back together.
        if miss_s > 1.0 {
            waited += 1;
            assert!(
                hit_s + 0.5 < miss_s,
                "the cached read waited for the miss's reconnect: {text}"
            );
        }
    }
    assert!(
        waited >= 1,
        "no miss waited for a reconnect, so nothing was shown: {text}"
    );
    let _ = std::fs::remove_file(&origin.socket);
    assert!(server.terminate().success());
}

/// One connection: an NBD CACHE of blocks only a slow origin has (each
/// origin read takes 1 s), and a cached read sent after it. Prints how
/// long each took.
const CACHE_AND_HIT_ON_ONE_CONNECTION: &str = r#"
import nbd, sys, time
h = nbd.NBD()
h.connect_uri(sys.argv[1])
hit_at, cache_at = int(sys.argv[2]), int(sys.argv[3])
t0 = time.monotonic()
cache = h.aio_cache(65536, cache_at)
time.sleep(0.05)
hit = h.aio_pread(nbd.Buffer(4096), hit_at)
done = {}
while len(done) < 2:
    h.poll(1)
    for name, cookie in (("hit", hit), ("cache", cache)):
        if name not in done and h.aio_command_completed(cookie):
            done[name] = time.monotonic() - t0
print("%.3f %.3f" % (done["hit"], done["cache"]), flush=True)
"#;

#[test]
fn a_cache_command_waiting_for_the_origin_does_not_hold_up_its_connection() {
    let test = "nbd_cache_cmd";
    if !require_tools(test, &["nbdkit"]) || !require_python_nbd(test) {
        return;
    }
    let ctx = Ctx::new(test);
    let size = 16 * MIB;
    let origin = NbdOrigin::start(&ctx, size, 0x31, &["--filter=delay", "rdelay=1"]);
    let cache = format_for(&ctx, &origin, 8 * MIB);
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &[]);
    let uri = server.uri();
    let image = pattern(0x31, size as usize);
    // Cached: read once through cairn (a 1 s origin read).
    assert_same_bytes("promoted", &nbd_read(&uri, 0, 4096), &image[..4096]);
    let out = python_ok(
        CACHE_AND_HIT_ON_ONE_CONNECTION,
        &[&uri, "0", &(8 * MIB).to_string()],
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let times: Vec<f64> = text
        .split_whitespace()
        .map(|t| t.parse().expect("a time"))
        .collect();
    assert_eq!(times.len(), 2, "{text}");
    let (hit_s, cache_s) = (times[0], times[1]);
    assert!(
        cache_s >= 0.9,
        "the CACHE did not wait for the origin: {text}"
    );
    assert!(
        hit_s + 0.5 < cache_s,
        "the cached read waited for the CACHE's origin reads: {text}"
    );
    // The prefetched blocks are cached now: they read without the origin.
    let st = ctx.status(&cache);
    assert!(u64_of(&st, "promotions") >= 16, "{st}");
    assert!(server.terminate().success());
}

/// One connection: a BLOCK_STATUS of blocks only the origin knows (its
/// extents answered after 1 s), and a cached read sent after it. Prints
/// how long each took and the extents seen.
const STATUS_AND_HIT_ON_ONE_CONNECTION: &str = r#"
import nbd, sys, time
h = nbd.NBD()
h.add_meta_context("base:allocation")
h.connect_uri(sys.argv[1])
hit_at, status_at = int(sys.argv[2]), int(sys.argv[3])
extents = []
def seen(metacontext, offset, entries, err):
    extents.extend(entries)
    return 0
t0 = time.monotonic()
status = h.aio_block_status(65536, status_at, seen)
time.sleep(0.05)
hit = h.aio_pread(nbd.Buffer(4096), hit_at)
done = {}
while len(done) < 2:
    h.poll(1)
    for name, cookie in (("hit", hit), ("status", status)):
        if name not in done and h.aio_command_completed(cookie):
            done[name] = time.monotonic() - t0
print("%.3f %.3f %d" % (done["hit"], done["status"], len(extents)), flush=True)
"#;

#[test]
fn a_block_status_asking_the_origin_does_not_hold_up_its_connection() {
    let test = "nbd_status_slow";
    if !require_tools(test, &["nbdkit"]) || !require_python_nbd(test) {
        return;
    }
    let ctx = Ctx::new(test);
    let size = 16 * MIB;
    let origin = NbdOrigin::start(&ctx, size, 0x41, &["--filter=delay", "delay-extents=1"]);
    let cache = format_for(&ctx, &origin, 8 * MIB);
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &[]);
    let uri = server.uri();
    let image = pattern(0x41, size as usize);
    assert_same_bytes("promoted", &nbd_read(&uri, 0, 4096), &image[..4096]);
    let out = python_ok(
        STATUS_AND_HIT_ON_ONE_CONNECTION,
        &[&uri, "0", &(8 * MIB).to_string()],
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let fields: Vec<f64> = text
        .split_whitespace()
        .map(|t| t.parse().expect("a number"))
        .collect();
    assert_eq!(fields.len(), 3, "{text}");
    let (hit_s, status_s, extents) = (fields[0], fields[1], fields[2]);
    assert!(extents >= 2.0, "no extent came back: {text}");
    assert!(
        status_s >= 0.9,
        "the block status did not ask the origin: {text}"
    );
    assert!(
        hit_s + 0.5 < status_s,
        "the cached read waited for the block status's question to the origin: {text}"
    );
    assert!(server.terminate().success());
}
