//! What the crash tests share: a shadow of a simulated device rebuilt
//! event by event from its journal, and the check of one crash state
//! (recover, read every block, compare with what was acknowledged).

use std::sync::atomic::{AtomicU64, Ordering};

use cairn_device::{build_crash_image, CrashPlan, JournalEvent, PendingWrite, SimDevice};
use rand_chacha::ChaCha8Rng;

use super::{open, read_volume, BS};

pub struct Shadow {
    pub durable: Vec<u8>,
    pub pending: Vec<PendingWrite>,
}

impl Shadow {
    pub fn of(dev: &SimDevice) -> Shadow {
        Shadow {
            durable: dev.durable_image(),
            pending: dev.pending_writes(),
        }
    }
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        self.pending.push(PendingWrite {
            offset,
            data: data.to_vec(),
        });
    }
    /// Replay one journaled event on this shadow (its device's).
    pub fn apply(&mut self, event: &JournalEvent) {
        match event {
            JournalEvent::Write { offset, data, .. } => self.write(*offset, data),
            JournalEvent::Flush { .. } => self.flush(),
        }
    }

    /// The crash images of this cut: every unflushed write dropped, kept,
    /// and torn (only its first sector lands: two copies of one structure
    /// in flight at once are both lost), and `random` random subsets (each
    /// write kept with probability 0.5, torn with 0.3, in shuffled order).
    /// With nothing unflushed, the one image there is.
    pub fn crash_images(&self, random: usize, rng: &mut ChaCha8Rng) -> Vec<(CrashPlan, Vec<u8>)> {
        let mut plans = vec![CrashPlan::DropAll];
        if !self.pending.is_empty() {
            plans.extend([CrashPlan::KeepAll, CrashPlan::TearAll]);
            plans.extend(std::iter::repeat_n(
                CrashPlan::Random {
                    keep: 0.5,
                    tear: 0.3,
                },
                random,
            ));
        }
        plans
            .into_iter()
            .map(|plan| {
                (
                    plan,
                    build_crash_image(&self.durable, &self.pending, plan, rng),
                )
            })
            .collect()
    }

    pub fn flush(&mut self) {
        for w in self.pending.drain(..) {
            self.durable[w.offset as usize..w.offset as usize + w.data.len()]
                .copy_from_slice(&w.data);
        }
    }
}

/// The device a journaled event happened on.
pub fn event_device(event: &JournalEvent) -> usize {
    match event {
        JournalEvent::Write { device, .. } | JournalEvent::Flush { device } => *device as usize,
    }
}

pub fn crc(b: &[u8]) -> u32 {
    cairn_format::crc32c(b)
}

/// Crash states recovered and verified by this test binary.
pub static STATES: AtomicU64 = AtomicU64::new(0);

pub struct Expect<'a> {
    pub durable_model: &'a [u8],
    pub allowed: &'a [Vec<u32>],
    pub volume_blocks: u64,
    pub integrity: bool,
}

pub static TAG_STATES: AtomicU64 = AtomicU64::new(0);

/// With integrity on: no origin block outside the dirty set disagrees with
/// its tag, and nothing was served unverified.
pub fn check_tags(ctx: &str, engine: &cairn_engine::Engine, stage: &str) {
    if engine.is_degraded() {
        // A degraded cache keeps no tags: nothing to check.
        return;
    }
    let report = engine
        .scrub_origin(&cairn_engine::ScrubOptions::default(), |_, _| {})
        .unwrap_or_else(|e| panic!("{ctx}: scrub {stage}: {e}"));
    assert!(
        report.mismatches.is_empty(),
        "{ctx}: {stage}: clean origin blocks {:?} do not match their tags",
        report.mismatches
    );
    assert_eq!(
        report.blocks_accounted(),
        report.blocks_checked,
        "{ctx}: {stage}: a checked block is in no category: {report:?}"
    );
    assert_eq!(
        report.blocks_unverified, 0,
        "{ctx}: {stage}: blocks without a tag outside the recalculation window"
    );
    let s = engine.stats();
    assert_eq!(
        s.origin_mismatches, 0,
        "{ctx}: {stage}: reads saw mismatches"
    );
    assert_eq!(
        s.origin_unverified_reads, 0,
        "{ctx}: {stage}: unverified origin reads"
    );
}

pub fn check_state(
    ctx: &str,
    cache_img: Vec<u8>,
    origin_img: Vec<u8>,
    expect: &Expect<'_>,
    deep: bool,
) {
    let cache = SimDevice::from_image("cache", cache_img);
    let origin = SimDevice::from_image("origin", origin_img);
    let engine = open(&cache, &origin).unwrap_or_else(|e| panic!("{ctx}: recovery refused: {e}"));
    let vol = read_volume(&engine).unwrap_or_else(|e| panic!("{ctx}: read after recovery: {e}"));
    if expect.integrity {
        check_tags(ctx, &engine, "after recovery");
        TAG_STATES.fetch_add(1, Ordering::Relaxed);
    }
    for b in 0..expect.volume_blocks as usize {
        let got = &vol[b * BS as usize..(b + 1) * BS as usize];
        let c = crc(got);
        let durable = &expect.durable_model[b * BS as usize..(b + 1) * BS as usize];
        if c != crc(durable) && !expect.allowed[b].contains(&c) {
            panic!(
                "{ctx}: block {b} holds neither its durable value nor a later-written one (first bytes {:02x?}, durable {:02x?})",
                &got[..8],
                &durable[..8]
            );
        }
    }
    if deep {
        // Recovery is deterministic and idempotent: recovering the image
        // the first recovery left gives the same volume.
        drop(engine);
        let again = SimDevice::from_image("cache", cache.live_image());
        let engine =
            open(&again, &origin).unwrap_or_else(|e| panic!("{ctx}: second recovery: {e}"));
        let vol2 = read_volume(&engine).expect("read after second recovery");
        assert!(vol2 == vol, "{ctx}: second recovery differs from the first");
        // And write-back after recovery makes the origin equal the volume.
        engine
            .drain()
            .unwrap_or_else(|e| panic!("{ctx}: drain after recovery: {e}"));
        assert!(
            origin.live_image() == vol,
            "{ctx}: origin differs from volume after drain"
        );
        if expect.integrity {
            check_tags(ctx, &engine, "after drain");
        }
    }
    STATES.fetch_add(1, Ordering::Relaxed);
}

/// Check the crash states of one cut: every unflushed cache write dropped;
/// if there are any, all kept and `random_states` random subsets (torn,
/// reordered). The first two are checked deeply when `deep_cut`.
pub fn check_cut(
    ctx: &dyn Fn(&str) -> String,
    cache: &Shadow,
    origin_durable: &[u8],
    expect: &Expect<'_>,
    random_states: usize,
    deep_cut: bool,
    rng: &mut ChaCha8Rng,
) {
    let mut plans = vec![("drop-all", CrashPlan::DropAll)];
    if !cache.pending.is_empty() {
        plans.push(("keep-all", CrashPlan::KeepAll));
        for _ in 0..random_states {
            plans.push((
                "random",
                CrashPlan::Random {
                    keep: 0.5,
                    tear: 0.3,
                },
            ));
        }
    }
    for (p, (name, plan)) in plans.into_iter().enumerate() {
        let img = build_crash_image(&cache.durable, &cache.pending, plan, rng);
        check_state(
            &ctx(name),
            img,
            origin_durable.to_vec(),
            expect,
            deep_cut && p < 2,
        );
    }
}
