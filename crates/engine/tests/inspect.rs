//! `Inspection::open`: a cache looked at without its origin and without a
//! write. Its figures must be the ones a real open recovers (the dirty
//! blocks of a log that needs replay above all), and the cache device
//! must see reads only.

mod common;
use common::*;

use std::sync::Arc;

use cairn_device::{Device, SimDevice};
use cairn_engine::Inspection;

const VOLUME_BLOCKS: u64 = 1024;

/// A crash state: blocks written and flushed (durable), more written after
/// the last flush with FUA, no checkpoint since format; so recovery must
/// replay the log to find any of them.
fn crashed_rig() -> (SimDevice, SimDevice) {
    let rig = Rig::new(cache_bytes_small() * 4, VOLUME_BLOCKS);
    let e = rig.engine();
    e.write(0, &pattern(1, 64 * BS as usize), false)
        .expect("write");
    e.flush().expect("flush");
    e.write(200 * BS, &pattern(2, 8 * BS as usize), true)
        .expect("write fua");
    // No close: the engine is dropped as a kill -9 would leave it.
    let cache = SimDevice::from_image("cache", rig.cache.durable_image());
    let origin = SimDevice::from_image("origin", rig.origin.durable_image());
    (cache, origin)
}

#[test]
fn inspect_recovers_what_open_recovers_and_writes_nothing() {
    let (cache, origin) = crashed_rig();
    let before = cache.durable_image();
    cache.reset_counters();
    let seen = Inspection::open(Arc::new(cache.clone()) as Arc<dyn Device>).expect("inspect");
    let counters = cache.counters();
    assert_eq!(counters.writes, 0, "inspect wrote: {counters:?}");
    assert_eq!(counters.flushes, 0, "inspect flushed: {counters:?}");
    assert_eq!(counters.discards, 0, "inspect discarded: {counters:?}");
    assert!(counters.reads > 0, "inspect read nothing: {counters:?}");
    assert_eq!(cache.durable_image(), before);
    assert_eq!(cache.live_image(), before);
    let stats = seen.stats();
    assert_eq!(stats.dirty_blocks, 64 + 8, "{stats:?}");
    assert_eq!(seen.volume().origin_size_bytes, VOLUME_BLOCKS * BS);
    let volumes = seen.volumes_status();
    assert_eq!(volumes.len(), 1);
    assert_eq!(volumes[0].dirty_blocks, 64 + 8);
    // Twice gives the same (nothing was consumed or moved).
    let again = Inspection::open(Arc::new(cache.clone()) as Arc<dyn Device>).expect("inspect");
    assert_eq!(again.stats().dirty_blocks, stats.dirty_blocks);
    assert_eq!(again.superblock(), seen.superblock());

    // The real open recovers the same figures.
    let opened = open(&cache, &origin).expect("open");
    let real = opened.stats();
    assert_eq!(real.dirty_blocks, stats.dirty_blocks);
    assert_eq!(real.clean_blocks, stats.clean_blocks);
    assert_eq!(real.free_blocks, stats.free_blocks);
    assert_eq!(real.head_offset, stats.head_offset);
    assert_eq!(real.writeback_offset, stats.writeback_offset);
    assert_eq!(opened.volumes_status(), volumes);
}

/// No origin is needed: one that fails every I/O (unreachable) changes
/// nothing, since inspect never opens it.
#[test]
fn inspect_needs_no_origin() {
    let (cache, origin) = crashed_rig();
    origin.fail_at(0, cairn_device::FaultMode::Sticky);
    origin.reset_counters();
    let seen = Inspection::open(Arc::new(cache.clone()) as Arc<dyn Device>).expect("inspect");
    assert_eq!(seen.stats().dirty_blocks, 64 + 8);
    assert_eq!(origin.counters().ops, 0);
}

/// What inspect refuses, it refuses as open does: a blank device is not a
/// cairn cache.
#[test]
fn inspect_of_a_blank_device_is_refused_like_open() {
    let blank = SimDevice::new("blank", cache_bytes_small());
    let err = match Inspection::open(Arc::new(blank.clone()) as Arc<dyn Device>) {
        Ok(_) => panic!("a blank device inspected"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("not a cairn cache"), "{err}");
    assert_eq!(blank.counters().writes, 0);
}
