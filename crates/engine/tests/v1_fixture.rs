//! A cache written by format version 1, kept in the tree as a fixture
//! (`tests/fixtures/v1/`, gzip-compressed images of the cache and its
//! origin), so that every later format is tested against a cache made by
//! the code of its time, not by its own encoders (issue 16: a v1 cache
//! opens, upgraded in place or refused with the command that upgrades it).
//!
//! The images are a crash state (only what was durable) of [`history`]:
//! clean, dirty and overwritten blocks, a group written back and one not, a
//! pending discard, stored settings, origin integrity tags, a checkpoint,
//! and records after it that only replay recovers. `write_v1_fixture`
//! wrote them once, with format version 1; it is kept to show how, and
//! refuses to run under any other version.
//!
//! Today's build opens such a cache by upgrading it in place to format 2
//! (a volume table in the gap v1 left; see `upgrade.rs`): the upgrade is
//! checked here, and cut at every device write.

mod common;
use common::*;

use cairn_device::{Device, Journal, JournalEvent, SimDevice};
use cairn_engine::{Engine, Inspection, StoredSettings, VolumeState};
use cairn_format::{Layout, Superblock, FORMAT_VERSION, FORMAT_VERSION_V1, SUPERBLOCK_OFFSETS};
use common::crash_check::Shadow;
use rand::SeedableRng;
use std::io::{Read, Write};
use std::path::PathBuf;

const FIXTURE_VERSION: u32 = 1;
const VOLUME_BLOCKS: u64 = 512;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1")
}

/// A block that compresses well and names its address and version.
fn block(lba: u64, version: u64) -> Vec<u8> {
    let mut unit = [0u8; 16];
    unit[..8].copy_from_slice(&lba.to_le_bytes());
    unit[8..].copy_from_slice(&version.to_le_bytes());
    unit.repeat(BS as usize / 16)
}

fn blocks(range: std::ops::Range<u64>, version: u64) -> Vec<u8> {
    range.flat_map(|lba| block(lba, version)).collect()
}

/// The settings `history` stores.
fn stored_settings() -> StoredSettings {
    StoredSettings {
        sequential_cutoff_bytes: Some(1 << 20),
        promote_after_misses: Some(2),
        ..StoredSettings::default()
    }
}

/// What the fixture's cache went through, applied to `engine` (when
/// writing it) and to `model` (to know what it must read back). Only what
/// was flushed is in the model: the images are a crash state.
fn history(engine: Option<&Engine>, model: &mut Model) {
    let e = engine;
    let write = |model: &mut Model, lba: u64, data: &[u8]| {
        if let Some(e) = e {
            e.write(lba * BS, data, false).expect("write");
        }
        model.write(lba * BS, data);
    };
    // Clean: written, flushed, written back.
    write(model, 0, &blocks(0..128, 1));
    if let Some(e) = e {
        e.flush().expect("flush");
        while e.writeback_step().expect("write-back").blocks_written > 0 {}
    }
    // Dirty, over half of those and past them; then a discard pending.
    write(model, 64, &blocks(64..192, 2));
    if let Some(e) = e {
        e.discard(200 * BS, 16 * BS).expect("discard");
        e.store_settings(stored_settings()).expect("settings");
        e.checkpoint().expect("checkpoint");
    }
    model.discard(200 * BS, 16 * BS);
    // After the checkpoint, flushed: only replay recovers these.
    write(model, 300, &blocks(300..340, 3));
    write(model, 100, &blocks(100..104, 4));
    if let Some(e) = e {
        e.flush().expect("flush");
        // Never flushed: not in the crash state, not in the model.
        e.write(400 * BS, &blocks(400..402, 5), false)
            .expect("write");
    }
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    z.write_all(bytes).expect("compressing into memory");
    z.finish().expect("compressing into memory")
}

fn gunzip(path: &std::path::Path) -> Vec<u8> {
    let file =
        std::fs::File::open(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut bytes)
        .unwrap_or_else(|e| panic!("decompressing {}: {e}", path.display()));
    bytes
}

#[test]
#[ignore = "wrote tests/fixtures/v1 once, with format version 1"]
fn write_v1_fixture() {
    assert_eq!(
        FORMAT_VERSION_V1, FIXTURE_VERSION,
        "the v1 fixture is written by format version 1 only"
    );
    assert_eq!(
        FORMAT_VERSION, FIXTURE_VERSION,
        "the v1 fixture is written by format version 1 only"
    );
    let cache_bytes = Layout::cache_bytes_min(BS as u32) + 256 * BS;
    let rig = Rig::with_integrity(cache_bytes, VOLUME_BLOCKS);
    let mut model = Model::new(VOLUME_BLOCKS);
    history(Some(rig.engine()), &mut model);
    let s = rig.engine().stats();
    assert!(s.dirty_blocks > 0 && s.clean_blocks > 0 && s.pending_ranges > 0);
    std::fs::create_dir_all(fixture_dir()).expect("creating the fixture directory");
    for (name, image) in [
        ("cache.img.gz", rig.cache.durable_image()),
        ("origin.img.gz", rig.origin.durable_image()),
    ] {
        std::fs::write(fixture_dir().join(name), gzip(&image)).expect("writing the fixture");
    }
}

fn fixture_devices() -> (SimDevice, SimDevice) {
    let cache = SimDevice::from_image("cache", gunzip(&fixture_dir().join("cache.img.gz")));
    let origin = SimDevice::from_image("origin", gunzip(&fixture_dir().join("origin.img.gz")));
    (cache, origin)
}

/// The format version stamped in each superblock copy of `image`.
fn superblock_versions(image: &[u8]) -> [u32; 2] {
    SUPERBLOCK_OFFSETS.map(|at| {
        let at = at as usize + 8;
        u32::from_le_bytes(image[at..at + 4].try_into().unwrap())
    })
}

/// Today's build opens the v1 cache, upgrading it in place to format 2,
/// and serves everything it held.
#[test]
fn a_v1_cache_opens_with_everything_it_held() {
    let (cache, origin) = fixture_devices();
    let image = cache.live_image();
    assert_eq!(
        superblock_versions(&image),
        [FIXTURE_VERSION; 2],
        "the fixture is a v1 cache"
    );
    let v1 = Engine::read_superblock(&cache).expect("the v1 superblock");
    assert_eq!(v1.version(), FORMAT_VERSION_V1);
    // The v2 volume table goes in the gap v1 never writes (between the
    // superblock copies and the metadata area; see docs/design.md).
    let gap = 2 * cairn_format::SUPERBLOCK_BYTES..cairn_format::METADATA_AREA_OFFSET as usize;
    assert!(
        image[gap].iter().all(|&b| b == 0),
        "v1 wrote into bytes 8 KiB..64 KiB"
    );
    let mut model = Model::new(VOLUME_BLOCKS);
    history(None, &mut model);
    let origin_before = origin.live_image();
    let engine = open(&cache, &origin).expect("the v1 cache opens");
    assert!(engine.integrity(), "integrity tags were on");
    assert_eq!(engine.stored_settings(), stored_settings());
    // Upgraded: both superblock copies are format 2 (no v1 copy is left
    // for an older build to fall back to), and the table's only volume is
    // the v1 origin under the empty name.
    assert_eq!(
        superblock_versions(&cache.durable_image()),
        [FORMAT_VERSION; 2]
    );
    let table = Engine::read_volume_table(&cache).expect("the volume table");
    assert_eq!(table.sequence, 1);
    let [volume] = table.volumes() else {
        panic!("one volume: {table:?}")
    };
    let v1_origin = match &v1.volumes {
        cairn_format::SuperblockVolumes::V1(o) => o.clone(),
        other => panic!("a v1 superblock: {other:?}"),
    };
    assert_eq!(
        (volume.id, volume.state, volume.name.as_str()),
        (0, VolumeState::Active, "")
    );
    assert_eq!(volume.origin_identity, v1_origin.origin_identity);
    assert_eq!(volume.origin_identity, origin.identity());
    assert_eq!(volume.origin_size_bytes, VOLUME_BLOCKS * BS);
    assert_eq!((volume.mode, volume.integrity), (0, true));
    assert_eq!(volume.settings, stored_settings());
    let v2 = engine.superblock();
    assert_eq!(v2.uuid, v1.uuid, "the same cache");
    assert_eq!(v2.generation, v1.generation + 1, "opened once more");
    let s = engine.stats();
    assert!(s.dirty_blocks > 0, "dirty data survives: {s:?}");
    assert!(s.pending_ranges > 0, "the discard is still pending: {s:?}");
    let vol = read_volume(&engine).expect("reading the volume");
    assert!(vol == model.image, "the volume differs from what v1 held");
    assert!(
        origin.live_image() == origin_before,
        "opening and reading wrote nothing to the origin"
    );
    engine.drain().expect("drain");
    engine.close().expect("close");
    assert!(
        origin.live_image() == model.image,
        "the drained origin equals the volume"
    );
    let engine = open(&cache, &origin).expect("reopens");
    let vol = read_volume(&engine).expect("reading the volume again");
    assert!(vol == model.image, "the volume after a drain and a reopen");
}

/// The upgrade and the open around it, cut after every write and every
/// flush of the cache: each crash state (unflushed writes dropped, kept,
/// or a random torn and reordered subset) is a valid format 1 or format 2
/// cache, and opens with everything the fixture held. Both kinds occur.
/// A v1 cache inspected (offline `status`) is read as the v2 cache its
/// upgrade would make, without the upgrade: nothing is written, it stays
/// v1, and its figures are those the real open (which upgrades) recovers.
#[test]
fn a_v1_cache_is_inspected_without_being_upgraded() {
    let (cache, origin) = fixture_devices();
    let before = cache.durable_image();
    cache.reset_counters();
    let seen = Inspection::open(std::sync::Arc::new(cache.clone()) as std::sync::Arc<dyn Device>)
        .expect("the v1 cache is inspected");
    assert_eq!(cache.counters().writes, 0, "{:?}", cache.counters());
    assert_eq!(cache.counters().flushes, 0, "{:?}", cache.counters());
    assert_eq!(cache.durable_image(), before);
    assert_eq!(
        superblock_versions(&cache.live_image()),
        [FORMAT_VERSION_V1; 2]
    );
    let inspected = seen.stats();
    assert!(inspected.dirty_blocks > 0, "{inspected:?}");
    assert_eq!(seen.stored_settings(), stored_settings());
    let opened = open(&cache, &origin).expect("the v1 cache opens");
    let real = opened.stats();
    assert_eq!(real.dirty_blocks, inspected.dirty_blocks);
    assert_eq!(real.clean_blocks, inspected.clean_blocks);
    assert_eq!(real.pending_ranges, inspected.pending_ranges);
    assert_eq!(opened.volumes_status(), seen.volumes_status());
}

#[test]
fn an_upgrade_cut_at_any_write_leaves_a_v1_or_a_v2_cache_with_all_its_data() {
    let (cache, origin) = fixture_devices();
    let before = cache.durable_image();
    let journal = Journal::default();
    cache.attach_journal(&journal, 0);
    let engine = open(&cache, &origin).expect("the v1 cache opens");
    drop(engine);
    let events = journal.since(0);
    assert!(events.len() >= 6, "the upgrade wrote: {events:?}");
    // The first superblock write goes to the copy of the older v1
    // superblock, with the next sequence: the newest v1 copy stays intact
    // until a v2 copy is durable (a torn write then leaves it in charge).
    let v1_sequence = Superblock::decode(&before[..cairn_format::SUPERBLOCK_BYTES])
        .into_iter()
        .chain(Superblock::decode(
            &before[SUPERBLOCK_OFFSETS[1] as usize..],
        ))
        .map(|sb| sb.sequence)
        .max()
        .expect("a v1 superblock");
    let first_superblock = events
        .iter()
        .find_map(|e| match e {
            JournalEvent::Write { offset, data, .. } if SUPERBLOCK_OFFSETS.contains(offset) => {
                Some((
                    *offset,
                    Superblock::decode(data).expect("a whole superblock"),
                ))
            }
            _ => None,
        })
        .expect("the upgrade wrote a superblock");
    assert_eq!(first_superblock.1.sequence, v1_sequence + 1);
    assert_eq!(
        first_superblock.0,
        SUPERBLOCK_OFFSETS[Superblock::copy_index(v1_sequence + 1)],
        "the newest v1 copy is not the one overwritten first"
    );
    let mut model = Model::new(VOLUME_BLOCKS);
    history(None, &mut model);
    let origin_image = origin.durable_image();
    let mut shadow = Shadow {
        durable: before,
        pending: Vec::new(),
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(16);
    let (mut states, mut v1_states, mut v2_states) = (0u64, 0u64, 0u64);
    for (cut, event) in events.iter().enumerate() {
        shadow.apply(event);
        for (plan, image) in shadow.crash_images(6, &mut rng) {
            let crashed = SimDevice::from_image("cache", image);
            let ctx = format!("cut {cut} of {} ({plan:?})", events.len());
            let version = Engine::read_superblock(&crashed)
                .unwrap_or_else(|e| panic!("{ctx}: no valid superblock: {e}"))
                .version();
            match version {
                FORMAT_VERSION_V1 => v1_states += 1,
                FORMAT_VERSION => v2_states += 1,
                other => panic!("{ctx}: superblock version {other}"),
            }
            let origin = SimDevice::from_image("origin", origin_image.clone());
            let engine = open(&crashed, &origin).unwrap_or_else(|e| panic!("{ctx}: {e}"));
            assert_eq!(engine.stored_settings(), stored_settings(), "{ctx}");
            let vol = read_volume(&engine).unwrap_or_else(|e| panic!("{ctx}: reading: {e}"));
            assert!(
                vol == model.image,
                "{ctx}: the volume differs from what v1 held"
            );
            assert_eq!(
                superblock_versions(&crashed.durable_image()),
                [FORMAT_VERSION; 2],
                "{ctx}: opening finishes the upgrade"
            );
            states += 1;
        }
    }
    eprintln!(
        "upgrade: {} cut points, {states} crash states opened and verified ({v1_states} still format 1, {v2_states} format 2)",
        events.len()
    );
    assert!(
        v1_states > 0 && v2_states > 0,
        "both sides of the upgrade were cut"
    );
}

/// A superblock that names a volume table which is not on the device (a
/// table write lost, a device copied without its first 64 KiB) is refused
/// with a message naming the table, never opened without its volumes.
#[test]
fn a_superblock_naming_a_missing_volume_table_is_refused() {
    let (cache, origin) = fixture_devices();
    drop(open(&cache, &origin).expect("the v1 cache opens"));
    let sb: Superblock = Engine::read_superblock(&cache).expect("superblock");
    let (sequence, _) = sb.volume_table().expect("format 2");
    let copy = cairn_format::VolumeTable::copy_for(sequence);
    cache
        .write_at(
            cairn_format::VOLUME_TABLE_OFFSETS[copy],
            &vec![0u8; cairn_format::VOLUME_TABLE_COPY_BYTES],
        )
        .expect("write");
    cache.flush().expect("flush");
    match open(&cache, &origin) {
        Err(cairn_engine::EngineError::SuperblockInvalid { detail, .. }) => {
            assert!(detail.contains("volume table"), "{detail}")
        }
        Err(other) => panic!("expected SuperblockInvalid, got {other}"),
        Ok(_) => panic!("opened without its volume table"),
    }
}
