//! A read miss whose origin read returns old data after a newer write to
//! the same block was acknowledged (and reached the origin, and left the
//! cache) must not install that old data: the classic cache fill race. The
//! origin here holds a read inside the device until the test lets it go,
//! so the race happens every time, not by luck.

mod common;
use common::gated_origin::{GatedOrigin, Hold};
use common::*;

use std::sync::Arc;

use cairn_device::{Device, SimDevice};
use cairn_engine::{CacheMode, Engine, FormatOptions};

#[test]
fn a_fill_older_than_an_acknowledged_write_is_never_installed() {
    let volume_blocks = 256;
    let lba = 37u64;
    let old = pattern(1, BS as usize);
    let new = pattern(2, BS as usize);
    let inner = SimDevice::new("origin", volume_blocks * BS);
    inner.write_at(lba * BS, &old).expect("seed the origin");
    let origin = Arc::new(GatedOrigin::new(inner.clone(), Hold::ReadAfter));
    let cache = SimDevice::new("cache", cache_bytes_small());
    Engine::format(
        Arc::new(cache.clone()),
        origin.clone(),
        &FormatOptions::default(),
    )
    .expect("format");
    let engine = Engine::open(Arc::new(cache), origin.clone(), &open_opts()).expect("open");
    // Write-around: a write goes to the origin and leaves no cached copy,
    // so the stale fill would find the block unmapped.
    engine
        .set_mode(CacheMode::WriteAround, |_| {})
        .expect("write-around");

    origin.gate.arm(Some(lba * BS));
    let stale = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut buf = vec![0u8; BS as usize];
            engine.read(lba * BS, &mut buf).expect("racing read");
            buf
        });
        origin
            .gate
            .wait_entered(std::time::Duration::from_secs(100), "the racing read");
        // The miss holds the old block; a newer write is acknowledged now.
        engine.write(lba * BS, &new, false).expect("write");
        origin.gate.release();
        reader.join().expect("reader")
    });
    // The racing read may return either value: it overlapped the write.
    assert!(stale == old || stale == new);

    let mut buf = vec![0u8; BS as usize];
    engine.read(lba * BS, &mut buf).expect("read after");
    assert!(
        buf == new,
        "a read after the write returned the fill's older data"
    );
    let s = engine.stats();
    assert_eq!(s.fills_superseded, 1, "the stale fill was refused");
    report!(
        "miss racing a write: fill refused (fills_superseded {}), later read sees the write",
        s.fills_superseded
    );
    // And the origin, the cache's only other copy, has the new data.
    engine.close().expect("close");
    let mut on_origin = vec![0u8; BS as usize];
    inner.read_at(lba * BS, &mut on_origin).expect("origin");
    assert_eq!(on_origin, new);
}

/// With integrity tags, a miss is planned with the block's tag; if a write
/// reaches the origin (and moves the tag) before the miss's origin read
/// runs, the read returns data newer than its planned tag. That is a race,
/// not corruption: the block is planned again, the new tag matches, and
/// the read succeeds. Reporting the first mismatch as EIO (a cargo-mutants
/// survivor in `verify_origin_read`) fails here.
#[test]
fn a_miss_whose_tag_moved_before_its_origin_read_is_not_an_error() {
    let volume_blocks = 256;
    let lba = 41u64;
    let old = pattern(3, BS as usize);
    let new = pattern(4, BS as usize);
    let inner = SimDevice::new("origin", volume_blocks * BS);
    let origin = Arc::new(GatedOrigin::new(inner.clone(), Hold::ReadBefore));
    let cache = SimDevice::new("cache", cache_bytes_small());
    Engine::format(
        Arc::new(cache.clone()),
        origin.clone(),
        &FormatOptions {
            integrity: true,
            ..FormatOptions::default()
        },
    )
    .expect("format");
    let engine = Engine::open(Arc::new(cache), origin.clone(), &open_opts()).expect("open");
    engine.recalc_all(|_| {}).expect("tags of the blank origin");
    // Write-around: writes go to the origin and move its tag at once,
    // leaving no cached copy, so the read below is a miss.
    engine
        .set_mode(CacheMode::WriteAround, |_| {})
        .expect("write-around");
    engine.write(lba * BS, &old, false).expect("first write");

    origin.gate.arm(Some(lba * BS));
    let read = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut buf = vec![0u8; BS as usize];
            engine.read(lba * BS, &mut buf).map(|()| buf)
        });
        origin
            .gate
            .wait_entered(std::time::Duration::from_secs(100), "the racing read");
        // Planned with the old tag; the origin and the tag move on now.
        engine.write(lba * BS, &new, false).expect("second write");
        origin.gate.release();
        reader.join().expect("reader")
    });
    let data = read.unwrap_or_else(|e| panic!("a read that raced a write failed: {e}"));
    assert!(
        data == new,
        "the read ran after the write: it has the new data"
    );
    let s = engine.stats();
    assert_eq!(s.origin_mismatches, 0, "no block was called corrupt");
    assert!(
        s.origin_verified_reads >= 1,
        "the read was checked against a tag"
    );
    report!(
        "miss racing a tag move: read served the new data, {} verified origin reads, 0 mismatches",
        s.origin_verified_reads
    );
    engine.close().expect("close");
}
