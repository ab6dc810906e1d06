//! Whole-volume integrity (origin tags): corruption and misdirected writes
//! on the origin are caught, clean cached copies repair the origin,
//! recalculation covers pre-existing data and resumes after a restart, tags
//! follow writes, zeroes and discards through write-back, and no tag is
//! ever read on the write path.

mod common;
use common::*;

use std::sync::Arc;

use cairn_device::{Device, SimDevice};
use cairn_engine::{Engine, EngineError, FormatOptions, ScrubOptions};
use cairn_format::{Layout, LayoutError};

const VOLUME_BLOCKS: u64 = 1024;

fn cache_bytes() -> u64 {
    cache_bytes_small() + 2 * 4096 * cairn_format::tag_pages_for(VOLUME_BLOCKS) + 64 * BS
}

fn origin_pattern(lba: u64) -> Vec<u8> {
    pattern(0xabc0_0000 + lba, BS as usize)
}

/// An integrity rig over an origin that already held data before the
/// format; recalculated unless `recalc` is false.
fn prefilled(volume_blocks: u64, cache_bytes: u64, recalc: bool) -> Rig {
    let rig = Rig::with_format(cache_bytes, volume_blocks, true);
    for lba in 0..volume_blocks {
        rig.origin.write_at(lba * BS, &origin_pattern(lba)).unwrap();
    }
    rig.origin.flush().unwrap();
    if recalc {
        rig.engine().recalc_all(|_| {}).expect("recalculation");
    }
    rig
}

fn corrupt_origin_byte(origin: &SimDevice, lba: u64, at: u64) {
    let mut b = [0u8; 1];
    origin.read_at(lba * BS + at, &mut b).unwrap();
    b[0] ^= 0x5a;
    origin.write_at(lba * BS + at, &b).unwrap();
    origin.flush().unwrap();
}

fn read_block(engine: &Engine, lba: u64) -> Result<Vec<u8>, EngineError> {
    let mut buf = vec![0u8; BS as usize];
    engine.read(lba * BS, &mut buf)?;
    Ok(buf)
}

/// A scrub whose categories account for every block it checked.
fn scrub(engine: &Engine, repair: bool) -> cairn_engine::ScrubReport {
    let report = engine
        .scrub_origin(
            &ScrubOptions {
                repair,
                rate_bytes_per_s: None,
            },
            |_, _| {},
        )
        .expect("scrub");
    assert_eq!(
        report.blocks_accounted(),
        report.blocks_checked,
        "a checked block is in no category: {report:?}"
    );
    report
}

#[test]
fn corrupt_origin_block_reads_as_eio_and_a_clean_copy_repairs_it() {
    let rig = prefilled(VOLUME_BLOCKS, cache_bytes(), true);
    let engine = rig.engine();
    // Everything verifies before any damage.
    let clean = scrub(engine, true);
    assert_eq!(clean.blocks_verified, VOLUME_BLOCKS);
    assert!(clean.mismatches.is_empty() && clean.repaired.is_empty());

    // One flipped byte behind cairn's back, on an uncached block.
    corrupt_origin_byte(&rig.origin, 10, 100);
    match read_block(engine, 10) {
        Err(EngineError::OriginCorrupt { lba: 10, .. }) => {}
        other => panic!("expected EIO for the corrupt origin block, got {other:?}"),
    }
    assert_eq!(engine.stats().origin_mismatches, 1);
    assert_eq!(
        engine
            .read(10 * BS, &mut vec![0u8; 512])
            .unwrap_err()
            .errno(),
        libc::EIO
    );
    let report = scrub(engine, true);
    assert_eq!(report.mismatches, vec![10], "scrub lists the address");
    assert!(report.repaired.is_empty(), "no clean copy, no repair");

    // A block with a clean cached copy: the read succeeds from the cache,
    // and the scrub rewrites the origin from it.
    assert_eq!(read_block(engine, 20).unwrap(), origin_pattern(20));
    assert!(engine.is_cached(20));
    engine.flush().unwrap();
    engine.checkpoint().unwrap(); // the clean copy is on the device
    corrupt_origin_byte(&rig.origin, 20, 4000);
    assert_eq!(read_block(engine, 20).unwrap(), origin_pattern(20));
    let report = scrub(engine, true);
    assert_eq!(report.repaired, vec![20]);
    assert_eq!(report.mismatches, vec![10]);
    let mut on_origin = vec![0u8; BS as usize];
    rig.origin.read_at(20 * BS, &mut on_origin).unwrap();
    assert_eq!(on_origin, origin_pattern(20), "origin repaired");
    let s = engine.stats();
    assert_eq!(s.origin_repairs, 1);
    assert_eq!(s.origin_unverified_reads, 0, "recalculation was complete");
    report!(
        "integrity: corrupt origin block -> EIO, {} mismatches counted, scrub listed block 10, repaired block 20 from its clean copy",
        s.origin_mismatches
    );
}

/// Discarded blocks (their origin copy is unspecified) are counted as
/// discarded, not lost between the categories: a tester saw 248 of 16384
/// blocks in none after trims.
#[test]
fn scrub_counts_discarded_blocks_in_their_own_category() {
    let rig = prefilled(VOLUME_BLOCKS, cache_bytes(), true);
    let engine = rig.engine();
    engine.discard(100 * BS, 24 * BS).unwrap();
    engine.discard(700 * BS, 3 * BS).unwrap();
    engine.drain().unwrap();
    let report = scrub(engine, false);
    assert_eq!(report.blocks_checked, VOLUME_BLOCKS);
    assert_eq!(report.blocks_discarded, 27, "{report:?}");
    assert_eq!(report.blocks_unverified, 0, "{report:?}");
    assert_eq!(report.blocks_verified, VOLUME_BLOCKS - 27, "{report:?}");
}

/// Without repair, a mismatch says whether a clean cached copy exists
/// (so `check --no-repair` does not claim there is none); nothing is
/// rewritten.
#[test]
fn scrub_without_repair_tells_which_mismatches_have_a_cached_copy() {
    let rig = prefilled(VOLUME_BLOCKS, cache_bytes(), true);
    let engine = rig.engine();
    assert_eq!(read_block(engine, 20).unwrap(), origin_pattern(20));
    assert!(engine.is_cached(20));
    engine.flush().unwrap();
    engine.checkpoint().unwrap();
    corrupt_origin_byte(&rig.origin, 20, 4000);
    corrupt_origin_byte(&rig.origin, 10, 100);
    let report = scrub(engine, false);
    assert_eq!(report.mismatches, vec![10, 20]);
    assert_eq!(report.mismatches_cached, vec![20], "{report:?}");
    assert!(report.repaired.is_empty(), "repair was off");
    // With repair, the copy is used and only block 10 is left.
    let report = scrub(engine, true);
    assert_eq!(report.repaired, vec![20]);
    assert_eq!(report.mismatches, vec![10]);
    assert!(report.mismatches_cached.is_empty(), "{report:?}");
}

#[test]
fn misdirected_origin_write_is_caught_at_the_target() {
    let rig = prefilled(VOLUME_BLOCKS, cache_bytes(), true);
    let engine = rig.engine();
    // Block 7's bytes land where block 300 belongs.
    rig.origin.write_at(300 * BS, &origin_pattern(7)).unwrap();
    rig.origin.flush().unwrap();
    assert_eq!(read_block(engine, 7).unwrap(), origin_pattern(7));
    assert!(matches!(
        read_block(engine, 300),
        Err(EngineError::OriginCorrupt { lba: 300, .. })
    ));
    // A multi-block read that covers it fails too, and so does a partial
    // write on top of it (merging into bad data would bless it).
    let mut big = vec![0u8; (16 * BS) as usize];
    assert!(engine.read(296 * BS, &mut big).is_err());
    assert!(matches!(
        engine.write(300 * BS + 512, &[1u8; 512], false),
        Err(EngineError::OriginCorrupt { lba: 300, .. })
    ));
    // A full overwrite replaces it: after write-back the tag is new.
    engine.write(300 * BS, &origin_pattern(300), false).unwrap();
    engine.drain().unwrap();
    assert_eq!(read_block(engine, 300).unwrap(), origin_pattern(300));
    assert!(scrub(engine, false).mismatches.is_empty());
}

#[test]
fn recalculation_resumes_after_restart_and_then_catches_corruption() {
    // 128 MiB origin: the position is persisted every 64 MiB.
    let volume_blocks = 32768;
    let cache = Layout::cache_bytes_min(BS as u32)
        + 2 * 4096 * cairn_format::tag_pages_for(volume_blocks)
        + 256 * BS;
    let mut rig = prefilled(volume_blocks, cache, false);
    let total = volume_blocks;
    let mut position = 0;
    // Tag a little over half, then stop abruptly (no clean shutdown).
    for _ in 0..(total / 256) * 5 / 8 {
        position = rig.engine().recalc_step().unwrap().position_blocks;
    }
    assert!(position > total / 2 && position < total);
    // Reads above the position are unverified, below verified.
    let before = rig.engine().stats();
    read_block(rig.engine(), 5).unwrap();
    read_block(rig.engine(), total - 5).unwrap();
    let after = rig.engine().stats();
    assert_eq!(
        after.origin_verified_reads - before.origin_verified_reads,
        1
    );
    assert_eq!(
        after.origin_unverified_reads - before.origin_unverified_reads,
        1
    );
    let engine = rig.engine.take().unwrap();
    drop(engine);
    let cache_dev = rig.cache.crashed(cairn_device::CrashPlan::DropAll, 1);
    let origin_dev = rig.origin.crashed(cairn_device::CrashPlan::DropAll, 1);
    let engine = open(&cache_dev, &origin_dev).expect("reopen");
    let resumed = engine.stats().recalc_position_blocks;
    assert_eq!(resumed, total / 2, "resumes from the persisted position");
    let mut steps = 0;
    engine
        .recalc_all(|_| {
            steps += 1;
        })
        .unwrap();
    assert_eq!(steps, (total - resumed) / 256, "only the rest is redone");
    assert_eq!(engine.stats().recalc_position_blocks, total);
    let report = scrub(&engine, false);
    assert_eq!(report.blocks_verified, total);
    assert_eq!(report.blocks_unverified, 0);
    // Survives a clean restart too, and detects corruption afterwards.
    engine.close().unwrap();
    drop(engine);
    let engine = open(&cache_dev, &origin_dev).expect("reopen");
    assert_eq!(engine.stats().recalc_position_blocks, total);
    corrupt_origin_byte(&origin_dev, 31000, 1);
    assert!(matches!(
        read_block(&engine, 31000),
        Err(EngineError::OriginCorrupt { lba: 31000, .. })
    ));
    report!(
        "integrity: recalculation stopped at block {position} of {total}, resumed at {resumed} after a crash, completed in {steps} steps; corruption detected afterwards"
    );
}

#[test]
fn tags_follow_writes_zeroes_and_discards_through_every_mode() {
    for seed in 1..=6u64 {
        let mut rig = Rig::with_integrity(cache_bytes(), VOLUME_BLOCKS);
        let mut model = Model::new(VOLUME_BLOCKS);
        let mut wl = Workload::new(seed, VOLUME_BLOCKS);
        wl.allow_mode_switch = seed % 2 == 0;
        for i in 0..1500 {
            let op = wl.next_op();
            let ctx = || format!("seed {seed} op #{i} {op:?}");
            apply_op(&mut rig, &mut model, &op, &ctx);
            if i % 300 == 299 {
                let report = scrub(rig.engine(), false);
                assert!(
                    report.mismatches.is_empty(),
                    "seed {seed} op {i}: false mismatches {:?}",
                    report.mismatches
                );
                assert_eq!(report.blocks_unverified, 0, "seed {seed} op {i}");
            }
        }
        rig.engine().drain().unwrap();
        let report = scrub(rig.engine(), false);
        assert!(report.mismatches.is_empty(), "seed {seed}");
        assert_eq!(report.blocks_skipped, 0, "drained: nothing dirty");
        // Reads that reach the origin verify (drop the cache's copies by
        // reopening on a crash image of a drained, checkpointed cache).
        rig.engine().checkpoint().unwrap();
        let engine = rig.engine.take().unwrap();
        drop(engine);
        let engine = open(&rig.cache, &rig.origin).unwrap();
        let vol = read_volume(&engine).unwrap();
        assert!(vol == model.image, "seed {seed}: volume differs");
        let s = engine.stats();
        assert_eq!(s.origin_unverified_reads, 0);
        assert_eq!(s.origin_mismatches, 0);
    }
}

#[test]
fn sequential_writes_read_no_tags_from_either_device() {
    let volume_blocks = 8192;
    let cache = Layout::cache_bytes_min(BS as u32)
        + 2 * 4096 * cairn_format::tag_pages_for(volume_blocks)
        + 4096 * BS;
    let rig = Rig::with_integrity(cache, volume_blocks);
    rig.cache.reset_counters();
    rig.origin.reset_counters();
    let chunk = 64 * 1024;
    let total_bytes = 16u64 << 20;
    let mut at = 0;
    while at < total_bytes {
        rig.engine()
            .write(at, &pattern(at, chunk as usize), false)
            .unwrap();
        at += chunk;
        if at % (1 << 20) == 0 {
            rig.engine().flush().unwrap();
        }
    }
    let (c, o) = (rig.cache.counters(), rig.origin.counters());
    assert_eq!(c.bytes_read, 0, "the write path read the cache device");
    assert_eq!(o.bytes_read, 0, "the write path read the origin");
    // Write-back reads the log (the data it copies), never a tag, and
    // never the origin.
    rig.engine().drain().unwrap();
    let (c, o) = (rig.cache.counters(), rig.origin.counters());
    assert_eq!(o.bytes_read, 0, "write-back read the origin");
    let data_bytes = total_bytes;
    let headers = total_bytes / (64 * BS) * BS * 2;
    assert!(
        c.bytes_read <= data_bytes + headers,
        "write-back read {} bytes from the cache for {data_bytes} bytes of data",
        c.bytes_read
    );
    let s = rig.engine().stats();
    assert!(s.tag_pages_written > 0);
    report!(
        "integrity: 16 MiB of 64 KiB writes read 0 bytes from either device; write-back read {} bytes of log for {} bytes of data and wrote {} tag pages",
        c.bytes_read,
        data_bytes,
        s.tag_pages_written
    );
}

#[test]
fn format_refuses_a_cache_too_small_for_the_tag_area() {
    let cache = SimDevice::new("cache", Layout::cache_bytes_min(BS as u32) + 16 * BS);
    let origin = SimDevice::new("origin", 1 << 30);
    let err = Engine::format(
        Arc::new(cache.clone()),
        Arc::new(origin),
        &FormatOptions {
            integrity: true,
            ..FormatOptions::default()
        },
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            EngineError::Layout {
                layout: LayoutError::CacheTooSmallForTags { .. },
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        msg.contains("tag area") && msg.contains("fewer origin bytes"),
        "{msg}"
    );
    // Without integrity the same cache is fine.
    let origin = SimDevice::new("origin", 1 << 30);
    Engine::format(
        Arc::new(cache),
        Arc::new(origin),
        &FormatOptions {
            force: true,
            ..FormatOptions::default()
        },
    )
    .unwrap();
}

#[test]
fn unreadable_tag_page_is_recalculated_not_trusted() {
    let mut rig = prefilled(VOLUME_BLOCKS, cache_bytes(), true);
    rig.reopen_clean();
    let engine = rig.engine.take().unwrap();
    engine.close().unwrap();
    drop(engine);
    // Damage both copies of tag page 0.
    let layout = Layout::compute_with_tags(cache_bytes(), BS as u32, Some(VOLUME_BLOCKS)).unwrap();
    for copy in 0..2 {
        rig.cache
            .write_at(layout.tag_page_offset_bytes(0, copy) + 200, &[0xee; 8])
            .unwrap();
    }
    rig.cache.flush().unwrap();
    let engine = open(&rig.cache, &rig.origin).expect("opens with a lost tag page");
    let s = engine.stats();
    assert_eq!(s.tag_pages_lost, 1);
    assert_eq!(s.recalc_position_blocks, 0, "recalculation restarts there");
    engine.recalc_all(|_| {}).unwrap();
    let report = scrub(&engine, false);
    assert_eq!(report.blocks_verified, VOLUME_BLOCKS);
    assert!(report.mismatches.is_empty());
}

/// A scrub over an origin that fails a read once asks again and checks
/// every block (it used to stop at the first failed read); a repair whose
/// write the origin fails once is written again, with its flush.
#[test]
fn a_scrub_asks_a_flaky_origin_again() {
    use cairn_device::{FaultMode, OpKinds};
    let rig = prefilled(VOLUME_BLOCKS, cache_bytes(), true);
    let engine = rig.engine();
    fail_blocks(&rig.origin, OpKinds::READS, (300, 301), FaultMode::Once);
    let report = scrub(engine, true);
    assert_eq!(report.blocks_verified, VOLUME_BLOCKS, "{report:?}");
    let s = engine.stats();
    assert_eq!(
        (s.origin_read_errors, s.origin_read_retries),
        (1, 1),
        "{s:?}"
    );

    // A clean cached copy of block 20, the origin's copy damaged, and the
    // origin failing the repair's write once.
    assert_eq!(read_block(engine, 20).unwrap(), origin_pattern(20));
    engine.flush().unwrap();
    engine.checkpoint().unwrap();
    corrupt_origin_byte(&rig.origin, 20, 4000);
    fail_blocks(&rig.origin, OpKinds::WRITES, (20, 21), FaultMode::Once);
    let report = scrub(engine, true);
    assert_eq!(report.repaired, vec![20], "{report:?}");
    let mut on_origin = vec![0u8; BS as usize];
    rig.origin.read_at(20 * BS, &mut on_origin).unwrap();
    assert_eq!(on_origin, origin_pattern(20), "origin repaired");
    assert_eq!(origin_writes_retries_repairs(engine), (1, 1, 1));
}

/// A repair the origin keeps refusing is tried `origin_write_attempts`
/// times, and then no further repair is tried in that scrub (each would
/// hold write-back's lock for its retries): the rest are reported as
/// mismatches with a cached copy.
#[test]
fn a_scrub_stops_repairing_after_a_repair_fails_for_good() {
    use cairn_device::{FaultMode, OpKinds};
    let rig = prefilled(VOLUME_BLOCKS, cache_bytes(), true);
    let engine = rig.engine();
    for lba in [20, 21] {
        assert_eq!(read_block(engine, lba).unwrap(), origin_pattern(lba));
    }
    engine.flush().unwrap();
    engine.checkpoint().unwrap();
    for lba in [20, 21] {
        corrupt_origin_byte(&rig.origin, lba, 100);
    }
    fail_blocks(&rig.origin, OpKinds::WRITES, (20, 22), FaultMode::Sticky);
    let report = scrub(engine, true);
    assert!(report.repaired.is_empty(), "{report:?}");
    assert_eq!(report.mismatches, vec![20, 21], "{report:?}");
    assert_eq!(report.mismatches_cached, vec![21], "{report:?}");
    assert_eq!(origin_writes_retries_repairs(engine), (4, 3, 0));
}

/// The origin's failed writes, their retries and the scrub's repairs.
fn origin_writes_retries_repairs(engine: &Engine) -> (u64, u64, u64) {
    let s = engine.stats();
    (
        s.origin_write_errors,
        s.origin_write_retries,
        s.origin_repairs,
    )
}
