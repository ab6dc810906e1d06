//! Read-caching policies: sequential cutoff keeps a long stream from
//! flushing the cache, random reads of a small working set become hits, and
//! n-hit promotion waits for the Nth miss.

mod common;
use common::*;

use std::sync::Arc;

use cairn_device::{Device, SimDevice};
use cairn_engine::{Engine, EngineConfig, FormatOptions, OpenOptions};

fn rig(cache_bytes: u64, volume_bytes: u64, config: EngineConfig) -> (SimDevice, Engine) {
    let cache = SimDevice::new("cache", cache_bytes);
    let origin = SimDevice::new("origin", volume_bytes);
    Engine::format(
        Arc::new(cache.clone()),
        Arc::new(origin.clone()),
        &FormatOptions::default(),
    )
    .unwrap();
    let e = Engine::open(
        Arc::new(cache) as Arc<dyn Device>,
        Arc::new(origin.clone()) as Arc<dyn Device>,
        &OpenOptions {
            force_origin: false,
            config,
        },
    )
    .unwrap();
    (origin, e)
}

#[test]
fn sequential_cutoff_bypasses_long_streams() {
    let mib = 1u64 << 20;
    let (_origin, e) = rig(16 * mib, 80 * mib, EngineConfig::default());
    let mut buf = vec![0u8; mib as usize];
    for i in 0..64 {
        e.read(i * mib, &mut buf).unwrap();
    }
    let s = e.stats();
    let occupancy_bytes = s.clean_blocks * BS;
    report!(
        "64 MiB sequential read: {} blocks bypassed, cache occupancy {} KiB",
        s.bypassed,
        occupancy_bytes >> 10
    );
    assert!(
        s.bypassed * BS >= 59 * mib,
        "most of the stream bypassed the cache"
    );
    assert!(
        occupancy_bytes <= 5 * mib,
        "occupancy stays near the cutoff, not the stream size"
    );

    // A small random working set becomes hits after one pass.
    let set: Vec<u64> = (0..256u64).map(|i| (i * 7919) % (80 * mib / BS)).collect();
    let mut block = vec![0u8; BS as usize];
    for &lba in &set {
        e.read(lba * BS, &mut block).unwrap();
    }
    let before = e.stats();
    for &lba in &set {
        e.read(lba * BS, &mut block).unwrap();
    }
    let after = e.stats();
    assert_eq!(
        after.read_hits - before.read_hits,
        set.len() as u64,
        "second pass all hits"
    );
    assert_eq!(after.read_misses, before.read_misses);
}

#[test]
fn nhit_promotion_waits_for_the_nth_miss() {
    let mib = 1u64 << 20;
    let config = EngineConfig {
        promote_after_misses: 3,
        ..EngineConfig::default()
    };
    let (_origin, e) = rig(16 * mib, 32 * mib, config);
    let mut block = vec![0u8; BS as usize];
    for pass in 1..=4u64 {
        e.read(100 * BS, &mut block).unwrap();
        let s = e.stats();
        match pass {
            1 | 2 => assert_eq!((s.promotions, s.read_hits), (0, 0), "pass {pass}"),
            3 => assert_eq!(
                (s.promotions, s.read_hits),
                (1, 0),
                "promoted on the 3rd miss"
            ),
            _ => assert_eq!(s.read_hits, 1, "then a hit"),
        }
    }
    assert_eq!(e.stats().promotions_skipped, 2);
}

#[test]
fn second_chance_keeps_hot_blocks_through_a_cold_stream() {
    let mib = 1u64 << 20;
    let (_origin, e) = rig(cache_bytes_small(), 64 * mib, EngineConfig::default());
    let hot: Vec<u64> = (0..64u64).map(|i| i * 97 % 1024).collect();
    let mut block = vec![0u8; BS as usize];
    let read_hot = |e: &Engine| {
        let mut hits = 0;
        for &lba in &hot {
            let before = e.stats().read_hits;
            e.read(lba * BS, &mut vec![0u8; BS as usize]).unwrap();
            hits += e.stats().read_hits - before;
        }
        hits
    };
    read_hot(&e); // promote
    for round in 0..16u64 {
        // Best effort and bounded per round, but without it the whole hot
        // set would be gone after one lap of the log.
        let hits = read_hot(&e);
        assert!(
            hits >= hot.len() as u64 * 7 / 8,
            "round {round}: only {hits} of the hot set cached"
        );
        // A cold stream larger than the cache, written back so it is clean.
        // Each round writes about one lap of the log; the hot set is read
        // a few times per lap, as a working set would be.
        for i in 0..8u64 {
            let lba = 2048 + (round * 8 + i) * 64 % (14 * 1024);
            e.write(lba * BS, &pattern(round * 100 + i, 64 * BS as usize), false)
                .unwrap();
            e.drain().unwrap();
            if i % 3 == 2 {
                read_hot(&e);
            }
        }
        e.read(0, &mut block).unwrap();
    }
    let s = e.stats();
    report!(
        "second chance: {} blocks moved forward, {} evicted",
        s.second_chances,
        s.evictions
    );
    assert!(s.second_chances > 0);
}

#[test]
fn writearound_drops_the_cached_copy_and_reads_return_new_data() {
    use cairn_engine::CacheMode;
    let mib = 1u64 << 20;
    let (origin, e) = rig(16 * mib, 32 * mib, EngineConfig::default());
    let old = pattern(1, BS as usize);
    e.write(10 * BS, &old, false).unwrap();
    e.set_mode(CacheMode::WriteAround, |_| {}).unwrap();
    assert!(
        e.is_cached(10),
        "the old copy is cached (clean after the drain)"
    );
    let new = pattern(2, BS as usize);
    e.write(10 * BS, &new, false).unwrap();
    assert!(!e.is_cached(10), "write-around drops the cached copy");
    assert_eq!(
        &origin.live_image()[(10 * BS) as usize..(11 * BS) as usize],
        &new[..],
        "the origin has the new data on return"
    );
    let mut buf = vec![0u8; BS as usize];
    e.read(10 * BS, &mut buf).unwrap();
    assert_eq!(buf, new, "a later read returns the new data");
    assert!(e.is_cached(10), "reads are still cached in write-around");
    assert_eq!(e.stats().dirty_blocks, 0);
}

/// Write-around keeps no written copy, also of the partial blocks at the
/// edges of a write-zeroes (zeroed by read-modify-write, so written as
/// data): they are on the origin on return and not cached. (A cargo-mutants
/// survivor, `offset / block_bytes` to `*` in `zero_range`, left them
/// cached.)
#[test]
fn writearound_zeroes_keep_no_copy_of_their_partial_edges() {
    use cairn_engine::CacheMode;
    let mib = 1u64 << 20;
    let (origin, e) = rig(16 * mib, 32 * mib, EngineConfig::default());
    let old: Vec<u8> = (20..24u64).flat_map(|k| pattern(k, BS as usize)).collect();
    e.write(20 * BS, &old, false).unwrap();
    e.set_mode(CacheMode::WriteAround, |_| {}).unwrap();
    assert!((20..24).all(|lba| e.is_cached(lba)), "cached, clean");
    // From the middle of block 20 to the middle of block 23.
    let (at, len) = (20 * BS + 512, 3 * BS);
    e.write_zeroes(at, len).unwrap();
    for lba in 20..24 {
        assert!(!e.is_cached(lba), "write-around keeps block {lba} cached");
    }
    let mut expected = old.clone();
    expected[512..512 + len as usize].fill(0);
    assert_eq!(
        &origin.live_image()[(20 * BS) as usize..(24 * BS) as usize],
        &expected[..],
        "the origin has the zeroes on return"
    );
    let mut got = vec![0u8; (4 * BS) as usize];
    e.read(20 * BS, &mut got).unwrap();
    assert_eq!(got, expected);
}

/// In write-back mode a write-zeroes or a discard is absorbed like a
/// write: it waits for no write-through and leaves its range dirty for
/// write-back. (A cargo-mutants survivor, the mode test of `zero_range`
/// inverted, made every zero in write-back mode wait for the origin:
/// correct data, the cost of write-through.)
#[test]
fn writeback_zeroes_and_discards_do_not_wait_for_the_origin() {
    let mib = 1u64 << 20;
    let (origin, e) = rig(16 * mib, 32 * mib, EngineConfig::default());
    let data: Vec<u8> = (0..8u64).flat_map(|k| pattern(k, BS as usize)).collect();
    e.write(0, &data, false).unwrap();
    let origin_before = origin.live_image();
    e.write_zeroes(512, 3 * BS).unwrap();
    e.discard(4 * BS, 2 * BS).unwrap();
    let s = e.stats();
    assert_eq!(s.writethrough_waits, 0, "{s:?}");
    assert!(
        s.pending_ranges > 0,
        "the ranges wait for write-back: {s:?}"
    );
    assert!(
        origin.live_image() == origin_before,
        "nothing reached the origin before write-back"
    );
}

/// A prefetch (`cairn warm`, NBD CACHE) is counted apart from client
/// reads: its hits (a flushed block, one still in memory), zeroed blocks
/// and misses move the `prefetch_*` counters and leave `reads`,
/// `read_hits`, `read_misses` and `read_zero_hits` (the hit ratio) as they
/// were. (They were counted as client reads: warming a cache showed a hit
/// ratio the clients never had.)
#[test]
fn a_prefetch_is_not_counted_as_a_client_read() {
    let mib = 1u64 << 20;
    let (_origin, e) = rig(16 * mib, 32 * mib, EngineConfig::default());
    let block = |k: u64| pattern(k, BS as usize);
    // Blocks 8..12 written and flushed (cache slots), 0..4 written since
    // (maybe still in memory), 16..20 zeroed (a pending range); 4..8,
    // 12..16 and 20..32 are on the origin only: 20 misses.
    let flushed: Vec<u8> = (8..12).flat_map(block).collect();
    e.write(8 * BS, &flushed, false).unwrap();
    e.flush().unwrap();
    let recent: Vec<u8> = (0..4).flat_map(block).collect();
    e.write(0, &recent, false).unwrap();
    e.write_zeroes(16 * BS, 4 * BS).unwrap();

    let client = |s: &cairn_engine::StatsSnapshot| {
        (
            s.reads,
            s.read_bytes,
            s.read_hits,
            s.read_misses,
            s.read_zero_hits,
        )
    };
    let prefetch = |s: &cairn_engine::StatsSnapshot| {
        (
            s.prefetch_reads,
            s.prefetch_bytes,
            s.prefetch_hits,
            s.prefetch_misses,
            s.prefetch_zero_hits,
        )
    };
    let before = e.stats();
    let mut buf = vec![0u8; (32 * BS) as usize];
    e.read_uncut(0, &mut buf).unwrap();
    let warmed = e.stats();
    assert_eq!(
        client(&warmed),
        client(&before),
        "a prefetch moved the client read counters"
    );
    assert_eq!(
        prefetch(&warmed),
        (1, 32 * BS, 8, 20, 4),
        "the prefetch's own counters: a request, its bytes, 8 hits, 20 misses, 4 zeroed"
    );
    assert_eq!(warmed.promotions, 20, "every miss promoted");

    // A client read of the same range after it: every block a hit (or
    // zeroed), counted as the client's, the prefetch's counters unchanged.
    e.read(0, &mut buf).unwrap();
    let read = e.stats();
    assert_eq!(prefetch(&read), prefetch(&warmed));
    assert_eq!(
        client(&read),
        (
            before.reads + 1,
            before.read_bytes + 32 * BS,
            before.read_hits + 28,
            before.read_misses,
            before.read_zero_hits + 4
        )
    );
}
