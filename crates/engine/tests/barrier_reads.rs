//! Reads never wait for someone else's barrier: a flush whose fdatasync
//! hangs in the cache device (held here until the test lets it go) must
//! not hold up a read of cached data, a read miss, or another write. The
//! barrier is made outside the engine lock; were it made under it, the
//! reads below would wait for the release and the watchdog would fire.

mod common;
use common::flush_gated::FlushGated;
use common::*;

use std::sync::Arc;
use std::time::Duration;

use cairn_device::SimDevice;

/// Far longer than any of these requests takes, far shorter than forever.
const WATCHDOG: Duration = Duration::from_secs(20);

/// Run `f` on its own thread; fail if it does not finish within the
/// watchdog (it would be waiting for the held barrier).
fn within_watchdog<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    finishes_within(WATCHDOG, f)
        .unwrap_or_else(|| panic!("{what} waited for another client's barrier"))
}

#[test]
fn reads_and_writes_go_on_while_a_flush_waits_for_its_barrier() {
    let volume_blocks = 256;
    // A cache whose next barrier (flush) waits at a gate.
    let cache = Arc::new(FlushGated::new(SimDevice::new(
        "cache",
        cache_bytes_small(),
    )));
    let origin = SimDevice::new("origin", volume_blocks * BS);
    let engine = format_and_open(cache.clone(), &origin);
    let cached = pattern(1, BS as usize);
    engine.write(0, &cached, false).expect("write");
    engine.flush().expect("flush");

    // A second client's write and flush; its barrier hangs.
    engine
        .write(BS, &pattern(2, BS as usize), false)
        .expect("write");
    cache.gate.arm(None);
    let flusher = {
        let e = engine.clone();
        std::thread::spawn(move || e.flush())
    };
    cache.gate.wait_entered(WATCHDOG, "the flush");

    let e = engine.clone();
    let got = within_watchdog("a read of a cached block", move || {
        let mut buf = vec![0u8; BS as usize];
        e.read(0, &mut buf).expect("read");
        buf
    });
    assert_eq!(got, cached);
    let e = engine.clone();
    let got = within_watchdog("a read miss", move || {
        let mut buf = vec![1u8; BS as usize];
        e.read(200 * BS, &mut buf).expect("read miss");
        buf
    });
    assert_eq!(
        got,
        vec![0u8; BS as usize],
        "an unwritten block reads as zeroes"
    );
    let e = engine.clone();
    within_watchdog("another client's write", move || {
        e.write(3 * BS, &pattern(3, BS as usize), false)
            .expect("write")
    });
    // The flush itself is not answered before its barrier completes.
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !flusher.is_finished(),
        "the flush was answered before its barrier"
    );

    cache.gate.release();
    flusher.join().expect("flusher").expect("flush");
    report!("while a flush's barrier was held: a cached read, a read miss and a write all completed; the flush was answered only after the barrier");
}
