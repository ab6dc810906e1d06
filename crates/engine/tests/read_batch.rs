//! Batched reads (`Engine::read_many`) against the reference model: every
//! read of the random workload is served as part of a batch with a few more
//! reads (cached, missing, unaligned, in the open record), and every result
//! must be the model's bytes. A corruption sweep checks that a batch gives
//! the right data or an error per request, never wrong data.

mod common;
use cairn_format::Layout;
use common::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::atomic::{AtomicU64, Ordering};

/// Requests served by `read_cached_many` (the rest went to `read`).
static SERVED_BATCHED: AtomicU64 = AtomicU64::new(0);

/// What the NBD server does: the cached reads together, the rest one by one.
fn read_many(
    engine: &cairn_engine::Engine,
    requests: &mut [(u64, &mut [u8])],
) -> Vec<Result<(), cairn_engine::EngineError>> {
    let served = engine.read_cached_many(requests);
    let count = served.iter().filter(|r| r.is_some()).count();
    SERVED_BATCHED.fetch_add(count as u64, Ordering::Relaxed);
    served
        .into_iter()
        .zip(requests.iter_mut())
        .map(|(outcome, (offset, buf))| outcome.unwrap_or_else(|| engine.read(*offset, buf)))
        .collect()
}

fn check_batch(rig: &Rig, model: &Model, extents: &[(u64, u64)], ctx: &str) {
    let mut bufs: Vec<Vec<u8>> = extents
        .iter()
        .map(|&(_, len)| vec![0xEEu8; len as usize])
        .collect();
    let mut requests: Vec<(u64, &mut [u8])> = extents
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&(offset, _), buf)| (offset, buf.as_mut_slice()))
        .collect();
    let results = read_many(rig.engine(), &mut requests);
    assert_eq!(results.len(), extents.len(), "{ctx}");
    for (i, result) in results.into_iter().enumerate() {
        let (offset, len) = extents[i];
        result.unwrap_or_else(|e| panic!("{ctx}: request {i} ({offset}+{len}): {e}"));
        let want = &model.image[offset as usize..(offset + len) as usize];
        assert!(
            bufs[i] == want,
            "{ctx}: request {i} ({offset}+{len}) returned wrong data"
        );
    }
}

fn run_seed(seed: u64, ops: usize, volume_blocks: u64) -> u64 {
    let mut rig = Rig::new(cache_bytes_small(), volume_blocks);
    let mut model = Model::new(volume_blocks);
    let mut wl = Workload::new(seed, volume_blocks);
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xBA7C4);
    let mut batched = 0u64;
    for i in 0..ops {
        let op = wl.next_op();
        let ctx = format!("seed {seed} op #{i} {op:?}; {}", repro("read_batch", seed));
        if let Op::Read { offset, len } = op {
            // The workload's read plus up to 7 more: single blocks and
            // short runs anywhere, often just written (open record) or
            // read before (cached clean), sometimes never seen (miss).
            let mut extents = vec![(offset, len)];
            for _ in 0..rng.gen_range(0..8) {
                let blocks = rng.gen_range(1..=4u64);
                let lba = rng.gen_range(0..=volume_blocks - blocks);
                extents.push((lba * BS, blocks * BS));
            }
            batched += extents.len() as u64;
            check_batch(&rig, &model, &extents, &ctx);
        } else {
            apply_op(&mut rig, &mut model, &op, &|| ctx.clone());
        }
    }
    // The whole volume, as one batch of single blocks.
    let all: Vec<(u64, u64)> = (0..volume_blocks).map(|lba| (lba * BS, BS)).collect();
    check_batch(&rig, &model, &all, &format!("seed {seed} final"));
    assert_eq!(rig.engine().stats().checksum_mismatches, 0);
    batched
}

#[test]
fn read_many_matches_the_model() {
    let seeds = seeds(12);
    let mut reads = 0;
    for &seed in &seeds {
        reads += run_seed(seed + 5000, 2000, 512);
    }
    let served = SERVED_BATCHED.load(Ordering::Relaxed);
    report!(
        "read_many: {} seeds, {reads} reads in batches ({served} served by read_cached_many), 0 divergences",
        seeds.len()
    );
    assert!(served > reads / 4, "the batched path was hardly used");
}

/// Flip a byte in log blocks of a cache holding clean and dirty data: each
/// request of a batch returns the model's data or an error (a dirty block
/// that fails its checksum), never wrong data, and clean blocks are
/// repaired from the origin.
#[test]
fn read_many_corruption_sweep() {
    const VOLUME_BLOCKS: u64 = 256;
    let rig = Rig::new(cache_bytes_small(), VOLUME_BLOCKS);
    let mut model = Model::new(VOLUME_BLOCKS);
    for lba in 0..VOLUME_BLOCKS {
        let data = pattern(1000 + lba, BS as usize);
        rig.engine().write(lba * BS, &data, false).unwrap();
        model.write(lba * BS, &data);
    }
    rig.engine().drain().unwrap();
    // Half rewritten and left dirty.
    for lba in (0..VOLUME_BLOCKS).step_by(2) {
        let data = pattern(9000 + lba, BS as usize);
        rig.engine().write(lba * BS, &data, false).unwrap();
        model.write(lba * BS, &data);
    }
    rig.engine().close().unwrap();
    let image = rig.cache.durable_image();
    let origin_image = rig.origin.durable_image();
    let layout = Layout::compute(cache_bytes_small(), BS as u32).unwrap();
    let (mut errors, mut repairs, mut opened) = (0u64, 0u64, 0u64);
    for b in (0..layout.log_blocks).step_by(5) {
        let mut img = image.clone();
        img[(layout.log_offset_bytes() + b * BS + (b * 97) % BS) as usize] ^= 0x5a;
        let cache = cairn_device::SimDevice::from_image("cache", img);
        let origin = cairn_device::SimDevice::from_image("origin", origin_image.clone());
        let Ok(engine) = open(&cache, &origin) else {
            continue;
        };
        opened += 1;
        let mut bufs = vec![vec![0u8; BS as usize]; VOLUME_BLOCKS as usize];
        let mut requests: Vec<(u64, &mut [u8])> = bufs
            .iter_mut()
            .enumerate()
            .map(|(lba, buf)| (lba as u64 * BS, buf.as_mut_slice()))
            .collect();
        let results = read_many(&engine, &mut requests);
        for (lba, result) in results.into_iter().enumerate() {
            match result {
                Ok(()) => assert!(
                    bufs[lba] == model.block(lba as u64),
                    "flip in log block {b}: block {lba} returned wrong data"
                ),
                Err(_) => errors += 1,
            }
        }
        repairs += engine.stats().repairs;
    }
    report!("read_many corruption sweep: {opened} opened, {errors} requests answered EIO, {repairs} repairs, 0 wrong reads");
    assert!(errors > 0, "no flip hit a dirty block");
    assert!(repairs > 0, "no flip hit a clean block");
}

/// A read's plan, exactly: one device read per run of hits in adjacent
/// slots and one origin read per run of misses, every block counted once
/// as a hit or a miss, nothing re-read; a failed cache read re-reads only
/// its own blocks; and a batch serves a request only if every block of it
/// is cached, without touching the origin. (cargo-mutants survivors: runs
/// joined across a gap, or never joined, and the cached-only check
/// inverted, all still served the right bytes, because checksums caught the
/// wrong reads and the slow path repaired them.)
#[test]
fn a_read_costs_one_device_read_per_run_and_batches_serve_only_cached_requests() {
    use cairn_device::{FaultMode, OpKinds, RangeFault};
    let rig = Rig::new(cache_bytes_small(), 256);
    let e = rig.engine();
    let layout = Layout::compute(cache_bytes_small(), BS as u32).unwrap();
    // lba 0..4 in one record, 4..8 in the next: the second record's header
    // slot lies between their data slots.
    let a = pattern(1, 4 * BS as usize);
    let b = pattern(2, 4 * BS as usize);
    e.write(0, &a, false).unwrap();
    e.flush().unwrap();
    let head_b = e.stats().head_offset;
    e.write(4 * BS, &b, false).unwrap();
    e.flush().unwrap();
    let both: Vec<u8> = a.iter().chain(b.iter()).copied().collect();

    let before = e.stats();
    rig.cache.reset_counters();
    rig.origin.reset_counters();
    let mut buf = vec![0u8; 8 * BS as usize];
    e.read(0, &mut buf).unwrap();
    assert!(buf == both, "the bytes written");
    let s = e.stats();
    assert_eq!(
        rig.cache.counters().reads,
        2,
        "one read per run of adjacent slots"
    );
    assert_eq!(rig.origin.counters().reads, 0);
    assert_eq!(s.read_hits - before.read_hits, 8);
    assert_eq!(s.read_misses, before.read_misses);
    assert_eq!(
        s.hit_rereads_ok, before.hit_rereads_ok,
        "nothing re-read: {s:?}"
    );
    assert_eq!(s.checksum_mismatches, 0);

    // Two hits, then four misses: one cache read, one origin read.
    let before = e.stats();
    rig.cache.reset_counters();
    rig.origin.reset_counters();
    let mut buf = vec![0u8; 6 * BS as usize];
    e.read(6 * BS, &mut buf).unwrap();
    assert!(
        buf[..2 * BS as usize] == b[2 * BS as usize..],
        "the two hits"
    );
    assert!(buf[2 * BS as usize..].iter().all(|&x| x == 0), "the misses");
    let s = e.stats();
    assert_eq!(
        rig.origin.counters().reads,
        1,
        "one origin read per run of misses"
    );
    assert_eq!(s.read_misses - before.read_misses, 4);
    assert_eq!(s.read_hits - before.read_hits, 2);

    // The cache read of the second run fails once: only its four blocks
    // are read again.
    let before = e.stats();
    let b_at = layout.log_offset_bytes() + (head_b + 1) % layout.log_blocks * BS;
    rig.cache.fail_range(RangeFault {
        kinds: OpKinds {
            reads: true,
            writes: false,
            flushes: false,
        },
        start: b_at,
        end: b_at + 4 * BS,
        mode: FaultMode::Once,
    });
    let mut buf = vec![0u8; 8 * BS as usize];
    e.read(0, &mut buf).unwrap();
    assert!(buf == both, "served after the re-read");
    let s = e.stats();
    assert_eq!(rig.cache.injected_failures(), 1);
    assert_eq!(s.hit_rereads_ok - before.hit_rereads_ok, 4, "{s:?}");

    // Batches: a wholly cached request is served, the others are left for
    // `read`, and the origin is not touched.
    rig.origin.reset_counters();
    let (mut r0, mut r1, mut r2) = (
        vec![0u8; 8 * BS as usize],
        vec![0u8; 2 * BS as usize],
        vec![0u8; 2 * BS as usize],
    );
    let mut requests: Vec<(u64, &mut [u8])> = vec![
        (0, &mut r0[..]),
        (100 * BS, &mut r1[..]),
        (7 * BS, &mut r2[..]),
    ];
    let served = e.read_cached_many(&mut requests);
    assert!(matches!(served[0], Some(Ok(()))), "wholly cached: served");
    assert!(served[1].is_none(), "not cached: left alone");
    let partly_cached = e.is_cached(7) && e.is_cached(8);
    assert_eq!(served[2].is_none(), !partly_cached);
    assert!(r0 == both);
    assert_eq!(
        rig.origin.counters().reads,
        0,
        "a batch never reads the origin"
    );
}
