//! The cache device stops taking writes while `cairn serve` runs: the real
//! binary goes degraded (dirty data written back, writes straight to the
//! origin), says so in status and metrics, and stays degraded across a
//! restart until `cairn format --force`.
//!
//! The failing device is real: the cache file is served by nbdkit with its
//! protect filter over everything after the two superblock copies (writes
//! that change those bytes fail with EPERM, a worn-out region), and
//! nbdfuse exposes it as a file for `cairn serve --cache`. Needs nbdkit,
//! nbdfuse, fusermount3, /dev/fuse and python3-libnbd; skips without them
//! (fails under CI=true).

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::*;

const MIB: u64 = 1 << 20;

fn environment_ok(test: &str) -> bool {
    require_fuse_device(test) && require_python_nbd(test)
}

/// GET /metrics from `addr`.
fn metrics(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).expect("connect to metrics");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("send");
    let mut body = String::new();
    s.read_to_string(&mut body).expect("read metrics");
    body
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing in:\n{text}"))
}

fn write(uri: &str, image: &mut [u8], at: u64, data: &[u8], flush: bool) {
    nbd_write(uri, at, data, flush);
    image[at as usize..at as usize + data.len()].copy_from_slice(data);
}

#[test]
fn cache_write_failure_goes_degraded_end_to_end() {
    if !environment_ok("cache_degraded") {
        return;
    }
    let ctx = Ctx::new("cache_degraded");
    let size = 16 * MIB;
    let cache_bytes = 8 * MIB;
    let origin = ctx.path("origin.img");
    std::fs::write(&origin, pattern(0x20, size as usize)).expect("write origin");
    let cache = ctx.file("cache.img", cache_bytes);
    ctx.format(&cache, &origin.to_string_lossy(), &[]);
    let mut image = pattern(0x20, size as usize);

    // A healthy cache first: dirty data, flushed and not, left in the log.
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &["--no-writeback"]);
    let uri = server.uri();
    write(&uri, &mut image, 0, &pattern(0xA1, MIB as usize), true);
    write(&uri, &mut image, 3 * MIB, &pattern(0xB2, 256 << 10), false);
    assert!(server.terminate().success());
    let st = ctx.status(&cache);
    assert!(u64_of(&st, "dirty_blocks") >= 300, "{st}");
    assert_eq!(st["cache_state"], "ok", "{st}");

    // Now only the superblocks can still be written.
    // Both superblock copies stay writable; the checkpoint slots and the
    // log do not.
    let mut failing = FuseDevice::start(
        &ctx,
        "cache",
        &[
            "--filter=protect",
            "file",
            &format!("file={}", cache.display()),
            &format!("protect=8192-{}", cache_bytes - 1),
        ],
    );
    let fcache = failing.file();
    let port = free_port();
    let metrics_addr = format!("127.0.0.1:{port}");
    let mut server = ctx.serve(&fcache, &sock, &["--metrics", &metrics_addr]);
    let uri = server.uri();
    // The first record sealed fails: retried, then degraded. The write and
    // its flush still succeed.
    write(&uri, &mut image, 6 * MIB, &pattern(0xC3, 512 << 10), true);
    let st = ctx.status(&fcache);
    assert_eq!(st["cache_state"], "degraded", "{st}");
    assert_eq!(st["state"], "degraded", "{st}");
    assert_eq!(u64_of(&st, "dirty_blocks"), 0, "{st}");
    assert!(u64_of(&st, "degrade_drained_blocks") >= 300, "{st}");
    let errors = u64_of(&st, "cache_write_errors");
    assert!(errors >= 1, "{st}");
    let m = metrics(&metrics_addr);
    assert_eq!(metric(&m, "cairn_cache_degraded"), 1);
    assert_eq!(metric(&m, "cairn_cache_write_errors_total"), errors);
    // Every acknowledged write, those from before included, is on the
    // origin; later writes go straight there.
    assert_same_bytes(
        "origin once degraded",
        &std::fs::read(&origin).unwrap(),
        &image,
    );
    write(&uri, &mut image, 9 * MIB, &pattern(0xD4, 64 << 10), false);
    write(&uri, &mut image, 128 << 10, &pattern(0xE5, 8192), false);
    assert_same_bytes(
        "origin after writes through",
        &std::fs::read(&origin).unwrap(),
        &image,
    );
    assert_same_bytes(
        "volume, degraded",
        &nbd_read(&uri, 0, size as usize),
        &image,
    );
    let st = ctx.status(&fcache);
    assert_eq!(
        u64_of(&st, "cache_write_errors"),
        errors,
        "the cache was written again while degraded: {st}"
    );
    assert!(u64_of(&st, "degraded_writes") >= 2, "{st}");
    let human = ctx.cairn_ok(&["status", "--cache", &fcache.to_string_lossy()]);
    assert!(stdout(&human).contains("degraded"), "{}", describe(&human));
    assert!(server.terminate().success());
    assert!(
        server.proc.log_text().contains("DEGRADED"),
        "no loud log line: {}",
        server.proc.log_text()
    );

    // A restart stays degraded, serves the origin, writes through (and a
    // --mode it cannot honour does not stop it from serving).
    let mut server = ctx.serve(&fcache, &sock, &["--mode", "writethrough"]);
    let uri = server.uri();
    assert!(
        server.proc.log_text().contains("cairn format --force"),
        "the fix is not named: {}",
        server.proc.log_text()
    );
    let st = ctx.status(&fcache);
    assert_eq!(st["cache_state"], "degraded", "{st}");
    assert_eq!(st["mode"], "writeback", "{st}");
    let out = ctx.cairn(&["mode", "--cache", &fcache.to_string_lossy(), "writearound"]);
    assert_clean_failure(&out, &["degraded", "cairn format --force"]);
    assert_same_bytes(
        "volume after a restart",
        &nbd_read(&uri, 0, size as usize),
        &image,
    );
    write(&uri, &mut image, 15 * MIB, &pattern(0xF6, 4096), true);
    assert_same_bytes(
        "origin after a restart",
        &std::fs::read(&origin).unwrap(),
        &image,
    );
    assert!(server.terminate().success());
    failing.stop();

    // Reformatting clears it; the volume is the origin, whole.
    let c = cache.to_string_lossy().into_owned();
    ctx.cairn_ok(&[
        "format",
        "--force",
        "--cache",
        &c,
        "--origin",
        &origin.to_string_lossy(),
    ]);
    let st = ctx.status(&cache);
    assert_eq!(st["cache_state"], "ok", "{st}");
    let mut server = ctx.serve(&cache, &sock, &[]);
    assert_same_bytes(
        "volume after reformatting",
        &nbd_read(&server.uri(), 0, size as usize),
        &image,
    );
    assert!(server.terminate().success());
}
