//! A cache claims its origin from format until its volume is removed, and
//! refuses an origin another cache claimed: after a crash, a shared
//! origin's lock passes to the next client, and the first cache's replay
//! would roll back what a second one wrote there. The origin here keeps a
//! claim as an RBD image does (SimDevice::keep_claims).

mod common;
use common::*;

use std::sync::Arc;

use cairn_device::{Device, DeviceError, SimDevice};
use cairn_engine::{CacheMode, Engine, EngineError, FormatOptions, NewVolume, OpenOptions};

const ORIGIN_BLOCKS: u64 = 64;

fn claimed_origin(name: &str) -> SimDevice {
    let origin = SimDevice::new(name, ORIGIN_BLOCKS * BS);
    origin.keep_claims();
    origin
}

fn format(cache: &SimDevice, origin: &SimDevice, force: bool) -> Result<(), EngineError> {
    Engine::format(
        Arc::new(cache.clone()),
        Arc::new(origin.clone()),
        &FormatOptions {
            force,
            ..FormatOptions::default()
        },
    )
    .map(|_| ())
}

fn open_forced(cache: &SimDevice, origin: &SimDevice) -> Result<Engine, EngineError> {
    Engine::open(
        Arc::new(cache.clone()) as Arc<dyn Device>,
        Arc::new(origin.clone()) as Arc<dyn Device>,
        &OpenOptions {
            force_origin: true,
            ..open_opts()
        },
    )
}

fn refused<T>(result: Result<T, EngineError>, what: &str) {
    match result {
        Err(EngineError::Origin(DeviceError::Claimed { .. })) => {}
        Err(e) => panic!("{what}: another error: {e:?}"),
        Ok(_) => panic!("{what}: accepted"),
    }
}

fn claim_uuid(origin: &SimDevice) -> String {
    let stored = origin.stored_claim().expect("a claim is stored");
    stored.split_whitespace().next().unwrap_or("").to_string()
}

#[test]
fn a_second_cache_never_takes_a_claimed_origin_and_a_released_one_is_not_rolled_back() {
    let origin = claimed_origin("origin");
    let cache_a = SimDevice::new("cache-a", cache_bytes_small());
    let cache_b = SimDevice::new("cache-b", cache_bytes_small());
    format(&cache_a, &origin, false).expect("format A");
    let a = claim_uuid(&origin);
    assert!(
        origin.stored_claim().unwrap().contains("cache=cache-a"),
        "the claim says where the cache is: {:?}",
        origin.stored_claim()
    );

    // B is refused, and its device is left as it was (nothing formatted).
    refused(format(&cache_b, &origin, false), "format B over A's origin");
    assert_eq!(claim_uuid(&origin), a);
    assert!(Engine::read_volume_table(&cache_b).is_err(), "B untouched");

    // A writes and "crashes" with dirty blocks that never reached the origin.
    let engine = open(&cache_a, &origin).expect("A opens its own origin");
    engine
        .write(0, &pattern(1, BS as usize), true)
        .expect("A writes");
    drop(engine);

    // The operator releases the image and B takes it and writes there.
    origin.set_stored_claim(None);
    let writes_before = origin.counters().writes;
    refused(open(&cache_a, &origin), "A over an unclaimed origin");
    assert_eq!(
        origin.counters().writes,
        writes_before,
        "a refused open replays nothing onto the origin"
    );
    format(&cache_b, &origin, false).expect("format B over the released origin");
    let b = claim_uuid(&origin);
    assert_ne!(a, b);
    let engine = open(&cache_b, &origin).expect("B opens");
    engine.write(0, &pattern(2, BS as usize), true).unwrap();
    engine.drain().expect("B drains");
    engine.close().expect("B closes");
    drop(engine);
    let writes_before = origin.counters().writes;
    let mut block = vec![0u8; BS as usize];
    origin.read_at(0, &mut block).unwrap();
    assert!(
        block == pattern(2, BS as usize),
        "B's write is on the origin"
    );

    // A comes back: refused, even when forced (another cache's claim), and
    // B's data stays.
    refused(open(&cache_a, &origin), "A over B's origin");
    refused(open_forced(&cache_a, &origin), "A forced over B's origin");
    assert_eq!(origin.counters().writes, writes_before);
    origin.read_at(0, &mut block).unwrap();
    assert!(block == pattern(2, BS as usize), "nothing rolled back");
    assert_eq!(claim_uuid(&origin), b);
}

#[test]
fn reformatting_a_cache_passes_its_claim_on_and_force_adopts_an_unclaimed_origin() {
    let origin = claimed_origin("origin");
    let cache = SimDevice::new("cache", cache_bytes_small());
    format(&cache, &origin, false).expect("format");
    let first = claim_uuid(&origin);
    // `format --force` over the same device: that cache's claim is its own
    // to give.
    format(&cache, &origin, true).expect("reformat over the claiming cache");
    let second = claim_uuid(&origin);
    assert_ne!(first, second, "the new cache holds the claim");
    // A cache formatted elsewhere cannot pass A's claim on by being forced
    // over another device.
    let other = SimDevice::new("other", cache_bytes_small());
    refused(
        format(&other, &origin, true),
        "forced format of another device",
    );

    // An origin that lost its claim opens only when forced, which claims it.
    origin.set_stored_claim(None);
    refused(open(&cache, &origin), "open over an unclaimed origin");
    let engine = open_forced(&cache, &origin).expect("--force adopts");
    assert_eq!(claim_uuid(&origin), second);
    drop(engine);
    open(&cache, &origin).expect("then it opens without force");
}

#[test]
fn an_added_volume_claims_its_origin_and_releases_it_when_removed() {
    let first = claimed_origin("first");
    let cache = SimDevice::new("cache", cache_bytes_small());
    format(&cache, &first, false).expect("format");
    let uuid = claim_uuid(&first);
    let engine = open(&cache, &first).expect("open");
    let volume = |name: &str| NewVolume {
        name: name.into(),
        mode: CacheMode::WriteBack,
        integrity: false,
        dirty_share_pct: None,
    };

    let taken = claimed_origin("taken");
    taken.set_stored_claim(Some("another-cache host=h".into()));
    refused(
        engine.add_volume(Arc::new(taken.clone()), &volume("taken")),
        "add over another cache's origin",
    );
    assert_eq!(engine.volume_table().volumes().len(), 1, "nothing added");

    let second = claimed_origin("second");
    engine
        .add_volume(Arc::new(second.clone()), &volume("second"))
        .expect("add");
    assert_eq!(claim_uuid(&second), uuid, "one cache, one uuid");
    engine
        .write_in(1, 0, &pattern(3, BS as usize), true)
        .unwrap();
    engine
        .remove_volume("second")
        .expect("remove drains and forgets");
    assert_eq!(second.stored_claim(), None, "released once removed");
    let mut block = vec![0u8; BS as usize];
    second.read_at(0, &mut block).unwrap();
    assert!(block == pattern(3, BS as usize), "drained before release");
    assert_eq!(claim_uuid(&first), uuid, "the first volume's claim stays");
}
