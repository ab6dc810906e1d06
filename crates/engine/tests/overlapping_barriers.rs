//! Barriers overlap when the cache device has several flush lanes: a
//! flush whose barrier is held in the device's sync does not hold up
//! another client's flush, which makes its own barrier through another
//! lane. That barrier waits for the held one's write, not its sync, and
//! its own sync covers both records: after a crash at that moment both
//! writes are there. With one lane the second flush waits for the first.

mod common;
use common::flush_gated::FlushGated;
use common::*;

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use cairn_device::{CrashPlan, Device, SimDevice};
use cairn_engine::{Engine, EngineResult, FormatOptions};

/// Far longer than any of these requests takes, far shorter than forever.
const WATCHDOG: Duration = Duration::from_secs(20);

struct Held {
    cache: Arc<FlushGated>,
    origin: SimDevice,
    engine: Arc<Engine>,
    /// The first client's flush, its barrier's sync held at the gate.
    first: JoinHandle<EngineResult<()>>,
}

/// A cache with `lanes` flush lanes; block 0 written and its flush's
/// barrier held in the device's sync.
fn first_flush_held(lanes: usize) -> Held {
    let cache = Arc::new(FlushGated::with_lanes(
        SimDevice::new("cache", cache_bytes_small()),
        lanes,
    ));
    let origin = SimDevice::new("origin", 256 * BS);
    Engine::format(
        cache.clone(),
        Arc::new(origin.clone()),
        &FormatOptions::default(),
    )
    .expect("format");
    let engine = Arc::new(
        Engine::open(cache.clone(), Arc::new(origin.clone()), &open_opts()).expect("open"),
    );
    engine
        .write(0, &pattern(1, BS as usize), false)
        .expect("write");
    cache.gate.arm(None);
    let first = {
        let e = engine.clone();
        std::thread::spawn(move || e.flush())
    };
    cache.gate.wait_entered(WATCHDOG, "the first flush");
    Held {
        cache,
        origin,
        engine,
        first,
    }
}

/// Another client's write and flush, on a thread of their own.
fn second_client(engine: &Arc<Engine>) -> JoinHandle<EngineResult<()>> {
    let e = engine.clone();
    std::thread::spawn(move || {
        e.write(BS, &pattern(2, BS as usize), false)?;
        e.flush()
    })
}

fn join_within(handle: JoinHandle<EngineResult<()>>, what: &str) {
    let done = finishes_within(WATCHDOG, move || handle.join());
    done.unwrap_or_else(|| panic!("{what} never finished"))
        .expect("the flushing thread")
        .unwrap_or_else(|e| panic!("{what}: {e}"));
}

#[test]
fn a_flush_does_not_wait_for_another_barriers_sync() {
    let held = first_flush_held(SimDevice::new("lanes", 4096).flush_lanes());
    assert!(held.cache.flush_lanes() > 1);
    join_within(
        second_client(&held.engine),
        "the second flush (it waited for the first one's sync)",
    );
    assert!(
        !held.first.is_finished(),
        "the first flush was answered before its own barrier ended"
    );
    assert_eq!(held.engine.stats().overlapped_barriers, 1);

    // A power cut now: the first barrier's sync never ran, but the second
    // barrier's sync came after the first one's write, so it covers both.
    let cache = held.cache.inner.crashed(CrashPlan::DropAll, 1);
    let origin = held.origin.crashed(CrashPlan::DropAll, 1);
    let reopened = open(&cache, &origin).expect("open after the crash");
    let volume = read_volume(&reopened).expect("read");
    assert_eq!(&volume[..BS as usize], &pattern(1, BS as usize)[..]);
    assert_eq!(
        &volume[BS as usize..2 * BS as usize],
        &pattern(2, BS as usize)[..]
    );
    drop(reopened);

    held.cache.gate.release();
    join_within(held.first, "the first flush");
    report!("with a barrier's sync held, another client's flush made its own barrier through another lane; a crash then kept both writes");
}

#[test]
fn with_one_flush_lane_barriers_do_not_overlap() {
    let held = first_flush_held(1);
    let second = second_client(&held.engine);
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !second.is_finished(),
        "a second barrier overlapped the first on a device with one flush lane"
    );
    held.cache.gate.release();
    join_within(held.first, "the first flush");
    join_within(second, "the second flush");
    assert_eq!(held.engine.stats().overlapped_barriers, 0);
    report!("with one flush lane, the second flush waited for the first barrier to end");
}
