//! Crash harness. A seeded workload runs on simulated cache and origin
//! devices whose every write and flush is journaled. After each single
//! device event (a cut point: every write, every flush, so every FUA and
//! client flush too) crash states are built from the durable image plus the
//! unflushed writes: all dropped, all kept, and random subsets applied in
//! shuffled order with torn (512-byte granular) writes. Each state is
//! recovered and every block read. Invariants:
//! - every block holds its last durably acknowledged value or a value
//!   written later: never stale data, garbage or another block's data;
//! - recovering the recovered image again gives the same volume;
//! - the origin alone equals the volume as of some past flush F, and with
//!   its own unflushed writes kept, dropped, reordered (origin crash
//!   states) it holds in every block F's value or one written in the epoch
//!   right after F, nothing else; recovering a cache over a torn origin
//!   still gives the volume;
//! - with origin integrity (a quarter of the seeds): every origin block
//!   that is not dirty in the recovered cache matches its tag (no false
//!   mismatch: reading the whole volume verifies every origin read, and a
//!   scrub finds nothing), and no read is unverified (recalculation was
//!   complete before the workload).
//!
//! A failure prints the seed, op and event index to reproduce it.

mod common;
use common::crash_check::*;
use common::*;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};

use cairn_device::{
    build_crash_image, CrashPlan, FaultMode, Journal, JournalEvent, OpKinds, RangeFault,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

static CUTS: AtomicU64 = AtomicU64::new(0);
/// Writes that found the log full of dirty data (full-log configurations).
static FULL_LOG_STALLS: AtomicU64 = AtomicU64::new(0);
/// Origin crash states checked (origin alone, and under a recovered cache).
static ORIGIN_STATES: AtomicU64 = AtomicU64::new(0);
static DONE: AtomicU64 = AtomicU64::new(0);
/// Device events inside the ops that switched to degraded mode.
static DEGRADING_CUTS: AtomicU64 = AtomicU64::new(0);

/// A flush state: its blocks, and what the epoch after it wrote.
struct Epoch {
    blocks: Vec<u32>,
    next: Vec<Vec<u32>>,
}

impl Epoch {
    fn new(blocks: &[u32]) -> Epoch {
        Epoch {
            blocks: blocks.to_vec(),
            next: vec![Vec::new(); blocks.len()],
        }
    }
}

/// The origin crashed with its write-back writes since its last flush in
/// flight: kept, or a random subset in any order. Every block must hold
/// its value as of that flush or one the epoch right after it wrote: write
/// back never mixes in a later epoch before the origin flush between them.
fn check_origin_crash_states(
    ctx: &str,
    origin: &Shadow,
    epoch: &Epoch,
    origin_bytes: usize,
    rng: &mut ChaCha8Rng,
) {
    if origin.pending.is_empty() {
        return;
    }
    let plans = [
        ("keep-all", CrashPlan::KeepAll),
        (
            "random",
            CrashPlan::Random {
                keep: 0.5,
                tear: 0.0,
            },
        ),
    ];
    for (name, plan) in plans {
        let img = build_crash_image(&origin.durable, &origin.pending, plan, rng);
        for (b, &flushed) in epoch.blocks.iter().enumerate() {
            let range = b * BS as usize..(b + 1) * BS as usize;
            if range.end > origin_bytes {
                break;
            }
            let got = crc(&img[range]);
            assert!(
                got == flushed || epoch.next[b].contains(&got),
                "{ctx} {name}: origin block {b} holds a value from neither its last flush nor the epoch after it"
            );
        }
        ORIGIN_STATES.fetch_add(1, Ordering::Relaxed);
    }
}

/// Where a seed's log stops taking writes for good (the engine then goes
/// degraded). From that op on, origin flushes are cut points too: in
/// degraded mode they are where writes become durable.
#[derive(Clone, Copy)]
struct DegradeAt {
    op: usize,
}

fn run_seed(
    seed: u64,
    ops: usize,
    volume_blocks: u64,
    random_states_per_cut: usize,
    degrade_at: Option<DegradeAt>,
    keep_log_full: bool,
    cache_base_bytes: u64,
) {
    // A quarter of the seeds keep origin integrity tags.
    let integrity = seed % 4 == 1;
    let mut rig = if integrity {
        Rig::with_integrity(
            cache_base_bytes + 2 * 4096 * cairn_format::tag_pages_for(volume_blocks),
            volume_blocks,
        )
    } else {
        Rig::new(cache_base_bytes, volume_blocks)
    };
    let journal = Journal::default();
    rig.cache.attach_journal(&journal, 0);
    rig.origin.attach_journal(&journal, 1);
    let mut cache_shadow = Shadow::of(&rig.cache);
    let mut origin_shadow = Shadow::of(&rig.origin);
    let mut cursor = 0usize;
    let mut model = Model::new(volume_blocks);
    let mut durable_model = model.image.clone();
    let mut allowed: Vec<Vec<u32>> = vec![Vec::new(); volume_blocks as usize];
    let mut flush_states: HashSet<u32> = HashSet::new();
    flush_states.insert(crc(&model.image));
    // Each flush state by its crc: its blocks' crcs, and the values written
    // to each block in the epoch after it.
    let mut block_crcs: Vec<u32> = (0..volume_blocks).map(|b| crc(model.block(b))).collect();
    let mut epochs: HashMap<u32, Epoch> = HashMap::new();
    let mut cur_epoch = crc(&model.image);
    epochs.insert(cur_epoch, Epoch::new(&block_crcs));
    let mut wl = Workload::new(seed ^ 0xc4a5, volume_blocks);
    // Every third seed also switches cache modes (not once degraded: a
    // degraded cache refuses mode changes).
    wl.allow_mode_switch = seed.is_multiple_of(3) && degrade_at.is_none() && !keep_log_full;
    wl.keep_log_full = keep_log_full;
    let cache_bytes = cairn_device::Device::size_bytes(&rig.cache);
    let log_start = cairn_format::Layout::compute_with_tags(
        cache_bytes,
        BS as u32,
        integrity.then_some(volume_blocks),
    )
    .expect("layout")
    .log_offset_bytes();
    let mut cut_origin_flushes = false;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let origin_bytes = (volume_blocks * BS) as usize;
    for i in 0..ops {
        let op = wl.next_op();
        if std::env::var("CAIRN_TRACE").is_ok() {
            eprintln!("op #{i}: {op:?}");
        }
        if degrade_at.is_some_and(|d| d.op == i) {
            rig.cache.fail_range(RangeFault {
                kinds: OpKinds::WRITES,
                start: log_start,
                end: cache_bytes,
                mode: FaultMode::Sticky,
            });
            cut_origin_flushes = true;
        }
        let was_degraded = rig.engine().is_degraded();
        let pre_image = cut_origin_flushes.then(|| model.image.clone());
        let barriers_before = rig.cache.counters().flushes;
        let epochs_before = rig.engine().stats().epochs_sealed;
        let h_pre = crc(&model.image);
        let pre_block_crcs = block_crcs.clone();
        let mut touched: Vec<(u64, u64)> = Vec::new();
        match &op {
            Op::Write {
                offset,
                len,
                fua,
                seed: s,
            } => {
                let data = pattern(*s, *len as usize);
                rig.engine().write(*offset, &data, *fua).expect("write");
                model.write(*offset, &data);
                touched.push((*offset, *len));
            }
            Op::Read { offset, len } => {
                let mut buf = vec![0u8; *len as usize];
                rig.engine().read(*offset, &mut buf).expect("read");
                assert!(
                    buf == model.image[*offset as usize..(*offset + *len) as usize],
                    "seed {seed} op {i}: read differs"
                );
            }
            Op::Flush => rig.engine().flush().expect("flush"),
            Op::Discard { offset, len } => {
                rig.engine().discard(*offset, *len).expect("discard");
                model.discard(*offset, *len);
                touched.push((*offset, *len));
            }
            Op::Zero { offset, len } => {
                rig.engine().write_zeroes(*offset, *len).expect("zero");
                model.zero(*offset, *len);
                touched.push((*offset, *len));
            }
            Op::WritebackStep => {
                rig.engine().writeback_step().expect("writeback");
            }
            Op::Drain => {
                rig.engine().drain().expect("drain");
            }
            Op::Checkpoint => rig.engine().checkpoint().expect("checkpoint"),
            Op::ReopenClean => rig.reopen_clean(),
            Op::SetMode(m) => {
                rig.engine().set_mode(*m, |_| {}).expect("set mode");
            }
        }
        for &(offset, len) in &touched {
            for b in offset / BS..(offset + len).div_ceil(BS) {
                allowed[b as usize].push(crc(model.block(b)));
            }
        }
        let degraded = rig.engine().is_degraded();
        // The op in which the engine went degraded: its drain took the
        // origin from the last flushed state to the acknowledged one plus
        // possibly part of this op, in one origin flush.
        let degrading_op = degraded && !was_degraded;
        // Degraded, every op ends with an origin flush.
        if rig.cache.counters().flushes != barriers_before
            || matches!(op, Op::ReopenClean)
            || degraded
        {
            flush_states.insert(h_pre);
            flush_states.insert(crc(&model.image));
        }
        // Epoch ends (not every barrier: a superblock or checkpoint write
        // is one too) are where write-back groups end.
        let epoch_ended = rig.engine().stats().epochs_sealed != epochs_before
            || matches!(op, Op::ReopenClean)
            || degraded;
        for &(offset, len) in &touched {
            for b in offset / BS..(offset + len).div_ceil(BS) {
                block_crcs[b as usize] = crc(model.block(b));
            }
        }
        // The op's writes belong to the epoch after the last epoch end
        // before them: the current one, or, if the op ended an epoch before
        // its writes (an internal flush for space), the state before the
        // op. A FUA write's epoch end comes after its write: both allowed.
        let mut writes_epochs = vec![cur_epoch];
        if epoch_ended {
            epochs
                .entry(h_pre)
                .or_insert_with(|| Epoch::new(&pre_block_crcs));
            writes_epochs.push(h_pre);
        }
        for key in writes_epochs {
            if let Some(epoch) = epochs.get_mut(&key) {
                for &(offset, len) in &touched {
                    for b in offset / BS..(offset + len).div_ceil(BS) {
                        epoch.next[b as usize].push(block_crcs[b as usize]);
                    }
                }
            }
        }
        if epoch_ended {
            // Where the next epoch starts: a write-back-mode write, zero or
            // discard ends epochs (for space) only before its own blocks go
            // in, so its epoch continues; anything else ends with one.
            let through_now = rig.engine().mode() != cairn_engine::CacheMode::WriteBack || degraded;
            let barrier_before_only = !through_now
                && matches!(
                    op,
                    Op::Write { fua: false, .. } | Op::Discard { .. } | Op::Zero { .. }
                );
            cur_epoch = if barrier_before_only {
                h_pre
            } else {
                crc(&model.image)
            };
            epochs
                .entry(cur_epoch)
                .or_insert_with(|| Epoch::new(&block_crcs));
        }
        let events = journal.since(cursor);
        cursor += events.len();
        let expect = Expect {
            durable_model: &durable_model,
            allowed: &allowed,
            volume_blocks,
            integrity,
        };
        for (k, ev) in events.iter().enumerate() {
            match ev {
                JournalEvent::Write {
                    device: 0,
                    offset,
                    data,
                } => cache_shadow.write(*offset, data),
                JournalEvent::Flush { device: 0 } => cache_shadow.flush(),
                JournalEvent::Write { offset, data, .. } => {
                    // An origin write in flight: the origin may crash here
                    // with any subset of its unflushed writes.
                    origin_shadow.write(*offset, data);
                    let flushed = crc(&origin_shadow.durable[..origin_bytes]);
                    let ctx = format!(
                        "seed {seed} op #{i} {op:?} origin event {k}; {}",
                        repro("crash", seed)
                    );
                    if let Some(epoch) = epochs.get(&flushed) {
                        check_origin_crash_states(
                            &ctx,
                            &origin_shadow,
                            epoch,
                            origin_bytes,
                            &mut rng,
                        );
                    }
                    if k % 4 == 0 {
                        // Both crash here: the cache recovers over an
                        // origin that kept some of those writes, torn.
                        let cache_img = build_crash_image(
                            &cache_shadow.durable,
                            &cache_shadow.pending,
                            CrashPlan::KeepAll,
                            &mut rng,
                        );
                        // Degraded, the origin is the only copy: a write
                        // in flight may tear there as on any disk, so only
                        // whole writes are kept or dropped then.
                        let tear = if cut_origin_flushes { 0.0 } else { 0.3 };
                        let origin_img = build_crash_image(
                            &origin_shadow.durable,
                            &origin_shadow.pending,
                            CrashPlan::Random { keep: 0.5, tear },
                            &mut rng,
                        );
                        check_state(&ctx, cache_img, origin_img, &expect, false);
                        ORIGIN_STATES.fetch_add(1, Ordering::Relaxed);
                    }
                    continue;
                }
                JournalEvent::Flush { .. } => {
                    origin_shadow.flush();
                    if !cut_origin_flushes {
                        continue;
                    }
                }
            }
            CUTS.fetch_add(1, Ordering::Relaxed);
            let ctx = |plan: &str| {
                format!(
                    "seed {seed} op #{i} {op:?} event {k} plan {plan}; {}",
                    repro("crash", seed)
                )
            };
            // The origin on its own (the cache died here) is the volume as
            // of some past flush.
            let origin_now = &origin_shadow.durable[..origin_bytes];
            let past_flush = flush_states.contains(&crc(origin_now));
            // While degrading: every block as acknowledged before this op,
            // or as this op wrote it (it is re-run once degraded).
            let acknowledged_plus_part_of_op = degrading_op
                && pre_image.as_ref().is_some_and(|pre| {
                    (0..volume_blocks as usize).all(|b| {
                        let r = b * BS as usize..(b + 1) * BS as usize;
                        origin_now[r.clone()] == pre[r.clone()]
                            || origin_now[r.clone()] == model.image[r]
                    })
                });
            assert!(
                past_flush || acknowledged_plus_part_of_op,
                "{}: origin is not the volume as of any past flush",
                ctx("origin")
            );
            check_cut(
                &ctx,
                &cache_shadow,
                &origin_shadow.durable,
                &expect,
                random_states_per_cut,
                k % 3 == 0,
                &mut rng,
            );
        }
        // Outside write-back, writes and zeroes are durable on return.
        // Degraded, everything acknowledged is durable on the origin.
        let through = rig.engine().mode() != cairn_engine::CacheMode::WriteBack || degraded;
        let completes_flush = matches!(
            op,
            Op::Flush
                | Op::Drain
                | Op::Checkpoint
                | Op::ReopenClean
                | Op::SetMode(_)
                | Op::Write { fua: true, .. }
        ) || (through
            && matches!(op, Op::Write { .. } | Op::Zero { .. } | Op::Discard { .. }));
        if completes_flush {
            durable_model.copy_from_slice(&model.image);
            for a in allowed.iter_mut() {
                a.clear();
            }
        }
        if degrading_op {
            DEGRADING_CUTS.fetch_add(events.len() as u64, Ordering::Relaxed);
        }
    }
    if keep_log_full {
        FULL_LOG_STALLS.fetch_add(rig.engine().stats().writeback_stalls, Ordering::Relaxed);
    }
    if degrade_at.is_some() {
        assert!(
            rig.engine().is_degraded(),
            "seed {seed}: the workload never went degraded; the test checks nothing"
        );
    }
}

/// Crash images are multi-megabyte buffers allocated and freed thousands of
/// times; keep them on the heap instead of fresh mmaps (page faults would
/// dominate the run).
fn keep_big_allocations_on_heap() {
    // SAFETY: mallopt only adjusts glibc allocator tunables.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

fn run_seeds(seeds: &[u64]) {
    keep_big_allocations_on_heap();
    for &seed in seeds {
        run_seed(seed, 400, 128, 6, None, false, cache_bytes_small());
    }
}

/// The log fails for good part way through each workload: cut at every
/// cache write and barrier and every origin flush from there on, through
/// the retries, the drain, the two DEGRADED superblock copies and the
/// writes through to the origin. Every crash state recovers to a volume
/// holding each block's last durably acknowledged value or a later one,
/// and never an older one (no resurrection).
#[test]
fn crash_states_through_the_switch_to_degraded() {
    keep_big_allocations_on_heap();
    let before = STATES.load(Ordering::Relaxed);
    let seeds = seeds(24);
    for &seed in &seeds {
        let op = 60 + (seed as usize * 53) % 240;
        run_seed(
            seed,
            400,
            128,
            4,
            Some(DegradeAt { op }),
            false,
            cache_bytes_small(),
        );
    }
    report!(
        "crash harness through degraded mode: {} seeds, {} cut points inside the switch, {} crash states recovered and verified, 0 violations",
        seeds.len(),
        DEGRADING_CUTS.load(Ordering::Relaxed),
        STATES.load(Ordering::Relaxed) - before
    );
}

/// A volume four times the log and writes across all of it, with no
/// write-back but what writers run for space: the log stays full of live
/// dirty data, so eviction, space reclaim, write-back for space and the
/// persisted write-back position are all cut.
#[test]
fn crash_states_with_the_log_full_of_dirty_data() {
    keep_big_allocations_on_heap();
    let before = STATES.load(Ordering::Relaxed);
    let seeds = seeds(10);
    for &seed in &seeds {
        run_seed(seed, 300, 2048, 2, None, true, cache_bytes_small());
    }
    let stalls = FULL_LOG_STALLS.load(Ordering::Relaxed);
    report!(
        "crash harness with the log full of dirty data: {} seeds, {} crash states recovered and verified, {} writes that waited for write-back to free space, 0 violations",
        seeds.len(),
        STATES.load(Ordering::Relaxed) - before,
        stalls
    );
    assert!(
        stalls > 0,
        "the log never filled: the test checks nothing new"
    );
}

/// A cache large enough for records of up to 1 MiB (`FEATURE_LARGE_RECORDS`),
/// with the log kept full of dirty data so records fill to their 252 blocks
/// and the log wraps: torn and reordered large records, and eviction and
/// write-back around them, at every cut.
#[test]
fn crash_states_with_large_records() {
    keep_big_allocations_on_heap();
    let before = STATES.load(Ordering::Relaxed);
    let stalls_before = FULL_LOG_STALLS.load(Ordering::Relaxed);
    // The cache these seeds run on really has large records.
    let probe = cairn_device::SimDevice::new("cache", cache_bytes_large_records());
    let formatted = cairn_engine::Engine::format(
        std::sync::Arc::new(probe),
        std::sync::Arc::new(cairn_device::SimDevice::new("origin", 8192 * BS)),
        &cairn_engine::FormatOptions::default(),
    )
    .expect("format");
    assert_ne!(formatted.features & cairn_format::FEATURE_LARGE_RECORDS, 0);
    // Four times the log, as above, and enough ops to fill it.
    let seeds = seeds(4);
    for &seed in &seeds {
        run_seed(seed, 700, 8192, 2, None, true, cache_bytes_large_records());
    }
    report!(
        "crash harness with large records: {} seeds, {} crash states recovered and verified, 0 violations",
        seeds.len(),
        STATES.load(Ordering::Relaxed) - before,
    );
    assert!(
        FULL_LOG_STALLS.load(Ordering::Relaxed) > stalls_before,
        "the log never filled: the test checks nothing new"
    );
}

// Two tests so the harness uses both cores.
#[test]
fn crash_states_odd_seeds() {
    let seeds: Vec<u64> = seeds(160)
        .into_iter()
        .filter(|s| s % 2 == 1 || std::env::var("CAIRN_SEED").is_ok())
        .collect();
    run_seeds(&seeds);
    DONE.fetch_add(1, Ordering::Relaxed);
}

#[test]
fn crash_states_even_seeds() {
    if std::env::var("CAIRN_SEED").is_ok() {
        return;
    }
    let even: Vec<u64> = seeds(160).into_iter().filter(|s| s % 2 == 0).collect();
    run_seeds(&even);
    // Wait for the other half so the total is printed once, complete.
    for _ in 0..6000 {
        if DONE.load(Ordering::Relaxed) >= 1 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    report!(
        "crash harness: {} seeds, {} cut points, {} crash states recovered and verified ({} of them with origin integrity tags checked, {} origin crash states), 0 violations",
        seeds(160).len(),
        CUTS.load(Ordering::Relaxed),
        STATES.load(Ordering::Relaxed),
        TAG_STATES.load(Ordering::Relaxed),
        ORIGIN_STATES.load(Ordering::Relaxed)
    );
    if std::env::var("CAIRN_SEED").is_err() && std::env::var("CAIRN_SEEDS").is_err() {
        let states = STATES.load(Ordering::Relaxed);
        assert!(
            states >= 100_000,
            "the crash harness must check at least 100,000 states, checked {states}"
        );
    }
}
