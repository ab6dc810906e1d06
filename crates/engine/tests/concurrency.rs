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

/// A cache device whose writes take a while, so sealed records really are
/// in flight while other writers fill the next one and readers read them.
/// Counts how many writes were in flight at once.
struct SlowCache {
    inner: cairn_device::SimDevice,
    writing: std::sync::atomic::AtomicUsize,
    writing_max: std::sync::atomic::AtomicUsize,
}

impl SlowCache {
    fn slow<T>(&self, f: impl FnOnce() -> T) -> T {
        let now = self.writing.fetch_add(1, Ordering::SeqCst) + 1;
        self.writing_max.fetch_max(now, Ordering::SeqCst);
        std::thread::sleep(std::time::Duration::from_micros(300));
        let result = f();
        self.writing.fetch_sub(1, Ordering::SeqCst);
        result
    }
}

impl cairn_device::Device for SlowCache {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> cairn_device::DeviceResult<()> {
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> cairn_device::DeviceResult<()> {
        self.slow(|| self.inner.write_at(offset, buf))
    }
    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> cairn_device::DeviceResult<()> {
        self.slow(|| self.inner.write_vectored_at(offset, bufs))
    }
    fn write_vectored_and_flush(
        &self,
        offset: u64,
        bufs: &[&[u8]],
    ) -> cairn_device::DeviceResult<()> {
        self.slow(|| self.inner.write_vectored_and_flush(offset, bufs))
    }
    fn flush(&self) -> cairn_device::DeviceResult<()> {
        self.inner.flush()
    }
    /// Barriers overlap here as on a file: their syncs are slow too.
    fn flush_lanes(&self) -> usize {
        self.inner.flush_lanes()
    }
    fn flush_lane(&self, lane: usize) -> cairn_device::DeviceResult<()> {
        self.slow(|| self.inner.flush_lane(lane))
    }
    fn discard(&self, offset: u64, len: u64) -> cairn_device::DeviceResult<()> {
        self.inner.discard(offset, len)
    }
}

/// Several writers stream whole records while others read blocks of every
/// region (often blocks of records whose write is still in flight) and a
/// flusher ends epochs: every read returns a value that was written there
/// and not older than the reader's own last write, records are written
/// concurrently, and the volume and the origin end up exact.
#[test]
fn sealed_records_in_flight_are_read_from_memory_and_flushed_in_order() {
    const WRITERS: u64 = 4;
    const BLOCKS_PER_WRITER: u64 = 512;
    let volume_blocks = WRITERS * BLOCKS_PER_WRITER;
    let cache_bytes = cairn_format::Layout::cache_bytes_min(BS as u32) + 4096 * BS;
    let sim = cairn_device::SimDevice::new("cache", cache_bytes);
    let origin = cairn_device::SimDevice::new("origin", volume_blocks * BS);
    let cache = Arc::new(SlowCache {
        inner: sim.clone(),
        writing: Default::default(),
        writing_max: Default::default(),
    });
    let engine = format_and_open(cache.clone(), &origin);
    let mut handles = Vec::new();
    for t in 0..WRITERS {
        let e = engine.clone();
        handles.push(std::thread::spawn(move || {
            let mut last = vec![0u64; BLOCKS_PER_WRITER as usize];
            for round in 1..=6u64 {
                // 64 KiB writes: 16 blocks each, 4 per record.
                for chunk in 0..BLOCKS_PER_WRITER / 16 {
                    let first = t * BLOCKS_PER_WRITER + chunk * 16;
                    let mut data = Vec::with_capacity(16 * BS as usize);
                    for lba in first..first + 16 {
                        let mut block = pattern(lba * 1_000 + round, BS as usize);
                        block[..8].copy_from_slice(&round.to_le_bytes());
                        data.extend_from_slice(&block);
                    }
                    e.write(first * BS, &data, false).expect("write");
                    for k in chunk * 16..chunk * 16 + 16 {
                        last[k as usize] = round;
                    }
                    // Read back a block of what was just written: it may
                    // sit in a record whose write is in flight.
                    let lba = first + round % 16;
                    let mut buf = vec![0u8; BS as usize];
                    e.read(lba * BS, &mut buf).expect("read own");
                    let mut want = pattern(lba * 1_000 + round, BS as usize);
                    want[..8].copy_from_slice(&round.to_le_bytes());
                    assert!(
                        buf == want,
                        "writer {t} lba {lba} did not read its own write"
                    );
                }
            }
            last
        }));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let e = engine.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut reads = 0u64;
            let mut lba = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let mut buf = vec![0u8; BS as usize];
                e.read(lba * BS, &mut buf).expect("read");
                let round = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
                if round != 0 {
                    let mut want = pattern(lba * 1_000 + round, BS as usize);
                    want[..8].copy_from_slice(&round.to_le_bytes());
                    assert!(buf == want, "lba {lba} holds no value ever written there");
                }
                reads += 1;
                lba = (lba + 97) % volume_blocks;
                if reads.is_multiple_of(64) {
                    e.flush().expect("flush");
                }
            }
            reads
        })
    };
    let lasts: Vec<Vec<u64>> = handles
        .into_iter()
        .map(|h| h.join().expect("writer"))
        .collect();
    stop.store(true, Ordering::Relaxed);
    let reads = reader.join().expect("reader");
    let mut expected = vec![0u8; (volume_blocks * BS) as usize];
    for (t, last) in lasts.iter().enumerate() {
        for (k, &round) in last.iter().enumerate() {
            let lba = t as u64 * BLOCKS_PER_WRITER + k as u64;
            let mut block = pattern(lba * 1_000 + round, BS as usize);
            block[..8].copy_from_slice(&round.to_le_bytes());
            expected[(lba * BS) as usize..((lba + 1) * BS) as usize].copy_from_slice(&block);
        }
    }
    let vol = read_volume(&engine).expect("read volume");
    assert!(vol == expected, "volume differs after concurrent streams");
    engine.drain().expect("drain");
    assert!(
        origin.live_image() == expected,
        "origin differs after drain"
    );
    let writing_max = cache.writing_max.load(Ordering::SeqCst);
    report!(
        "sealed records in flight: {WRITERS} writers, {reads} concurrent reads, up to {writing_max} cache writes in flight, 0 divergences"
    );
    assert!(writing_max >= 2, "records were never written concurrently");
}
