//! kill -9 of `cairn serve` under load, restart, verify with fio's
//! verify=crc32c (and an exact acknowledged-prefix check).
//!
//! Design. fio's verify pass can only check writes that are known to be
//! durable. With `--fsync=1` and iodepth 1, fio issues each write, waits
//! for it, then issues a FLUSH and waits for that before the next write;
//! but fio's verify state (`verify_state_save`) records *completed writes*,
//! and a write can complete while its FLUSH is still in flight when the
//! server dies. Such a write was never promised durable, so verifying it
//! could fail a correct server. So the region fio verifies is written
//! completely, and fio has exited, before the kill:
//!
//! 1. Phase 1, region V = [0, 8 MiB): fio randwrite, bs 4k, fsync=1,
//!    verify=crc32c, do_verify=0, fixed seed, to completion. Every block of
//!    V has been written once and flushed.
//! 2. Phase 2, the load the kill hits, on other regions, while background
//!    write-back may still be copying V to the origin (the cache is
//!    smaller than the data written, so write-back runs under pressure):
//!    - fio randwrite with fsync=1, iodepth 4, on [16, 48) MiB, not verified;
//!    - a python3-libnbd writer on [64, 128) MiB that writes block i, FLUSHes,
//!      and only then prints i: the exact prefix of acknowledged-durable
//!      writes, which no fio option provides.
//!
//!    Once both are running, `kill -9` the daemon.
//! 3. Restart `cairn serve` (log replay), then:
//!    - fio --verify_only with phase 1's exact job parameters and seed over
//!      V: 0 errors and every block read;
//!    - the python region: blocks 0..=last printed hold their data, the
//!      one after may hold old (zero) or new data, the rest are zero;
//!    - a negative control: fio --verify_only over a never-written region
//!      does report errors, so a pass means something.
//!
//! The cycle runs twice (a second kill on a cache that already went
//! through recovery), then a final clean flush must leave the origin
//! holding exactly the volume.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const MIB: u64 = 1 << 20;
const BLOCK: usize = 4096;
const PY_BASE: u64 = 64 * MIB;
const PY_BLOCKS: u64 = 16384;

fn fio(ctx: &Ctx, args: &[String]) -> std::process::Output {
    run(
        tool("fio").current_dir(&ctx.dir.path).args(args),
        TOOL_TIMEOUT,
    )
}

/// The python writer's block i.
fn py_block(i: u64) -> Vec<u8> {
    let unit = format!("blk{i:08}.");
    unit.as_bytes()
        .iter()
        .copied()
        .cycle()
        .take(BLOCK)
        .collect()
}

const PY_WRITER: &str = r#"
import nbd, sys
uri, base, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
h = nbd.NBD()
h.connect_uri(uri)
for i in range(count):
    unit = b"blk%08d." % i
    block = (unit * (4096 // len(unit) + 1))[:4096]
    h.pwrite(block, base + i * 4096)
    h.flush()
    print(i, flush=True)
"#;

fn last_acknowledged(log: &str) -> Option<u64> {
    log.lines()
        .filter_map(|l| l.trim().parse().ok())
        .next_back()
}

#[test]
fn kill9_under_fio_load_then_verify() {
    if !require_tools("kill9_fio", &["fio"]) || !require_python_nbd("kill9_fio") {
        return;
    }
    let ctx = Ctx::new("kill9_fio");
    let (cache, origin) = ctx.setup(24 * MIB, 128 * MIB);
    let sock = ctx.path("nbd.sock");

    let mut acked_before: Option<u64> = None;
    for round in 0..2u64 {
        let seed = 1000 + round;
        let mut server = ctx.serve(&cache, &sock, &[]);
        let uri = server.uri();

        // Phase 1: the verified region, written and flushed completely.
        let out = fio(&ctx, &fio_verified_args(&uri, seed, false));
        assert!(out.status.success(), "phase 1 fio: {}", describe(&out));
        let job = &json_in(&stdout(&out))["jobs"][0];
        assert_eq!(job["error"], 0, "{job}");
        assert_eq!(job["write"]["io_bytes"], 8 * MIB, "{job}");

        // Phase 2: load on other regions; kill -9 in the middle of it.
        let mut load = ctx.spawn(
            "fio-load",
            tool("fio").current_dir(&ctx.dir.path).args([
                "--name=load",
                "--ioengine=nbd",
                &format!("--uri={uri}"),
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=4",
                "--offset=16M",
                "--size=32M",
                "--fsync=1",
                "--time_based",
                "--runtime=60",
                &format!("--randseed={}", seed + 77),
            ]),
        );
        let mut writer = ctx.spawn(
            "py-writer",
            Command::new(python()).args([
                "-c",
                PY_WRITER,
                &uri,
                &PY_BASE.to_string(),
                &PY_BLOCKS.to_string(),
            ]),
        );
        let started = Instant::now();
        assert!(
            eventually(Duration::from_secs(60), || {
                last_acknowledged(&writer.log_text()).unwrap_or(0) >= 100
            }),
            "the python writer made no progress:\n{}",
            writer.log_text()
        );
        std::thread::sleep(Duration::from_millis(500));
        assert!(
            load.try_status().is_none(),
            "fio load ended early:\n{}",
            load.log_text()
        );
        assert!(
            writer.try_status().is_none(),
            "the writer finished before the kill; make PY_BLOCKS larger"
        );
        server.kill9();
        let killed_after = started.elapsed();
        // The clients see the connection drop; reap them.
        let _ = load.wait_timeout(Duration::from_secs(30));
        let _ = writer.wait_timeout(Duration::from_secs(30));
        load.kill9();
        writer.kill9();
        let acked = last_acknowledged(&writer.log_text()).expect("some acknowledged writes");
        eprintln!(
            "round {round}: killed after {killed_after:?}; python writer had {} acknowledged flushes",
            acked + 1
        );

        // Phase 3: restart and verify.
        let mut server = ctx.serve(&cache, &sock, &[]);
        let uri = server.uri();
        let out = fio(&ctx, &fio_verified_args(&uri, seed, true));
        assert!(
            out.status.success(),
            "verify-only pass after kill -9: {}",
            describe(&out)
        );
        let job = &json_in(&stdout(&out))["jobs"][0];
        assert_eq!(job["error"], 0, "{job}");
        assert_eq!(
            job["read"]["io_bytes"],
            8 * MIB,
            "verify read every block: {job}"
        );

        // Both rounds write the same bytes to the python region, so the
        // acknowledged prefix is the longest one so far.
        let must = acked.max(acked_before.unwrap_or(0));
        let may = must + 1;
        acked_before = Some(must);
        let got = nbd_read(&uri, PY_BASE, (PY_BLOCKS as usize) * BLOCK);
        for i in 0..PY_BLOCKS {
            let b = &got[i as usize * BLOCK..(i as usize + 1) * BLOCK];
            let is_new = b == py_block(i).as_slice();
            let is_zero = b.iter().all(|&x| x == 0);
            let ok = if i <= must {
                is_new
            } else if i <= may {
                is_new || is_zero
            } else {
                is_zero
            };
            assert!(
                ok,
                "round {round}: block {i} of the python region is wrong (acknowledged up to {must}): {:?}",
                String::from_utf8_lossy(&b[..24])
            );
        }

        // Negative control: the verifier fails on data fio never wrote.
        let mut neg = fio_verified_args(&uri, seed, true);
        neg.retain(|a| !a.starts_with("--offset"));
        neg.push("--offset=8M".into());
        let out = fio(&ctx, &neg);
        assert!(
            !out.status.success(),
            "fio verified a region it never wrote: {}",
            describe(&out)
        );
        let st = ctx.status(&cache);
        assert_eq!(u64_of(&st, "checksum_mismatches"), 0, "{st}");
        assert!(server.terminate().success());
    }

    // Everything reaches the origin: after a clean flush the origin file
    // equals the volume as read through cairn.
    let mut server = ctx.serve(&cache, &sock, &[]);
    let volume = nbd_read(&server.uri(), 0, (128 * MIB) as usize);
    ctx.flush(&cache);
    assert_eq!(u64_of(&ctx.status(&cache), "dirty_blocks"), 0);
    assert_same_bytes(
        "origin after the final flush",
        &std::fs::read(&origin).expect("read origin"),
        &volume,
    );
    assert!(server.terminate().success());
}
