//! Real NBD clients against `cairn serve`: nbdinfo, qemu-io, qemu-img,
//! nbdcopy, fio's nbd engine and python3-libnbd with several connections.
//! Each test checks what the client reports and, independently, the bytes
//! that reached the volume and the origin.

mod common;

use std::path::{Path, PathBuf};

use common::*;

const MIB: u64 = 1 << 20;

fn write_file(path: &Path, data: &[u8]) {
    std::fs::write(path, data).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

#[test]
fn nbdinfo_reports_size_flags_and_block_sizes() {
    if !require_tools("nbdinfo", &["nbdinfo"]) {
        return;
    }
    let ctx = Ctx::new("nbdinfo");
    let (cache, _) = ctx.setup(16 * MIB, 48 * MIB);
    let mut server = ctx.serve(&cache, &ctx.path("nbd.sock"), &[]);
    let out = run_ok(
        tool("nbdinfo").args(["--json", &server.uri()]),
        TOOL_TIMEOUT,
    );
    let json = json_in(&stdout(&out));
    assert_eq!(json["protocol"], "newstyle-fixed", "{json}");
    let e = &json["exports"][0];
    assert_eq!(e["export-size"], 48 * MIB, "{e}");
    for flag in [
        "can_flush",
        "can_fua",
        "can_trim",
        "can_zero",
        "can_fast_zero",
        "can_multi_conn",
        "can_cache",
    ] {
        assert_eq!(e[flag], true, "{flag} in {e}");
    }
    assert_eq!(e["is_read_only"], false, "{e}");
    assert_eq!(e["block_size_minimum"], 512, "{e}");
    assert_eq!(e["block_size_preferred"], 4096, "{e}");
    assert_eq!(e["block_size_maximum"], 32 * MIB, "{e}");
    assert!(server.terminate().success());
}

/// qemu-io commands; fails the test if qemu-io fails or reports a pattern
/// mismatch.
fn qemu_io(uri: &str, commands: &[&str]) -> String {
    let mut cmd = tool("qemu-io");
    cmd.args(["-f", "raw", uri]);
    for c in commands {
        cmd.args(["-c", c]);
    }
    let out = run(&mut cmd, TOOL_TIMEOUT);
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(
        out.status.success() && !text.contains("failed") && !text.contains("error"),
        "qemu-io {commands:?}: {}",
        describe(&out)
    );
    text
}

#[test]
fn qemu_io_aligned_and_unaligned_patterns() {
    if !require_tools("qemu_io", &["qemu-io"]) || !require_python_nbd("qemu_io") {
        return;
    }
    let ctx = Ctx::new("qemu_io");
    let (cache, origin) = ctx.setup(16 * MIB, 32 * MIB);
    let mut server = ctx.serve(&cache, &ctx.path("nbd.sock"), &[]);
    let uri = server.uri();
    let mut image = vec![0u8; 32 << 20];
    let mut fill = |off: usize, len: usize, byte: u8| image[off..off + len].fill(byte);

    qemu_io(
        &uri,
        &[
            "write -P 0x5a 0 1M",
            "write -P 0x33 1000 3000",    // inside block 0, unaligned
            "write -P 0x77 4095 2",       // straddles blocks 0 and 1
            "write -P 0x11 1048577 8191", // unaligned, 3 blocks, past the 1M write
            "write -z 16384 8192",        // zeroes inside the 1M write
            "flush",
        ],
    );
    fill(0, 1 << 20, 0x5a);
    fill(1000, 3000, 0x33);
    fill(4095, 2, 0x77);
    fill(1048577, 8191, 0x11);
    fill(16384, 8192, 0);
    qemu_io(
        &uri,
        &[
            "read -P 0x5a 0 1000",
            "read -P 0x33 1000 3000",
            "read -P 0x5a 4000 95",
            "read -P 0x77 4095 2",
            "read -P 0x5a 4097 12287",
            "read -P 0 16384 8192",
            "read -P 0x5a 24576 1024000",
            "read -P 0 1048576 1",
            "read -P 0x11 1048577 8191",
            "read -P 0 1056768 4096",
        ],
    );
    // The checks above can fail: a wrong pattern is reported.
    let out = run(
        tool("qemu-io").args(["-f", "raw", &uri, "-c", "read -P 0x99 0 512"]),
        TOOL_TIMEOUT,
    );
    assert!(
        stdout(&out).contains("Pattern verification failed"),
        "negative control: {}",
        describe(&out)
    );
    // Independently of qemu: the bytes through libnbd, and on the origin
    // once written back.
    assert_same_bytes("volume", &nbd_read(&uri, 0, 2 << 20), &image[..2 << 20]);
    ctx.flush(&cache);
    assert_same_bytes(
        "origin after flush",
        &std::fs::read(&origin).expect("read origin"),
        &image,
    );
    assert!(server.terminate().success());
}

/// qemu-img convert into the export (the volume is twice the cache, so
/// write-back and back pressure run during the copy), qemu-img compare,
/// then nbdcopy in both directions and cmp.
#[test]
fn qemu_img_convert_compare_and_nbdcopy() {
    if !require_tools("qemu_img", &["qemu-img", "qemu-io", "nbdcopy", "cmp"]) {
        return;
    }
    let ctx = Ctx::new("qemu_img");
    let size = 32 * MIB;
    let (cache, origin) = ctx.setup(16 * MIB, size);
    let mut server = ctx.serve(&cache, &ctx.path("nbd.sock"), &[]);
    let uri = server.uri();
    let random = ctx.path("random.img");
    write_file(&random, &pattern(0x51, size as usize));

    run_ok(
        tool("qemu-img").args([
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            &random.to_string_lossy(),
            &uri,
        ]),
        TOOL_TIMEOUT,
    );
    let out = run(
        tool("qemu-img").args([
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            &random.to_string_lossy(),
            &uri,
        ]),
        TOOL_TIMEOUT,
    );
    assert!(
        out.status.success() && stdout(&out).contains("Images are identical"),
        "{}",
        describe(&out)
    );

    // nbdcopy out, byte compare.
    let out_img = ctx.path("out.img");
    run_ok(
        tool("nbdcopy").args([&uri, &*out_img.to_string_lossy()]),
        TOOL_TIMEOUT,
    );
    run_ok(tool("cmp").args([&random, &out_img]), TOOL_TIMEOUT);

    // nbdcopy in (several connections), then out again.
    let random2 = ctx.path("random2.img");
    write_file(&random2, &pattern(0x52, size as usize));
    run_ok(
        tool("nbdcopy").args([&*random2.to_string_lossy(), &uri]),
        TOOL_TIMEOUT,
    );
    let out2 = ctx.path("out2.img");
    run_ok(
        tool("nbdcopy").args([&uri, &*out2.to_string_lossy()]),
        TOOL_TIMEOUT,
    );
    run_ok(tool("cmp").args([&random2, &out2]), TOOL_TIMEOUT);

    // Negative control: compare notices a one-byte difference.
    qemu_io(&uri, &["write -P 0xee 12345 1"]);
    let out = run(
        tool("qemu-img").args([
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            &random2.to_string_lossy(),
            &uri,
        ]),
        TOOL_TIMEOUT,
    );
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));

    // Everything reaches the origin.
    ctx.flush(&cache);
    let mut want = pattern(0x52, size as usize);
    want[12345] = 0xee;
    assert_same_bytes(
        "origin",
        &std::fs::read(&origin).expect("read origin"),
        &want,
    );
    assert!(server.terminate().success());
}

/// 16 MiB written as 4 KiB blocks in random order, so neighbouring blocks
/// sit in scattered cache slots, then the volume copied out by nbdcopy
/// (256 KiB reads, 64 in flight per connection) with O_DIRECT hits: each
/// read of that range is 64 separate cache reads joined, misses sit
/// between them, and together they want far more operations than a
/// connection's ring holds. Every read must be answered and the copy must
/// equal the volume. (A lost wake-up for reads waiting for room in the
/// ring hung such copies with a Ceph origin; this test did not reproduce
/// that on a file origin, `many_tasks_joining_many_operations_on_a_full_
/// ring_all_finish` in `crates/io/tests/reactor.rs` does.)
#[test]
fn nbdcopy_of_blocks_cached_in_scattered_slots() {
    if !require_tools("scattered", &["fio", "nbdcopy"]) {
        return;
    }
    let ctx = Ctx::new("scattered");
    let size = 64 * MIB;
    // An origin with data everywhere: the copy reads all of it, misses
    // (origin reads) between the scattered hits.
    let origin = ctx.path("origin.img");
    write_file(&origin, &pattern(0x5c, size as usize));
    let cache = ctx.file("cache.img", 64 * MIB);
    ctx.format(&cache, &origin.to_string_lossy(), &[]);
    let mut server = ctx.serve(
        &cache,
        &ctx.path("nbd.sock"),
        &["--no-writeback", "--no-page-cache-reads"],
    );
    let uri = server.uri();
    let out = run(
        tool("fio").current_dir(&ctx.dir.path).args([
            "--name=scatter",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--offset=16M",
            "--size=16M",
            "--iodepth=8",
            "--randseed=1313",
        ]),
        TOOL_TIMEOUT,
    );
    assert!(out.status.success(), "fio: {}", describe(&out));
    let st = ctx.status(&cache);
    assert_eq!(u64_of(&st, "dirty_blocks"), 4096, "every block once: {st}");
    for round in 0..3 {
        let copy = ctx.path(&format!("copy-{round}.img"));
        run_ok(
            tool("nbdcopy").args([&uri, &*copy.to_string_lossy()]),
            std::time::Duration::from_secs(60),
        );
        if round == 0 {
            ctx.flush(&cache);
            assert_same_bytes(
                "nbdcopy of the volume against its origin after the drain",
                &std::fs::read(&copy).expect("read copy"),
                &std::fs::read(&origin).expect("read origin"),
            );
        }
    }
    assert!(server.terminate().success());
}

#[test]
fn fio_nbd_engine_verify_crc32c() {
    if !require_tools("fio_verify", &["fio"]) {
        return;
    }
    let ctx = Ctx::new("fio_verify");
    // 48 MiB written through a 16 MiB cache: verification reads come from
    // both the cache and the origin, after write-back under pressure.
    let (cache, _) = ctx.setup(16 * MIB, 64 * MIB);
    fio_verify_through(&ctx, &cache, &[], &[]);
}

/// The same where io_uring is forbidden (a container's seccomp profile,
/// `kernel.io_uring_disabled`), forced here with `CAIRN_IO_BACKEND=pread`:
/// the event loop waits in poll(2) and the devices use pread/pwrite, and
/// every written block still verifies. Then a kill -9 and a restart on
/// the same backend: the flushed data is all there.
#[test]
fn fio_verify_and_kill9_without_io_uring() {
    if !require_tools("no_io_uring", &["fio"]) {
        return;
    }
    let ctx = Ctx::new("no_io_uring");
    let (cache, _) = ctx.setup(16 * MIB, 64 * MIB);
    let env = [("CAIRN_IO_BACKEND", "pread")];
    fio_verify_through(&ctx, &cache, &[], &env);
    let log = std::fs::read_to_string(ctx.path("serve-0.log")).expect("serve log");
    assert!(
        log.contains("event loop without io_uring"),
        "the serve log does not say the event loop ran without io_uring:\n{log}"
    );
    // Fsync'd writes, kill -9, restart, verify only.
    let socket = ctx.path("nbd2.sock");
    let mut server = ctx.serve_env(&cache, &socket, &[], &env);
    let uri = server.uri();
    run_ok(
        tool("fio")
            .current_dir(&ctx.dir.path)
            .args(fio_verified_args(&uri, 7, false)),
        TOOL_TIMEOUT,
    );
    server.kill9();
    let mut server = ctx.serve_env(&cache, &socket, &[], &env);
    let out = run_ok(
        tool("fio")
            .current_dir(&ctx.dir.path)
            .args(fio_verified_args(&uri, 7, true)),
        TOOL_TIMEOUT,
    );
    let json = json_in(&stdout(&out));
    assert_eq!(json["jobs"][0]["error"], 0, "{json}");
    assert!(
        u64_of(&json["jobs"][0]["read"], "io_bytes") > 0,
        "nothing verified: {json}"
    );
    assert!(server.terminate().success());
}

/// The same with the cache on a raw block device (a loop device), where
/// Linux does not invalidate cached pages after an asynchronous direct
/// write, and with a reader job hitting the blocks the writers rewrite,
/// so page-cache reads race slot reuse. Every written block must verify,
/// and no checksum may fail on the device itself.
#[test]
fn fio_verify_with_the_cache_on_a_block_device() {
    let test = "fio_verify_blockdev";
    if !require_tools(test, &["fio"]) {
        return;
    }
    let ctx = Ctx::new(test);
    let backing = ctx.file("cache-backing.img", 16 * MIB);
    let origin = ctx.file("origin.img", 64 * MIB);
    let Some(device) = LoopDevice::attach(test, &backing, false) else {
        return;
    };
    let loop_dev = device.0.clone();
    let cache = PathBuf::from(&loop_dev);
    ctx.format(&cache, &origin.to_string_lossy(), &[]);
    let st = fio_verify_through(
        &ctx,
        &cache,
        &[
            "--name=reader",
            "--rw=randread",
            "--bs=4k",
            "--iodepth=8",
            "--offset=0",
            "--size=48M",
            "--loops=2",
        ],
        &[],
    );
    eprintln!(
        "{loop_dev}: hit_rereads_ok {} read_hits {}",
        u64_of(&st, "hit_rereads_ok"),
        u64_of(&st, "read_hits")
    );
}

/// Run three verifying fio writers (plus `extra` jobs) through a served
/// cache; check every written block was verified, write-back ran and no
/// checksum failed. Returns the final status.
fn fio_verify_through(
    ctx: &Ctx,
    cache: &Path,
    extra: &[&str],
    serve_env: &[(&str, &str)],
) -> serde_json::Value {
    let mut server = ctx.serve_env(cache, &ctx.path("nbd.sock"), &[], serve_env);
    let uri = server.uri();
    let uri_arg = format!("--uri={uri}");
    let mut args = vec![
        "--ioengine=nbd",
        &uri_arg,
        "--output-format=json",
        "--randseed=4242",
        "--name=rand4k",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=16",
        "--offset=0",
        "--size=16M",
        "--name=seq64k",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--rw=write",
        "--bs=64k",
        "--iodepth=4",
        "--offset=16M",
        "--size=32M",
        "--name=flushy",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--rw=randwrite",
        "--bs=8k",
        "--fsync=4",
        "--offset=48M",
        "--size=4M",
    ];
    args.extend_from_slice(extra);
    let out = run(
        tool("fio")
            .current_dir(&ctx.dir.path) // verify state files land here
            .args(&args),
        TOOL_TIMEOUT,
    );
    assert!(out.status.success(), "fio: {}", describe(&out));
    let json = json_in(&stdout(&out));
    let jobs = json["jobs"].as_array().expect("jobs");
    assert!(jobs.len() >= 3, "{json}");
    for job in jobs {
        assert_eq!(job["error"], 0, "{}: {job}", job["jobname"]);
        if job["jobname"] == "reader" {
            continue;
        }
        let written = job["write"]["io_bytes"].as_u64().expect("write bytes");
        let verified = job["read"]["io_bytes"].as_u64().expect("read bytes");
        assert!(written > 0, "{job}");
        assert_eq!(written, verified, "every written block was verified: {job}");
    }
    let st = ctx.status(cache);
    assert!(
        u64_of(&st, "writeback_blocks") > 0,
        "write-back should have run under cache pressure: {st}"
    );
    assert_eq!(u64_of(&st, "checksum_mismatches"), 0, "{st}");
    assert!(server.terminate().success());
    st
}

const PY_MULTICONN: &str = r#"
import nbd, sys
uri, data_a, data_b, off_a, off_b = sys.argv[1], open(sys.argv[2], "rb").read(), open(sys.argv[3], "rb").read(), int(sys.argv[4]), int(sys.argv[5])
a = nbd.NBD(); a.connect_uri(uri)
b = nbd.NBD(); b.connect_uri(uri)
assert a.can_multi_conn() and b.can_multi_conn(), "multi-conn not advertised"
a.pwrite(data_a, off_a)            # plain write on connection A
assert b.pread(len(data_a), off_a) == data_a, "B does not see A's write"
b.flush()                          # FLUSH on connection B covers A's write
a.pwrite(data_b, off_b, nbd.CMD_FLAG_FUA)  # FUA: durable on its own
print("acknowledged", flush=True)
"#;

/// Multi-conn: a write on connection A, FLUSH on connection B, then a FUA
/// write; kill -9 the server; after restart a new connection reads both.
#[test]
fn nbdsh_multi_conn_flush_survives_kill9() {
    if !require_python_nbd("multi_conn") {
        return;
    }
    let ctx = Ctx::new("multi_conn");
    let (cache, _) = ctx.setup(16 * MIB, 64 * MIB);
    let sock = ctx.path("nbd.sock");
    // No background write-back: the data must come from the cache's log.
    let mut server = ctx.serve(&cache, &sock, &["--no-writeback"]);
    let data_a = pattern(0xA, 3 * MIB as usize);
    let data_b = pattern(0xB, 64 << 10);
    let (off_a, off_b) = (10 * MIB, 40 * MIB + 8192);
    let (file_a, file_b) = (ctx.path("a.bin"), ctx.path("b.bin"));
    write_file(&file_a, &data_a);
    write_file(&file_b, &data_b);
    // The python process keeps both connections open while the server dies.
    let mut client = {
        let mut cmd = std::process::Command::new(python());
        cmd.args([
            "-c",
            PY_MULTICONN,
            &server.uri(),
            &file_a.to_string_lossy(),
            &file_b.to_string_lossy(),
            &off_a.to_string(),
            &off_b.to_string(),
        ]);
        ctx.spawn("nbdsh-multiconn", &mut cmd)
    };
    assert!(
        eventually(std::time::Duration::from_secs(60), || client
            .log_text()
            .contains("acknowledged")
            || client.try_status().is_some()),
        "client hung"
    );
    assert!(
        client.log_text().contains("acknowledged"),
        "client failed:\n{}",
        client.log_text()
    );
    server.kill9();
    client.kill9();

    let mut server = ctx.serve(&cache, &sock, &["--no-writeback"]);
    assert_same_bytes(
        "A's write after B's flush and kill -9",
        &nbd_read(&server.uri(), off_a, data_a.len()),
        &data_a,
    );
    assert_same_bytes(
        "FUA write after kill -9",
        &nbd_read(&server.uri(), off_b, data_b.len()),
        &data_b,
    );
    assert!(server.terminate().success());
}

/// `serve --listen HOST:PORT`: the same volume over TCP on loopback.
#[test]
fn tcp_listener_serves_the_volume() {
    if !require_tools("tcp", &["nbdinfo"]) || !require_python_nbd("tcp") {
        return;
    }
    let ctx = Ctx::new("tcp");
    let (cache, origin) = ctx.setup(16 * MIB, 32 * MIB);
    let addr = format!("127.0.0.1:{}", free_port());
    let mut p = ctx.spawn(
        "cairn serve --listen",
        &mut ctx.cmd(&[
            "serve",
            "--cache",
            &cache.to_string_lossy(),
            "--listen",
            &addr,
        ]),
    );
    assert!(
        eventually(std::time::Duration::from_secs(30), || {
            std::net::TcpStream::connect(&addr).is_ok() || p.try_status().is_some()
        }),
        "no listener on {addr}"
    );
    assert!(p.try_status().is_none(), "serve exited:\n{}", p.log_text());
    let uri = format!("nbd://{addr}/");
    let out = run_ok(tool("nbdinfo").args(["--json", &uri]), TOOL_TIMEOUT);
    let json = json_in(&stdout(&out));
    assert_eq!(json["exports"][0]["export-size"], 32 * MIB, "{json}");
    let data = pattern(0x7C, 1 << 20);
    nbd_write(&uri, 3 * MIB, &data, true);
    assert_eq!(nbd_read(&uri, 3 * MIB, data.len()), data);
    ctx.flush(&cache);
    assert_same_bytes("origin", &read_range(&origin, 3 * MIB, data.len()), &data);
    let status = p.terminate(std::time::Duration::from_secs(60));
    assert_eq!(status.code(), Some(0), "{}", p.log_text());
}
