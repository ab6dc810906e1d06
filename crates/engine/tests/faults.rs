//! Fail-the-Nth-I/O sweeps (as Open CAS tests itself), corruption sweeps,
//! and the I/O accounting checks: one barrier per flush, none when nothing
//! is new, bounded bytes per commit, no read-modify-write for aligned writes.

mod common;
use common::*;

use std::sync::Arc;

use cairn_device::{Device, FaultMode, SimDevice};
use cairn_engine::{Engine, FormatOptions};
use cairn_format::Layout;

const VOLUME_BLOCKS: u64 = 256;

/// A rig with some durable, partly written-back data and its model.
fn populated(seed: u64) -> (Rig, Model) {
    let rig = Rig::new(cache_bytes_small(), VOLUME_BLOCKS);
    let mut model = Model::new(VOLUME_BLOCKS);
    for i in 0..300u64 {
        let lba = (i * 37 + seed) % VOLUME_BLOCKS;
        let data = pattern(seed * 1000 + i, BS as usize);
        rig.engine().write(lba * BS, &data, false).unwrap();
        model.write(lba * BS, &data);
        if i % 50 == 49 {
            rig.engine().flush().unwrap();
            rig.engine().writeback_step().unwrap();
        }
    }
    rig.engine().flush().unwrap();
    (rig, model)
}

fn assert_volume(engine: &Engine, model: &Model, ctx: &str) {
    let vol = read_volume(engine).unwrap_or_else(|e| panic!("{ctx}: read: {e}"));
    assert!(vol == model.image, "{ctx}: acknowledged data lost");
}

/// Run `action` with the cache's Nth I/O failing, for every N until it
/// completes; after each failure reopen without faults: the cache must open
/// with every durable write intact.
fn sweep(name: &str, action: impl Fn(&Engine) -> Result<(), cairn_engine::EngineError>) -> u64 {
    sweep_with(name, action, |_| None)
}

/// As `sweep`, where `later(lba)` is a value the action may have written to
/// that block (allowed after a failure, required after success).
fn sweep_with(
    name: &str,
    action: impl Fn(&Engine) -> Result<(), cairn_engine::EngineError>,
    later: impl Fn(u64) -> Option<Vec<u8>>,
) -> u64 {
    let mut n = 0u64;
    loop {
        let (mut rig, model) = populated(n % 5 + 1);
        rig.cache.fail_at(n, FaultMode::Sticky);
        let result = action(rig.engine());
        rig.cache.clear_faults();
        let engine = rig.engine.take().unwrap();
        drop(engine);
        // Power cut after the failure: only flushed data survives.
        let cache = rig.cache.crashed(cairn_device::CrashPlan::DropAll, n);
        let origin = rig.origin.crashed(cairn_device::CrashPlan::DropAll, n);
        let engine = open(&cache, &origin)
            .unwrap_or_else(|e| panic!("{name}: fail at I/O #{n}: reopen refused: {e}"));
        let vol =
            read_volume(&engine).unwrap_or_else(|e| panic!("{name}: fail at #{n}: read: {e}"));
        for lba in 0..VOLUME_BLOCKS {
            let got = &vol[(lba * BS) as usize..((lba + 1) * BS) as usize];
            let new = later(lba);
            let ok = match (&new, result.is_ok()) {
                (Some(v), true) => got == v.as_slice(),
                (Some(v), false) => got == v.as_slice() || got == model.block(lba),
                (None, _) => got == model.block(lba),
            };
            assert!(
                ok,
                "{name}: fail at I/O #{n}: block {lba} lost acknowledged data"
            );
        }
        if result.is_ok() {
            return n;
        }
        n += 1;
        assert!(n < 10_000, "{name}: never completed");
    }
}

#[test]
fn fail_nth_io_writeback_drain() {
    let n = sweep("drain", |e| e.drain().map(|_| ()));
    report!("fail-Nth sweep over drain: {n} failure points, all recovered");
}

#[test]
fn fail_nth_io_checkpoint() {
    let n = sweep("checkpoint", |e| e.checkpoint());
    report!("fail-Nth sweep over checkpoint: {n} failure points, all recovered");
}

#[test]
fn fail_nth_io_writes_and_flush() {
    let n = sweep_with(
        "write+flush",
        |e| {
            for i in 0..40u64 {
                e.write(i * BS, &pattern(9000 + i, BS as usize), false)?;
            }
            e.flush()
        },
        |lba| (lba < 40).then(|| pattern(9000 + lba, BS as usize)),
    );
    report!("fail-Nth sweep over writes+flush: {n} failure points, all recovered");
}

#[test]
fn fail_nth_io_recovery() {
    let (rig, model) = populated(3);
    // Leave unflushed state behind, then crash.
    rig.engine()
        .write(0, &pattern(1, BS as usize), false)
        .unwrap();
    let image = rig.cache.durable_image();
    let origin = rig.origin.crashed(cairn_device::CrashPlan::DropAll, 0);
    let mut n = 0;
    loop {
        let cache = SimDevice::from_image("cache", image.clone());
        cache.fail_at(n, FaultMode::Sticky);
        let result = open(&cache, &origin);
        let ok = result.is_ok();
        drop(result);
        cache.clear_faults();
        let cache2 = cache.crashed(cairn_device::CrashPlan::DropAll, n);
        let engine =
            open(&cache2, &origin).unwrap_or_else(|e| panic!("recovery fail at #{n}: {e}"));
        assert_volume(&engine, &model, &format!("recovery fail at I/O #{n}"));
        if ok {
            break;
        }
        n += 1;
        assert!(n < 10_000);
    }
    report!("fail-Nth sweep over recovery: {n} failure points, all recovered");
}

#[test]
fn fail_nth_io_format() {
    let mut n = 0;
    loop {
        let cache = SimDevice::new("cache", cache_bytes_small());
        let origin = SimDevice::new("origin", VOLUME_BLOCKS * BS);
        cache.fail_at(n, FaultMode::Sticky);
        let r = Engine::format(
            Arc::new(cache.clone()),
            Arc::new(origin.clone()),
            &FormatOptions::default(),
        );
        cache.clear_faults();
        let crashed = cache.crashed(cairn_device::CrashPlan::DropAll, n);
        match open(&crashed, &origin) {
            Ok(engine) => {
                // Whatever opens must be a correct, empty volume.
                assert_volume(&engine, &Model::new(VOLUME_BLOCKS), "format");
            }
            Err(e) => {
                assert!(
                    r.is_err(),
                    "format succeeded but the cache does not open: {e}"
                );
                let msg = e.to_string();
                assert!(!msg.is_empty());
            }
        }
        if r.is_ok() {
            break;
        }
        n += 1;
    }
    report!("fail-Nth sweep over format: {n} failure points");
}

/// Flip one byte in every region of the cache device in turn. Reads return
/// the right data or an error, never wrong data, and corruption never
/// reaches the origin.
#[test]
fn corruption_sweep() {
    let (rig, mut model) = populated(7);
    // Half the volume rewritten and left dirty, so flips hit dirty blocks
    // (EIO) as well as clean ones (served from the origin and repaired).
    for lba in (0..VOLUME_BLOCKS).step_by(2) {
        let data = pattern(777_000 + lba, BS as usize);
        rig.engine().write(lba * BS, &data, false).unwrap();
        model.write(lba * BS, &data);
    }
    rig.engine().close().unwrap();
    // Unflushed-but-sealed state is not needed: everything is durable.
    let image = rig.cache.durable_image();
    let origin_image = rig.origin.durable_image();
    let layout = Layout::compute(cache_bytes_small(), BS as u32).unwrap();
    let log_start = layout.log_offset_bytes();
    let mut offsets: Vec<(String, u64)> = vec![
        ("superblock A".into(), 100),
        ("superblock B".into(), 4096 + 100),
        (
            "checkpoint slot 0 header".into(),
            layout.checkpoint_offset_bytes(0) + 40,
        ),
        (
            "checkpoint slot 1 header".into(),
            layout.checkpoint_offset_bytes(1) + 40,
        ),
        (
            "checkpoint slot 0 payload".into(),
            layout.checkpoint_offset_bytes(0) + 4096 + 20,
        ),
        (
            "checkpoint slot 1 payload".into(),
            layout.checkpoint_offset_bytes(1) + 4096 + 20,
        ),
    ];
    // Every 7th log block, at a varying byte: headers and data alike.
    for b in (0..layout.log_blocks).step_by(7) {
        offsets.push((
            format!("log block {b}"),
            log_start + b * BS + (b * 131) % BS,
        ));
    }
    let mut opened = 0;
    let mut refused = 0;
    let mut eio_reads = 0;
    let mut repairs = 0;
    for (region, at) in &offsets {
        let mut img = image.clone();
        img[*at as usize] ^= 0x5a;
        let cache = SimDevice::from_image("cache", img);
        let origin = SimDevice::from_image("origin", origin_image.clone());
        match open(&cache, &origin) {
            Err(e) => {
                refused += 1;
                assert!(!e.to_string().is_empty(), "{region}");
                continue;
            }
            Ok(engine) => {
                opened += 1;
                for lba in 0..VOLUME_BLOCKS {
                    let mut buf = vec![0u8; BS as usize];
                    match engine.read(lba * BS, &mut buf) {
                        Ok(()) => assert!(
                            buf == model.block(lba),
                            "{region}: block {lba} returned wrong data"
                        ),
                        Err(_) => eio_reads += 1,
                    }
                }
                repairs += engine.stats().repairs;
                let _ = engine.drain();
                // The origin never receives a block that failed its checksum:
                // every origin block is the model's or the pre-existing one.
                let o = origin.live_image();
                for lba in 0..VOLUME_BLOCKS as usize {
                    let got = &o[lba * BS as usize..(lba + 1) * BS as usize];
                    let before = &origin_image[lba * BS as usize..(lba + 1) * BS as usize];
                    assert!(
                        got == model.block(lba as u64) || got == before,
                        "{region}: corruption reached the origin at block {lba}"
                    );
                }
            }
        }
    }
    report!(
        "corruption sweep: {} flips, {opened} opened ({eio_reads} reads answered EIO, {repairs} clean blocks repaired from the origin), {refused} refused to open, 0 wrong reads",
        offsets.len()
    );
    assert!(
        eio_reads > 0,
        "no flip hit a dirty block: the sweep tests nothing there"
    );
    assert!(
        repairs > 0,
        "no flip hit a clean block: the sweep tests nothing there"
    );
}

#[test]
fn flush_costs_one_barrier_and_none_when_clean() {
    let rig = Rig::new(cache_bytes_small(), VOLUME_BLOCKS);
    let e = rig.engine();
    rig.cache.reset_counters();
    e.write(0, &pattern(1, 8 * BS as usize), false).unwrap();
    assert_eq!(rig.cache.counters().flushes, 0, "writes alone do not flush");
    e.flush().unwrap();
    let c = rig.cache.counters();
    assert_eq!(c.flushes, 1, "one barrier per flush");
    assert_eq!(c.writes, 1, "one vectored write per commit");
    // Header + 8 data blocks, nothing more (the dm-writecache 2 MiB bug).
    assert_eq!(c.bytes_written, 9 * BS, "bytes written by a commit");
    e.flush().unwrap();
    e.flush().unwrap();
    assert_eq!(
        rig.cache.counters().flushes,
        1,
        "a flush with nothing new issues no barrier"
    );
    // FUA: durable on return, one barrier.
    e.write(BS * 20, &pattern(2, BS as usize), true).unwrap();
    let c = rig.cache.counters();
    assert_eq!(c.flushes, 2);
    assert_eq!(c.bytes_written, 9 * BS + 2 * BS);
}

#[test]
fn aligned_writes_read_nothing() {
    let rig = Rig::new(cache_bytes_small(), VOLUME_BLOCKS);
    let e = rig.engine();
    rig.cache.reset_counters();
    rig.origin.reset_counters();
    for i in 0..100u64 {
        e.write((i % 64) * BS, &pattern(i, 2 * BS as usize), i % 10 == 0)
            .unwrap();
    }
    e.flush().unwrap();
    assert_eq!(
        rig.cache.counters().reads,
        0,
        "aligned writes read nothing from the cache"
    );
    assert_eq!(
        rig.origin.counters().reads,
        0,
        "aligned writes read nothing from the origin"
    );
    // A sub-block write must read the old block (once).
    e.write(BS * 200 + 512, &[7u8; 512], false).unwrap();
    assert_eq!(
        rig.origin.counters().reads,
        1,
        "sub-block write reads the old block"
    );
}

#[test]
fn wrong_origin_and_size_are_refused() {
    let rig = Rig::new(cache_bytes_small(), VOLUME_BLOCKS);
    rig.engine().close().unwrap();
    let other = SimDevice::new("other-origin", VOLUME_BLOCKS * BS);
    let err = open(&rig.cache, &other)
        .err()
        .expect("must refuse another origin");
    assert!(err.to_string().contains("formatted for origin"), "{err}");
    let bigger = SimDevice::new("origin", (VOLUME_BLOCKS + 1) * BS);
    let err = open(&rig.cache, &bigger)
        .err()
        .expect("must refuse a resized origin");
    assert!(err.to_string().contains("changed size"), "{err}");
    let blank = SimDevice::new("blank", cache_bytes_small());
    let err = open(&blank, &rig.origin)
        .err()
        .expect("must refuse an unformatted cache");
    assert!(err.to_string().contains("cairn format"), "{err}");
    let err = Engine::format(
        Arc::new(rig.cache.clone()) as Arc<dyn Device>,
        Arc::new(rig.origin.clone()) as Arc<dyn Device>,
        &FormatOptions::default(),
    )
    .expect_err("must refuse to overwrite");
    assert!(err.to_string().contains("--force"), "{err}");
}

/// `format --force` over a cache full of old records: the new cache opens
/// (old records are never mistaken for new ones) and reads the origin.
#[test]
fn reformat_over_an_old_log_opens_clean() {
    let (rig, _model) = populated(4);
    rig.engine().close().unwrap();
    let origin = SimDevice::new("origin2", VOLUME_BLOCKS * BS);
    Engine::format(
        Arc::new(rig.cache.clone()) as Arc<dyn Device>,
        Arc::new(origin.clone()) as Arc<dyn Device>,
        &FormatOptions {
            force: true,
            ..FormatOptions::default()
        },
    )
    .unwrap();
    // Crash right after format, before anything new is written.
    let cache = rig.cache.crashed(cairn_device::CrashPlan::DropAll, 1);
    let engine = open(&cache, &origin).expect("a fresh format opens");
    assert_volume(&engine, &Model::new(VOLUME_BLOCKS), "after reformat");
    assert_eq!(engine.stats().dirty_blocks, 0);
}

/// A checkpoint larger than one write chunk (1 MiB of payload = 65,536
/// entries) reopens with every block intact.
#[test]
fn large_checkpoint_roundtrip() {
    let mib = 1u64 << 20;
    let volume_blocks = 80_000u64;
    let cache = SimDevice::new("cache", 340 * mib);
    let origin = SimDevice::new("origin", volume_blocks * BS);
    Engine::format(
        Arc::new(cache.clone()) as Arc<dyn Device>,
        Arc::new(origin.clone()) as Arc<dyn Device>,
        &FormatOptions::default(),
    )
    .unwrap();
    let engine = open(&cache, &origin).unwrap();
    let chunk = 256 * BS;
    let mut lba = 0;
    while lba < volume_blocks {
        let n = chunk.min((volume_blocks - lba) * BS);
        engine
            .write(lba * BS, &pattern(lba, n as usize), false)
            .unwrap();
        lba += n / BS;
    }
    engine.close().unwrap();
    assert!(engine.stats().dirty_blocks + engine.stats().clean_blocks > 70_000);
    drop(engine);
    let engine = open(&cache.crashed(cairn_device::CrashPlan::DropAll, 1), &origin)
        .expect("a multi-chunk checkpoint reopens");
    let mut lba = 0;
    let mut buf = vec![0u8; chunk as usize];
    while lba < volume_blocks {
        let n = chunk.min((volume_blocks - lba) * BS) as usize;
        engine.read(lba * BS, &mut buf[..n]).unwrap();
        assert!(buf[..n] == pattern(lba, n)[..], "block {lba} after reopen");
        lba += n as u64 / BS;
    }
}
