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

mod common;
use common::*;

use cairn_device::SimDevice;
use cairn_engine::{Engine, StoredSettings};
use cairn_format::{Layout, FORMAT_VERSION, SUPERBLOCK_OFFSETS};
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

/// Today's format opens the v1 cache and serves everything it held (this
/// test changes with the format: a v2 reads it after an upgrade).
#[test]
fn a_v1_cache_opens_with_everything_it_held() {
    let (cache, origin) = fixture_devices();
    let image = cache.live_image();
    let version_at = SUPERBLOCK_OFFSETS[0] as usize + 8;
    let version = u32::from_le_bytes(image[version_at..version_at + 4].try_into().unwrap());
    assert_eq!(version, FIXTURE_VERSION, "the fixture is a v1 cache");
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
