//! Concurrent callers: writer threads on disjoint regions, readers checking
//! what they read is one of the values ever written there, a flusher and a
//! background write-back thread, all at once. At the end every block holds
//! its last written value, on the volume and, after a drain, on the origin.

mod common;
use common::*;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[test]
fn concurrent_writers_readers_flush_and_writeback() {
    run_concurrent(None);
}

/// The same load while the cache's log stops taking writes part way: every
/// request still succeeds (the engine goes degraded under load), and the
/// final volume and origin hold every last write.
#[test]
fn concurrent_requests_while_the_cache_goes_degraded() {
    run_concurrent(Some(5000));
}

fn run_concurrent(fail_log_after_writes: Option<u64>) {
    const THREADS: u64 = 4;
    const BLOCKS_PER_THREAD: u64 = 96;
    let volume_blocks = THREADS * BLOCKS_PER_THREAD;
    let rig = Rig::new(cache_bytes_small(), volume_blocks);
    let engine = Arc::new(rig.engine.expect("engine"));
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for t in 0..THREADS {
        let e = engine.clone();
        handles.push(std::thread::spawn(move || {
            let mut last = vec![0u64; BLOCKS_PER_THREAD as usize];
            for i in 0..3000u64 {
                let k = (i * 7919 + t) % BLOCKS_PER_THREAD;
                let lba = t * BLOCKS_PER_THREAD + k;
                let version = i + 1;
                let mut data = pattern(lba * 1_000_000 + version, BS as usize);
                data[..8].copy_from_slice(&version.to_le_bytes());
                e.write(lba * BS, &data, i % 97 == 0).expect("write");
                last[k as usize] = version;
                if i % 5 == 0 {
                    // Read back our own block: must be what we just wrote.
                    let mut buf = vec![0u8; BS as usize];
                    e.read(lba * BS, &mut buf).expect("read");
                    assert_eq!(buf, data, "thread {t} lba {lba} read its own write");
                }
            }
            last
        }));
    }
    let bg = {
        let e = engine.clone();
        let stop = stop.clone();
        let cache = rig.cache.clone();
        std::thread::spawn(move || {
            let mut steps = 0u64;
            let mut injected = false;
            while !stop.load(Ordering::Relaxed) {
                if !injected && fail_log_after_writes.is_some_and(|w| e.stats().writes >= w) {
                    injected = true;
                    let layout =
                        cairn_format::Layout::compute(cache_bytes_small(), BS as u32).unwrap();
                    cache.fail_range(cairn_device::RangeFault {
                        kinds: cairn_device::OpKinds::WRITES,
                        start: layout.log_offset_bytes(),
                        end: cache_bytes_small(),
                        mode: cairn_device::FaultMode::Sticky,
                    });
                }
                e.flush().expect("flush");
                e.writeback_step().expect("writeback");
                steps += 1;
            }
            steps
        })
    };
    let lasts: Vec<Vec<u64>> = handles
        .into_iter()
        .map(|h| h.join().expect("writer"))
        .collect();
    stop.store(true, Ordering::Relaxed);
    let steps = bg.join().expect("background");
    let mut expected = vec![0u8; (volume_blocks * BS) as usize];
    for (t, last) in lasts.iter().enumerate() {
        for (k, &version) in last.iter().enumerate() {
            let lba = t as u64 * BLOCKS_PER_THREAD + k as u64;
            if version == 0 {
                continue;
            }
            let mut data = pattern(lba * 1_000_000 + version, BS as usize);
            data[..8].copy_from_slice(&version.to_le_bytes());
            expected[(lba * BS) as usize..((lba + 1) * BS) as usize].copy_from_slice(&data);
        }
    }
    let vol = read_volume(&engine).expect("read volume");
    assert!(vol == expected, "volume differs after concurrent run");
    engine.drain().expect("drain");
    assert!(
        rig.origin.live_image() == expected,
        "origin differs after drain"
    );
    let s = engine.stats();
    if fail_log_after_writes.is_some() {
        assert!(s.degraded && !s.failed, "{s:?}");
        assert!(
            rig.origin.durable_image() == expected,
            "origin misses acknowledged writes"
        );
    } else {
        assert!(!s.degraded);
    }
    report!(
        "concurrency{}: {THREADS} writers x 3000 writes, {steps} flush+write-back steps, {} blocks written back, {} writes through a degraded cache, 0 divergences",
        if s.degraded { " (degraded part way)" } else { "" },
        s.writeback_blocks,
        s.degraded_writes
    );
}
