//! Every geometry `format` accepts works: block size × cache size × origin
//! size × integrity. Each one fills the log past a lap with writes smaller
//! than a block (read-modify-write) and whole blocks, so eviction, space
//! pressure, write-back and checkpoints all run; then it checkpoints,
//! reopens and checks every block, and drains and checks the origin.
//! (64 KiB blocks on a cache under 128 MiB once panicked at the first
//! checkpoint: its payload was padded to a whole block past its slot.)

mod common;
use common::*;

use std::sync::Arc;

use cairn_device::SimDevice;
use cairn_engine::{Engine, EngineError, FormatOptions};
use cairn_format::Layout;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// One geometry: returns false if `format` refused it (too small).
fn check_geometry(block_bytes: u32, cache_bytes: u64, origin_bytes: u64, integrity: bool) -> bool {
    let ctx = format!(
        "block {} KiB, cache {} KiB, origin {} KiB, integrity {integrity}",
        block_bytes >> 10,
        cache_bytes >> 10,
        origin_bytes >> 10
    );
    let cache = SimDevice::new("cache", cache_bytes);
    let origin = SimDevice::new("origin", origin_bytes);
    let formatted = Engine::format(
        Arc::new(cache.clone()),
        Arc::new(origin.clone()),
        &FormatOptions {
            block_size_bytes: block_bytes,
            integrity,
            ..FormatOptions::default()
        },
    );
    match formatted {
        Ok(superblock) => {
            // Large records exactly where the log holds 8 of them.
            let layout = Layout::compute_with_tags(
                cache_bytes,
                block_bytes,
                integrity.then_some(origin_bytes / block_bytes as u64),
            )
            .expect("the layout format used");
            assert_eq!(
                superblock.features & cairn_format::FEATURE_LARGE_RECORDS != 0,
                layout.holds_large_records(),
                "{ctx}: large records"
            );
        }
        Err(EngineError::Layout { .. }) => return false,
        Err(e) => panic!("{ctx}: format failed with something other than a size error: {e}"),
    }
    let engine = open(&cache, &origin).unwrap_or_else(|e| panic!("{ctx}: open: {e}"));
    if integrity {
        engine
            .recalc_all(|_| {})
            .unwrap_or_else(|e| panic!("{ctx}: recalc: {e}"));
    }
    let bs = block_bytes as u64;
    let volume_blocks = origin_bytes / bs;
    let log_blocks = Layout::compute(cache_bytes, block_bytes)
        .map(|l| l.log_blocks)
        .unwrap_or(64);
    let mut model = vec![0u8; origin_bytes as usize];
    let mut rng = ChaCha8Rng::seed_from_u64(block_bytes as u64 ^ cache_bytes ^ origin_bytes);
    // Past one lap of the log, bounded so the grid stays quick.
    let writes = (log_blocks * 3 / 2).clamp(200, 6000);
    for i in 0..writes {
        let lba = rng.gen_range(0..volume_blocks);
        // A quarter of the writes are 4 KiB into a bigger block.
        let (offset, len) = if bs > 4096 && i % 4 == 0 {
            let k = rng.gen_range(0..bs / 4096);
            (lba * bs + k * 4096, 4096)
        } else {
            (lba * bs, bs)
        };
        let data = pattern(i ^ (block_bytes as u64) << 32, len as usize);
        engine
            .write(offset, &data, i % 97 == 0)
            .unwrap_or_else(|e| panic!("{ctx}: write {i}: {e}"));
        model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
        if i % 53 == 0 {
            engine
                .flush()
                .unwrap_or_else(|e| panic!("{ctx}: flush: {e}"));
        }
        if i % 211 == 0 {
            engine
                .writeback_step()
                .unwrap_or_else(|e| panic!("{ctx}: write-back: {e}"));
        }
    }
    engine
        .checkpoint()
        .unwrap_or_else(|e| panic!("{ctx}: checkpoint: {e}"));
    let stats = engine.stats();
    assert!(stats.checkpoints >= 1, "{ctx}: no checkpoint ran");
    drop(engine);
    // Reopen without a clean close: recovery from the checkpoint and the
    // log after it.
    let engine = open(&cache, &origin).unwrap_or_else(|e| panic!("{ctx}: reopen: {e}"));
    let volume = read_volume(&engine).unwrap_or_else(|e| panic!("{ctx}: read: {e}"));
    assert!(volume == model, "{ctx}: the volume differs after reopening");
    engine
        .drain()
        .unwrap_or_else(|e| panic!("{ctx}: drain: {e}"));
    engine
        .close()
        .unwrap_or_else(|e| panic!("{ctx}: close: {e}"));
    assert!(
        origin.live_image() == model,
        "{ctx}: the origin differs after the drain"
    );
    true
}

#[test]
fn every_accepted_geometry_fills_checkpoints_and_recovers() {
    let mut checked = 0;
    let mut refused = 0;
    for block_bytes in [4096u32, 8192, 16384, 65536] {
        let min = Layout::cache_bytes_min(block_bytes);
        // Either side of the smallest cache that takes large records.
        let large = Layout::cache_bytes_min_for(block_bytes, cairn_format::FEATURE_LARGE_RECORDS);
        for cache_bytes in [
            min,
            min + 3 * block_bytes as u64,
            large - block_bytes as u64,
            large,
            8 << 20,
            16 << 20,
            64 << 20,
        ] {
            for origin_factor in [1u64, 8] {
                // Origins smaller and larger than the cache, whole blocks.
                let origin_bytes =
                    (cache_bytes / 2 * origin_factor) / block_bytes as u64 * block_bytes as u64;
                for integrity in [false, true] {
                    if check_geometry(block_bytes, cache_bytes, origin_bytes, integrity) {
                        checked += 1;
                    } else {
                        refused += 1;
                    }
                }
            }
        }
    }
    report!(
        "geometries: {checked} formatted, filled, checkpointed, recovered and drained; {refused} refused by format as too small"
    );
    assert!(checked >= 90, "too few geometries were accepted: {checked}");
}
