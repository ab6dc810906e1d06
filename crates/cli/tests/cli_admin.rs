//! The management commands against the real binary, with a daemon running
//! (online, answered over the admin socket) and without one (offline, the
//! command opens the devices itself): `status --json`, `flush`, `check`,
//! the metrics endpoint and SIGTERM.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::path::Path;
use std::time::Duration;

use common::*;

const MIB: u64 = 1 << 20;

/// Writes that cover aligned, unaligned and overlapping cases; returns the
/// expected image of the first `len` bytes of the volume.
fn write_mix(uri: &str, len: usize, flush: bool) -> Vec<u8> {
    let mut image = vec![0u8; len];
    // libnbd obeys the advertised 512-byte minimum; byte-unaligned I/O is
    // covered through qemu-io in the interop tests.
    let writes: [(u64, usize, u64); 4] = [
        (0, 1 << 20, 1),               // 1 MiB, aligned
        (1024, 2560, 2),               // inside one block: read-modify-write
        (5 * MIB + 512, 256 << 10, 3), // sub-block start and end, many blocks
        (9 * MIB - 512, 1024, 4),      // straddles a block boundary
    ];
    for (offset, length, seed) in writes {
        let data = pattern(seed, length);
        nbd_write(uri, offset, &data, flush);
        image[offset as usize..offset as usize + length].copy_from_slice(&data);
    }
    image
}

fn blocks_touched() -> u64 {
    // 0..1M = 256 blocks (1024..3584 is inside block 0); 5M+512 .. +256K
    // touches 65 blocks; 9M-512 .. 9M+512 touches 2.
    256 + 65 + 2
}

const STATUS_KEYS: [&str; 8] = [
    "dirty_blocks",
    "read_hits",
    "read_misses",
    "checksum_mismatches",
    "mode",
    "served",
    "origin_write_errors",
    "volume_size_bytes",
];

fn assert_status_shape(v: &serde_json::Value) {
    for key in STATUS_KEYS {
        assert!(v.get(key).is_some(), "status --json lacks {key}: {v}");
    }
    for key in [
        "dirty_blocks",
        "read_hits",
        "read_misses",
        "checksum_mismatches",
    ] {
        assert!(v[key].is_u64(), "{key} is not a count: {v}");
    }
    assert_eq!(v["mode"], "writeback", "{v}");
    // Keys are stable snake_case.
    for key in v.as_object().expect("an object").keys() {
        assert!(
            key.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
            "key {key:?} is not snake_case"
        );
    }
}

#[test]
fn status_json_online_and_offline() {
    if !require_python_nbd("status_json") {
        return;
    }
    let ctx = Ctx::new("status_json");
    let (cache, _origin) = ctx.setup(32 * MIB, 64 * MIB);
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &["--no-writeback"]);

    let st = ctx.status(&cache);
    assert_status_shape(&st);
    assert_eq!(st["served"], true, "{st}");
    assert_eq!(u64_of(&st, "volume_size_bytes"), 64 * MIB);
    assert_eq!(u64_of(&st, "dirty_blocks"), 0);

    // 16 blocks written (dirty), read back (16 hits), 16 never written
    // blocks read from the origin (misses).
    let data = pattern(7, 64 << 10);
    nbd_write(&server.uri(), 0, &data, true);
    assert_eq!(nbd_read(&server.uri(), 0, data.len()), data);
    assert_eq!(
        nbd_read(&server.uri(), 32 * MIB, 64 << 10),
        vec![0; 64 << 10]
    );
    let st = ctx.status(&cache);
    assert_status_shape(&st);
    assert_eq!(u64_of(&st, "dirty_blocks"), 16, "{st}");
    assert!(u64_of(&st, "read_hits") >= 16, "{st}");
    assert!(u64_of(&st, "read_misses") >= 16, "{st}");
    assert_eq!(u64_of(&st, "checksum_mismatches"), 0, "{st}");

    // The human form says the same, with requests and blocks told apart.
    let out = ctx.cairn_ok(&["status", "--cache", &cache.to_string_lossy()]);
    let human = stdout(&out);
    assert!(human.contains("16 dirty"), "human status: {human}");
    let reads = format!(
        "reads {} requests (blocks: {} hits, {} misses,",
        u64_of(&st, "reads"),
        u64_of(&st, "read_hits"),
        u64_of(&st, "read_misses")
    );
    let writes = format!(
        "writes {} requests (blocks: {} hits)",
        u64_of(&st, "writes"),
        u64_of(&st, "write_hits")
    );
    assert!(
        human.contains(&reads) && human.contains(&writes),
        "human status does not say {reads:?} and {writes:?}: {human}"
    );

    assert!(server.terminate().success());
    // Offline: the same keys, from the cache device alone; the counters
    // since a daemon's start are null (there is none), not zero.
    let st = ctx.status(&cache);
    for key in STATUS_KEYS {
        assert!(
            st.get(key).is_some(),
            "offline status --json lacks {key}: {st}"
        );
    }
    assert_eq!(st["served"], false, "{st}");
    assert_eq!(st["view"], "offline", "{st}");
    assert_eq!(u64_of(&st, "dirty_blocks"), 16, "dirty data survives: {st}");
    assert_eq!(u64_of(&st, "volume_size_bytes"), 64 * MIB, "{st}");
    for key in ["read_hits", "read_misses", "checksum_mismatches"] {
        assert!(st[key].is_null(), "{key} offline: {st}");
    }
    assert!(st["lifetime"]["writes"].is_u64(), "{st}");
}

/// `cairn flush` with the daemon running drains through the admin socket.
#[test]
fn flush_online_writes_everything_back() {
    if !require_python_nbd("flush_online") {
        return;
    }
    let ctx = Ctx::new("flush_online");
    let (cache, origin) = ctx.setup(32 * MIB, 16 * MIB);
    let sock = ctx.path("nbd.sock");
    // No background write-back: the data stays dirty until asked.
    let mut server = ctx.serve(&cache, &sock, &["--no-writeback"]);
    let image = write_mix(&server.uri(), 16 << 20, false);
    let st = ctx.status(&cache);
    assert_eq!(u64_of(&st, "dirty_blocks"), blocks_touched(), "{st}");
    assert!(
        read_range(&origin, 0, 1 << 20).iter().all(|&b| b == 0),
        "the origin changed before write-back"
    );

    let out = ctx.flush(&cache);
    assert!(
        stdout(&out).contains("write-back complete"),
        "{}",
        describe(&out)
    );
    let st = ctx.status(&cache);
    assert_eq!(st["served"], true);
    assert_eq!(u64_of(&st, "dirty_blocks"), 0, "{st}");
    assert_same_bytes(
        "origin after online flush",
        &std::fs::read(&origin).expect("read origin"),
        &image,
    );
    // The volume still reads the same.
    assert_same_bytes(
        "volume after flush",
        &nbd_read(&server.uri(), 0, 16 << 20),
        &image,
    );
    assert!(server.terminate().success());
}

/// `cairn flush` with no daemon opens the cache and drains it itself.
#[test]
fn flush_offline_writes_everything_back() {
    if !require_python_nbd("flush_offline") {
        return;
    }
    let ctx = Ctx::new("flush_offline");
    let (cache, origin) = ctx.setup(32 * MIB, 16 * MIB);
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &["--no-writeback"]);
    let image = write_mix(&server.uri(), 16 << 20, true);
    // kill -9: the offline flush must also cope with a cache that needs
    // log replay, not only with a cleanly closed one.
    server.kill9();
    let st = ctx.status(&cache);
    assert_eq!(st["served"], false);
    assert_eq!(u64_of(&st, "dirty_blocks"), blocks_touched(), "{st}");

    let out = ctx.flush(&cache);
    // Each write above was its own flush epoch, and write-back goes epoch
    // by epoch, so block 0 (written twice) goes to the origin twice.
    let written: u64 = stdout(&out)
        .split_whitespace()
        .nth(2)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no block count: {}", describe(&out)));
    assert!(
        (blocks_touched()..=blocks_touched() + 2).contains(&written),
        "{}",
        describe(&out)
    );
    assert_eq!(u64_of(&ctx.status(&cache), "dirty_blocks"), 0);
    assert_same_bytes(
        "origin after offline flush",
        &std::fs::read(&origin).expect("read origin"),
        &image,
    );
    // A second flush has nothing to do and still succeeds.
    let out = ctx.flush(&cache);
    assert!(
        stdout(&out).contains("0 blocks written"),
        "{}",
        describe(&out)
    );
}

/// Find the only block-aligned copy of `block` in the cache file.
fn find_block(cache: &Path, block: &[u8]) -> u64 {
    let bytes = std::fs::read(cache).expect("read cache");
    let hits: Vec<usize> = (0..bytes.len().saturating_sub(block.len()))
        .step_by(4096)
        .filter(|&at| &bytes[at..at + block.len()] == block)
        .collect();
    assert_eq!(
        hits.len(),
        1,
        "expected the pattern once in the cache file, found it at {hits:?}"
    );
    hits[0] as u64
}

fn flip_byte(path: &Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open cache for corruption");
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).expect("read byte");
    b[0] ^= 0x40;
    f.write_all_at(&b, at).expect("write byte");
    f.sync_all().expect("sync");
}

fn check(ctx: &Ctx, cache: &Path) -> std::process::Output {
    let out = ctx.cairn(&["check", "--cache", &cache.to_string_lossy()]);
    assert!(!stderr(&out).contains("panicked"), "{}", describe(&out));
    out
}

/// `cairn check` passes on a good cache, online and offline; after a byte
/// of a dirty block is flipped behind cairn's back it exits 1 and names
/// the block's origin address, online and offline; reads of that block
/// fail (never wrong data) and write-back does not copy it. Uses 8 KiB
/// blocks so a block-number/byte-offset mix-up shows.
#[test]
fn check_finds_a_corrupted_dirty_block() {
    if !require_python_nbd("check_corrupt") {
        return;
    }
    let ctx = Ctx::new("check_corrupt");
    let cache = ctx.file("cache.img", 32 * MIB);
    let origin = ctx.file("origin.img", 64 * MIB);
    ctx.format(&cache, &origin.to_string_lossy(), &["--block-size", "8K"]);
    let sock = ctx.path("nbd.sock");
    const LBA: u64 = 5;
    const BS: u64 = 8192;
    let block = pattern(0xC0FFEE, BS as usize);
    let mut server = ctx.serve(&cache, &sock, &["--no-writeback"]);
    nbd_write(&server.uri(), LBA * BS, &block, true);
    // Some clean and dirty neighbours that must stay good.
    nbd_write(&server.uri(), 0, &pattern(1, 4 * BS as usize), true);
    let _ = nbd_read(&server.uri(), 32 * MIB, 64 << 10);

    let out = check(&ctx, &cache);
    assert!(out.status.success(), "online check: {}", describe(&out));
    assert!(stdout(&out).contains("check passed"), "{}", describe(&out));
    assert!(server.terminate().success());
    let out = check(&ctx, &cache);
    assert_eq!(out.status.code(), Some(0), "offline: {}", describe(&out));
    assert!(stdout(&out).contains("check passed"), "{}", describe(&out));

    // Corrupt one byte of the cached copy, offline.
    let at = find_block(&cache, &block);
    flip_byte(&cache, at + 1234);
    let want = format!("origin block {LBA} (byte offset {})", LBA * BS);
    let out = check(&ctx, &cache);
    assert_eq!(out.status.code(), Some(1), "offline: {}", describe(&out));
    assert!(stdout(&out).contains(&want), "offline: {}", describe(&out));
    assert!(stdout(&out).contains("1 bad blocks"), "{}", describe(&out));

    // Online, the daemon answers the same.
    let mut server = ctx.serve(&cache, &sock, &["--no-writeback"]);
    let out = check(&ctx, &cache);
    assert_eq!(out.status.code(), Some(1), "online: {}", describe(&out));
    assert!(stdout(&out).contains(&want), "online: {}", describe(&out));

    // Reading the block fails; the neighbours read fine.
    let r = try_nbd_read(&server.uri(), LBA * BS, BS as usize);
    assert!(
        !r.status.success(),
        "a read of a corrupt dirty block returned data"
    );
    assert_eq!(
        nbd_read(&server.uri(), 0, 4 * BS as usize),
        pattern(1, 4 * BS as usize)
    );
    let st = ctx.status(&cache);
    assert!(u64_of(&st, "checksum_mismatches") >= 1, "{st}");

    // Write-back never copies the bad block to the origin, and flush says
    // so: it exits 1 naming the unrecoverable block count.
    let out = ctx.cairn(&["flush", "--cache", &cache.to_string_lossy()]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "flush with a lost block: {}",
        describe(&out)
    );
    assert!(
        stdout(&out).contains("1 dirty blocks failed their checksum"),
        "{}",
        describe(&out)
    );
    let st = ctx.status(&cache);
    assert_eq!(
        u64_of(&st, "corrupt_blocks") + u64_of(&st, "lost_blocks"),
        1,
        "{st}"
    );
    assert!(
        read_range(&origin, LBA * BS, BS as usize)
            .iter()
            .all(|&b| b == 0),
        "a block that failed its checksum reached the origin"
    );
    assert_eq!(
        read_range(&origin, 0, 4 * BS as usize),
        pattern(1, 4 * BS as usize)
    );
    assert!(server.terminate().success());
}

/// GET over plain HTTP/1.1. `split` sends the request in two segments
/// with a pause between, as a slow client or a small MSS would.
fn http_get(addr: &str, path: &str, split: bool) -> String {
    let mut s = std::net::TcpStream::connect(addr).expect("connect to metrics");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if split {
        s.write_all(&request.as_bytes()[..10]).expect("send");
        // No answer to half a request: a server that answers and closes
        // now resets the connection when the rest arrives.
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        let mut one = [0u8; 1];
        match s.read(&mut one) {
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            other => panic!("the metrics server answered half a request: {other:?}"),
        }
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s.write_all(&request.as_bytes()[10..])
            .expect("send the rest");
    } else {
        s.write_all(request.as_bytes()).expect("send request");
    }
    let mut body = String::new();
    s.read_to_string(&mut body).expect("read response");
    body
}

/// The value of an exposition line `NAME VALUE` (exact name with labels).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("{name} not in metrics:\n{text}"))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn metrics_endpoint_serves_prometheus_text() {
    if !require_python_nbd("metrics") {
        return;
    }
    let ctx = Ctx::new("metrics");
    let (cache, _) = ctx.setup(32 * MIB, 64 * MIB);
    let sock = ctx.path("nbd.sock");
    let addr = format!("127.0.0.1:{}", free_port());
    let mut server = ctx.serve(&cache, &sock, &["--metrics", &addr]);
    let before = http_get(&addr, "/metrics", false);
    assert!(before.starts_with("HTTP/1.1 200"), "{before}");
    assert!(before.contains("text/plain"), "{before}");
    let reads_before = metric(&before, "cairn_reads_total");

    nbd_write(&server.uri(), 0, &pattern(3, 1 << 20), true);
    for _ in 0..3 {
        let _ = nbd_read(&server.uri(), 0, 64 << 10);
    }
    let text = http_get(&addr, "/metrics", true);
    assert!(text.contains("# TYPE cairn_reads_total counter"), "{text}");
    assert!(
        metric(&text, "cairn_reads_total") >= reads_before + 3.0,
        "{text}"
    );
    assert!(metric(&text, "cairn_writes_total") >= 1.0, "{text}");
    assert!(
        text.contains("# TYPE cairn_request_latency_seconds histogram"),
        "{text}"
    );
    let inf = metric(
        &text,
        "cairn_request_latency_seconds_bucket{op=\"read\",le=\"+Inf\"}",
    );
    assert!(inf >= 3.0, "{text}");
    assert_eq!(
        inf,
        metric(&text, "cairn_request_latency_seconds_count{op=\"read\"}"),
        "+Inf bucket equals the count"
    );
    // Buckets are cumulative: non-decreasing in le order.
    let buckets: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with("cairn_request_latency_seconds_bucket{op=\"write\""))
        .map(|l| l.rsplit(' ').next().unwrap_or("x").parse().expect("value"))
        .collect();
    assert!(buckets.len() > 3, "{text}");
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]), "{buckets:?}");
    assert!(metric(&text, "cairn_volume_size_bytes") == (64 * MIB) as f64);
    assert!(server.terminate().success());
}

/// SIGTERM finishes, flushes and exits 0; data written without a client
/// flush is still there afterwards.
#[test]
fn sigterm_exits_zero_and_keeps_unflushed_writes() {
    if !require_python_nbd("sigterm") {
        return;
    }
    let ctx = Ctx::new("sigterm");
    let (cache, origin) = ctx.setup(32 * MIB, 64 * MIB);
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &["--no-writeback"]);
    let data = pattern(99, 3 << 20);
    let offset = 7 * MIB + 4096;
    nbd_write(&server.uri(), offset, &data, false); // no flush
    let status = server.terminate();
    assert_eq!(
        status.code(),
        Some(0),
        "SIGTERM exit: {status:?}\n{}",
        server.proc.log_text()
    );
    assert!(
        server.proc.log_text().contains("clean shutdown"),
        "{}",
        server.proc.log_text()
    );
    assert!(!sock.exists(), "the socket was not removed on exit");

    let st = ctx.status(&cache);
    assert_eq!(st["served"], false);
    assert_eq!(u64_of(&st, "dirty_blocks"), 768, "{st}");
    assert!(
        read_range(&origin, offset, data.len())
            .iter()
            .all(|&b| b == 0),
        "with write-back paused, the data should only be in the cache"
    );

    let mut server = ctx.serve(&cache, &sock, &[]);
    assert_same_bytes(
        "data after SIGTERM and restart",
        &nbd_read(&server.uri(), offset, data.len()),
        &data,
    );
    // SIGINT behaves the same.
    server.proc.signal(libc::SIGINT);
    let st = server
        .proc
        .wait_timeout(Duration::from_secs(60))
        .expect("exit after SIGINT");
    assert_eq!(st.code(), Some(0));
}

/// A SIGTERM that arrives the moment the socket appears still gets the
/// clean shutdown (the handler is installed before the socket exists).
#[test]
fn sigterm_right_after_start_is_clean() {
    let ctx = Ctx::new("sigterm_early");
    let (cache, _) = ctx.setup(8 * MIB, 16 * MIB);
    let sock = ctx.path("nbd.sock");
    for round in 0..20 {
        let mut p = ctx.spawn_serve(&cache, &sock, &[]);
        // Spin, not sleep: signal within microseconds of the socket.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !sock.exists() {
            assert!(std::time::Instant::now() < deadline, "no socket");
            if p.try_status().is_some() {
                panic!("serve exited early:\n{}", p.log_text());
            }
            std::hint::spin_loop();
        }
        let status = p.terminate(Duration::from_secs(60));
        let log = p.log_text();
        assert_eq!(status.code(), Some(0), "round {round}: {status:?}\n{log}");
        assert!(log.contains("clean shutdown"), "round {round}:\n{log}");
    }
}

/// The README's first step: `cairn demo` creates, formats and serves, and
/// says how to connect; Ctrl-C (SIGINT) stops it cleanly; a second run
/// reuses the formatted files.
#[test]
fn demo_serves_and_stops_cleanly() {
    let ctx = Ctx::new("demo");
    let dir = ctx.path("demo");
    let d = dir.to_string_lossy().into_owned();
    for run in 0..2 {
        let mut p = ctx.spawn("cairn demo", &mut ctx.cmd(&["demo", "--dir", &d]));
        let sock = dir.join("cairn.sock");
        wait_for_path(&sock, &mut p);
        assert!(
            eventually(Duration::from_secs(30), || p
                .log_text()
                .contains("Press Ctrl-C")),
            "{}",
            p.log_text()
        );
        let log = p.log_text();
        assert!(log.contains("nbd+unix:///?socket="), "{log}");
        assert_eq!(log.contains("formatted demo cache"), run == 0, "{log}");
        let st = ctx.status(&dir.join("cache.img"));
        assert_eq!(st["served"], true, "{st}");
        assert_eq!(u64_of(&st, "volume_size_bytes"), 256 * MIB);
        if run == 0 {
            run_demo_hints(&log);
        }
        p.signal(libc::SIGINT);
        let status = p.wait_timeout(Duration::from_secs(60)).expect("demo exits");
        assert_eq!(status.code(), Some(0), "{}", p.log_text());
        assert!(!sock.exists());
    }
}

/// Every command the demo suggests runs as printed, from the repository
/// root, in a shell without this test's environment (no `cairn` on the
/// PATH, no CAIRN_RUNTIME_DIR): the tools it names are the CI's.
fn run_demo_hints(log: &str) {
    let hints: Vec<&str> = log
        .lines()
        .skip_while(|l| !l.starts_with("Try, in another terminal:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .map(str::trim)
        .collect();
    assert!(hints.len() >= 4, "the demo's hints: {log}");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for hint in hints {
        let program = hint
            .split_whitespace()
            .find(|w| !w.contains('='))
            .expect("a command");
        if !program.contains('/') && !require_tools("demo hints", &[program]) {
            continue;
        }
        let out = run(
            std::process::Command::new("sh")
                .arg("-c")
                .arg(hint)
                .current_dir(&root)
                .env_remove("CAIRN_RUNTIME_DIR")
                .env("PATH", "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"),
            TOOL_TIMEOUT,
        );
        assert!(
            out.status.success(),
            "the demo's hint `{hint}` fails as printed: {}",
            describe(&out)
        );
    }
}

/// `cairn mode` online drains dirty data and switches; writethrough then
/// puts acknowledged writes on the origin at once; `cairn warm` caches a
/// range; the mode survives a restart and can be switched offline too.
#[test]
fn mode_switch_and_warm_online_and_offline() {
    if !require_python_nbd("mode_switch") {
        return;
    }
    let ctx = Ctx::new("mode_switch");
    let (cache, origin) = ctx.setup(32 * MIB, 16 * MIB);
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &["--no-writeback"]);
    let image = write_mix(&server.uri(), 16 << 20, false);
    let st = ctx.status(&cache);
    assert!(u64_of(&st, "dirty_blocks") > 0, "{st}");
    assert_eq!(st["mode"], "writeback");

    let out = ctx.cairn_ok(&["mode", "--cache", &cache.to_string_lossy(), "writethrough"]);
    assert!(
        stdout(&out).contains("mode is now writethrough"),
        "{}",
        describe(&out)
    );
    let st = ctx.status(&cache);
    assert_eq!(st["mode"], "writethrough", "{st}");
    assert_eq!(
        u64_of(&st, "dirty_blocks"),
        0,
        "leaving writeback drains: {st}"
    );
    assert_same_bytes(
        "origin after the switch",
        &std::fs::read(&origin).expect("origin"),
        &image,
    );

    // Writethrough: acknowledged (no flush) means on the origin.
    let data = pattern(99, 8192);
    nbd_write(&server.uri(), 1 << 20, &data, false);
    assert_same_bytes(
        "writethrough write",
        &read_range(&origin, 1 << 20, 8192),
        &data,
    );

    let out = ctx.cairn_ok(&["warm", "--cache", &cache.to_string_lossy(), "4M:1M"]);
    assert!(stdout(&out).contains("256 blocks"), "{}", describe(&out));
    assert!(server.terminate().success());

    // Persisted across a restart; switched back offline.
    assert_eq!(ctx.status(&cache)["mode"], "writethrough");
    ctx.cairn_ok(&["mode", "--cache", &cache.to_string_lossy(), "writeback"]);
    assert_eq!(ctx.status(&cache)["mode"], "writeback");
}

/// `cairn warm` refuses a range that runs past the end of the volume (it
/// was clipped and reported as a success), as it refuses one that starts
/// past it, naming the range and the volume's size; offline and online.
#[test]
fn warm_refuses_a_range_past_the_end() {
    let ctx = Ctx::new("warm_past_end");
    let (cache, _) = ctx.setup(32 * MIB, 64 * MIB);
    let c = cache.to_string_lossy().to_string();
    let refused = |out: &std::process::Output, offset: &str, length: &str| {
        assert_clean_failure(
            out,
            &[
                &format!("range of {length} bytes at offset {offset}"),
                "past the end of the 67108864-byte volume",
            ],
        );
    };
    refused(
        &ctx.cairn(&["warm", "--cache", &c, "63M:4M"]),
        "66060288",
        "4194304",
    );
    assert!(
        stderr(&ctx.cairn(&["warm", "--cache", &c, "63M:4M"])).contains("give 66060288:1048576"),
        "no advice on the range that fits"
    );
    refused(
        &ctx.cairn(&["warm", "--cache", &c, "200M:1M"]),
        "209715200",
        "1048576",
    );
    let out = ctx.cairn_ok(&["warm", "--cache", &c, "63M:1M"]);
    assert!(stdout(&out).contains("256 blocks"), "{}", describe(&out));

    let mut server = ctx.serve(&cache, &ctx.path("nbd.sock"), &[]);
    refused(
        &ctx.cairn(&["warm", "--cache", &c, "63M:4M"]),
        "66060288",
        "4194304",
    );
    assert!(server.terminate().success());
}

/// `cairn warm` is not a client read: its reads move the `prefetch_*`
/// counters (status and metrics), and `reads`, `read_hits`, `read_misses`
/// and the hit ratio stay the clients' (they counted warm's reads, so a
/// freshly warmed cache showed a hit ratio no client had).
#[test]
fn warm_is_counted_apart_from_client_reads() {
    let ctx = Ctx::new("warm_counted_apart");
    let (cache, _) = ctx.setup(32 * MIB, 64 * MIB);
    let c = cache.to_string_lossy().to_string();
    let addr = format!("127.0.0.1:{}", free_port());
    let mut server = ctx.serve(&cache, &ctx.path("nbd.sock"), &["--metrics", &addr]);
    // Twice: 256 misses, then 256 hits.
    for _ in 0..2 {
        let out = ctx.cairn_ok(&["warm", "--cache", &c, "4M:1M"]);
        assert!(stdout(&out).contains("256 blocks"), "{}", describe(&out));
    }
    let st = ctx.status(&cache);
    for key in ["reads", "read_bytes", "read_hits", "read_misses"] {
        assert_eq!(u64_of(&st, key), 0, "warm counted in {key}: {st}");
    }
    assert_eq!(st["read_hit_ratio"].as_f64(), Some(0.0), "{st}");
    assert_eq!(u64_of(&st, "prefetch_reads"), 2, "{st}");
    assert_eq!(u64_of(&st, "prefetch_bytes"), 2 * MIB, "{st}");
    assert_eq!(u64_of(&st, "prefetch_misses"), 256, "{st}");
    assert_eq!(u64_of(&st, "prefetch_hits"), 256, "{st}");
    let text = http_get(&addr, "/metrics", false);
    assert_eq!(metric(&text, "cairn_reads_total"), 0.0, "{text}");
    assert_eq!(metric(&text, "cairn_read_misses_total"), 0.0, "{text}");
    assert_eq!(
        metric(&text, "cairn_prefetch_misses_total"),
        256.0,
        "{text}"
    );
    assert_eq!(metric(&text, "cairn_prefetch_hits_total"), 256.0, "{text}");
    let human = stdout(&ctx.cairn_ok(&["status", "--cache", &c]));
    assert!(
        human.contains("reads 0 requests (blocks: 0 hits, 0 misses,")
            && human
                .contains("prefetches (warm, NBD CACHE) 2 requests (blocks: 256 hits, 256 misses)"),
        "{human}"
    );
    assert!(server.terminate().success());
}

/// The admin socket of the daemon serving `ctx`'s one cache.
fn admin_socket(ctx: &Ctx) -> std::path::PathBuf {
    let found: Vec<_> = std::fs::read_dir(&ctx.runtime)
        .expect("runtime dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().contains("cairn-admin-"))
        .collect();
    assert_eq!(found.len(), 1, "admin sockets: {found:?}");
    found[0].clone()
}

/// Send raw bytes to the admin socket; return what the daemon answers.
fn admin_raw(socket: &Path, request: &[u8]) -> String {
    let mut s = std::os::unix::net::UnixStream::connect(socket).expect("connect admin");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(request).expect("send");
    // End of request: a daemon waiting for a newline sees the end instead.
    s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read the reply");
    out
}

/// Any local user can reach the admin socket: malformed, unknown, oversized
/// or other-version requests each get one clear error reply, too many idle
/// connections are refused, and the daemon keeps serving throughout.
#[test]
fn admin_socket_refuses_bad_requests_clearly() {
    let ctx = Ctx::new("admin_bad");
    let (cache, _) = ctx.setup(32 * MIB, 64 * MIB);
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &[]);
    let admin = admin_socket(&ctx);
    let long = [vec![b'{'; 10_000], b"\n".to_vec()].concat();
    let cases: [(&[u8], &str); 8] = [
        (b"status\n", "malformed admin message"),
        (b"\xff\xfe\n", "not UTF-8"),
        (
            b"{\"version\":9,\"command\":\"status\"}\n",
            "version 9 is not supported",
        ),
        (b"{\"command\":\"status\"}\n", "version none"),
        (
            b"{\"version\":1,\"command\":\"format\"}\n",
            "unknown admin command \\\"format\\\"",
        ),
        (
            b"{\"version\":1,\"command\":\"mode\",\"mode\":\"fast\"}\n",
            "unknown mode",
        ),
        (
            b"{\"version\":1,\"command\":\"warm\",\"offset_bytes\":-4}\n",
            "admin command warm",
        ),
        (&long, "longer than 4096 bytes"),
    ];
    for (request, needle) in cases {
        let reply = admin_raw(&admin, request);
        assert_eq!(reply.lines().count(), 1, "{reply}");
        assert!(
            reply.starts_with("{\"reply\":\"error\"") && reply.contains(needle),
            "{:?} gave {reply}, not {needle:?}",
            String::from_utf8_lossy(&request[..request.len().min(60)])
        );
    }
    // A well-formed request past the end of the volume fails like offline.
    let reply = admin_raw(
        &admin,
        b"{\"version\":1,\"command\":\"warm\",\"offset_bytes\":1073741824,\"length_bytes\":1}\n",
    );
    assert!(reply.contains("past the end of the"), "{reply}");

    // Idle connections hold their slots (up to the request read timeout);
    // one more than the limit is refused with an error.
    let idle: Vec<_> = (0..16)
        .map(|_| std::os::unix::net::UnixStream::connect(&admin).expect("connect"))
        .collect();
    assert!(
        eventually(Duration::from_secs(10), || admin_raw(&admin, b"")
            .contains("busy with 16 admin requests")),
        "the 17th connection was not refused"
    );
    drop(idle);
    assert!(
        eventually(Duration::from_secs(10), || {
            let out = ctx.cairn(&["status", "--cache", &cache.to_string_lossy(), "--json"]);
            out.status.success()
        }),
        "status does not answer after the idle connections closed"
    );
    assert_eq!(ctx.status(&cache)["served"], true);
    assert!(server.proc.try_status().is_none(), "the daemon died");
    assert!(server.terminate().success());
}

/// The daemon's periodic epoch end (every second while blocks are dirty)
/// is the engine's own flush: it counts in `internal_flushes`, not in the
/// clients' `flushes` and `flush_barriers` (it did, so a client that never
/// flushed showed flushes, and flushes per barrier were off).
#[test]
fn the_periodic_epoch_end_is_not_counted_as_a_client_flush() {
    if !require_python_nbd("epoch_end_counters") {
        return;
    }
    let ctx = Ctx::new("epoch_end_counters");
    let (cache, _) = ctx.setup(32 << 20, 64 << 20);
    let server = ctx.serve(&cache, &ctx.path("nbd.sock"), &[]);
    nbd_write(&server.uri(), 1 << 20, &pattern(5, 64 << 10), false);
    let ended = eventually(Duration::from_secs(20), || {
        u64_of(&ctx.status(&cache), "internal_flushes") > 0
    });
    let st = ctx.status(&cache);
    assert!(ended, "no periodic epoch end within 20 s: {st}");
    assert_eq!(u64_of(&st, "flushes"), 0, "{st}");
    assert_eq!(u64_of(&st, "flush_barriers"), 0, "{st}");
    // A client's flush still counts as one.
    nbd_write(&server.uri(), 2 << 20, &pattern(6, 4096), true);
    let st = ctx.status(&cache);
    assert_eq!(u64_of(&st, "flushes"), 1, "{st}");
}
