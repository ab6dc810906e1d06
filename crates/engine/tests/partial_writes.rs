//! A write of part of a block that is not cached needs the rest of the
//! block from the origin. That read runs without the engine lock, as a
//! miss does: other requests go on while the origin answers (under the
//! lock, 512-byte writes over a 5 ms origin made 230 IOPS and stalled every
//! other connection's writes and flushes). The price is a race: the block
//! may be written while the read is out, and merging into the older data
//! would lose that write. The origin here holds a read inside the device
//! until the test lets it go, so each case happens every time.

mod common;
use common::gated_origin::{GatedOrigin, Hold};
use common::*;

use std::sync::Arc;
use std::time::Duration;

use cairn_device::{Device, SimDevice};
use cairn_engine::{CacheMode, Engine, FormatOptions};

const VOLUME_BLOCKS: u64 = 256;
const SECTOR: usize = 512;

fn engine_over(origin: &Arc<GatedOrigin>) -> Arc<Engine> {
    let cache = SimDevice::new("cache", cache_bytes_small());
    Engine::format(
        Arc::new(cache.clone()),
        origin.clone(),
        &FormatOptions::default(),
    )
    .expect("format");
    Arc::new(Engine::open(Arc::new(cache), origin.clone(), &open_opts()).expect("open"))
}

/// `base` with `part` at byte `at`.
fn merged(base: &[u8], at: usize, part: &[u8]) -> Vec<u8> {
    let mut block = base.to_vec();
    block[at..at + part.len()].copy_from_slice(part);
    block
}

#[test]
fn other_requests_go_on_while_a_partial_write_reads_the_origin() {
    let lba = 9u64;
    let old = pattern(1, BS as usize);
    let inner = SimDevice::new("origin", VOLUME_BLOCKS * BS);
    inner.write_at(lba * BS, &old).expect("seed the origin");
    let origin = Arc::new(GatedOrigin::new(inner.clone(), Hold::ReadBefore));
    let engine = engine_over(&origin);
    // A cached block for the read below.
    engine
        .write(50 * BS, &pattern(5, BS as usize), false)
        .unwrap();

    let part = pattern(2, SECTOR);
    origin.gate.arm(Some(lba * BS));
    let writer = {
        let engine = engine.clone();
        let part = part.clone();
        std::thread::spawn(move || engine.write(lba * BS + SECTOR as u64, &part, false))
    };
    origin
        .gate
        .wait_entered(Duration::from_secs(100), "the partial write's origin read");
    // The origin holds that read; writes, a flush and a cached read on
    // other blocks finish meanwhile.
    let others = {
        let engine = engine.clone();
        finishes_within(Duration::from_secs(20), move || {
            engine.write(60 * BS, &pattern(6, BS as usize), false)?;
            engine.flush()?;
            let mut buf = vec![0u8; BS as usize];
            engine.read(50 * BS, &mut buf)?;
            Ok::<_, cairn_engine::EngineError>(buf)
        })
    };
    let held = origin.gate.is_entered();
    origin.gate.release();
    writer.join().expect("writer").expect("the partial write");
    assert!(held, "the partial write's read was held meanwhile");
    let buf = others
        .expect("other requests waited for the partial write's origin read")
        .expect("other requests");
    assert!(buf == pattern(5, BS as usize), "the cached read");

    let mut block = vec![0u8; BS as usize];
    engine.read(lba * BS, &mut block).unwrap();
    assert!(
        block == merged(&old, SECTOR, &part),
        "the partial write merged into the origin's block"
    );
    assert_eq!(engine.stats().write_rmw_unlocked_reads, 1);
    engine.close().expect("close");
}

/// The block is written (and, in write-around, sent to the origin and left
/// uncached) while the partial write's origin read holds its old contents:
/// the merge must be into the newer write, not the read's old data.
#[test]
fn a_partial_write_never_merges_into_data_older_than_an_acknowledged_write() {
    for mode in [CacheMode::WriteAround, CacheMode::WriteBack] {
        let lba = 21u64;
        let old = pattern(10, BS as usize);
        let new = pattern(11, BS as usize);
        let part = pattern(12, SECTOR);
        let inner = SimDevice::new("origin", VOLUME_BLOCKS * BS);
        inner.write_at(lba * BS, &old).expect("seed the origin");
        let origin = Arc::new(GatedOrigin::new(inner.clone(), Hold::ReadAfter));
        let engine = engine_over(&origin);
        engine.set_mode(mode, |_| {}).expect("mode");

        origin.gate.arm(Some(lba * BS));
        let writer = {
            let engine = engine.clone();
            let part = part.clone();
            std::thread::spawn(move || engine.write(lba * BS + 3 * SECTOR as u64, &part, false))
        };
        origin
            .gate
            .wait_entered(Duration::from_secs(100), "the partial write's origin read");
        // The read holds the old block; a whole-block write is
        // acknowledged now.
        let whole = {
            let engine = engine.clone();
            let new = new.clone();
            finishes_within(Duration::from_secs(20), move || {
                engine.write(lba * BS, &new, false)
            })
        };
        origin.gate.release();
        whole
            .expect("the whole-block write waited for the partial write's origin read")
            .expect("whole-block write");
        writer.join().expect("writer").expect("the partial write");

        // The two writes overlapped, so either order is allowed: the
        // partial one over the new block, or the new block alone. Never
        // the partial write over the old block.
        let mut block = vec![0u8; BS as usize];
        engine.read(lba * BS, &mut block).unwrap();
        let over_new = merged(&new, 3 * SECTOR, &part);
        assert!(
            block == over_new || block == new,
            "{mode:?}: the block holds {}",
            if block == merged(&old, 3 * SECTOR, &part) {
                "the partial write merged into the old data: the whole-block write is lost"
            } else {
                "something else"
            }
        );
        engine.drain().expect("drain");
        engine.close().expect("close");
        let mut on_origin = vec![0u8; BS as usize];
        inner.read_at(lba * BS, &mut on_origin).unwrap();
        assert!(
            on_origin == block,
            "{mode:?}: the origin holds what reads return"
        );
    }
}

/// A zero of a range that starts and ends inside blocks (WRITE_ZEROES from
/// a client, as a task): its partial edges read the origin without the
/// lock too, and land merged; the whole blocks between read as zeroes.
#[test]
fn an_unaligned_zero_reads_its_edges_without_the_lock() {
    let lba = 30u64;
    let head = pattern(20, BS as usize);
    let tail = pattern(21, BS as usize);
    let inner = SimDevice::new("origin", VOLUME_BLOCKS * BS);
    inner.write_at(lba * BS, &head).expect("seed");
    inner
        .write_at((lba + 1) * BS, &pattern(22, BS as usize))
        .expect("seed");
    inner.write_at((lba + 2) * BS, &tail).expect("seed");
    let origin = Arc::new(GatedOrigin::new(inner.clone(), Hold::ReadBefore));
    let engine = engine_over(&origin);

    // From byte 1024 of block 30 to byte 512 of block 32.
    let (at, len) = (lba * BS + 1024, 2 * BS - 512);
    origin.gate.arm(Some(lba * BS));
    let zeroer = {
        let engine = engine.clone();
        std::thread::spawn(move || cairn_io::block_on(engine.write_zeroes_async_in(0, at, len)))
    };
    origin
        .gate
        .wait_entered(Duration::from_secs(100), "the zero's origin read");
    let other = {
        let engine = engine.clone();
        finishes_within(Duration::from_secs(20), move || {
            engine.write(60 * BS, &pattern(6, BS as usize), false)?;
            engine.flush()
        })
    };
    origin.gate.release();
    zeroer.join().expect("zeroer").expect("the zero");
    other
        .expect("a write and a flush waited for the zero's origin read")
        .expect("a write and a flush");

    let mut buf = vec![0u8; 3 * BS as usize];
    engine.read(lba * BS, &mut buf).unwrap();
    let zeroes = vec![0u8; BS as usize];
    assert!(buf[..BS as usize] == merged(&head, 1024, &zeroes[..BS as usize - 1024]));
    assert!(
        buf[BS as usize..2 * BS as usize] == zeroes[..],
        "the whole block"
    );
    assert!(buf[2 * BS as usize..] == merged(&tail, 0, &zeroes[..512]));
    engine.drain().expect("drain");
    engine.close().expect("close");
    let mut on_origin = vec![0u8; 3 * BS as usize];
    inner.read_at(lba * BS, &mut on_origin).unwrap();
    assert!(on_origin == buf, "the origin holds what reads return");
}

/// An engine over `origin` (every block patterned) and a small cache; the
/// volume's contents as `origin` holds them.
fn engine_over_patterned(origin: &SimDevice) -> (Engine, SimDevice, Vec<u8>) {
    let mut image = Vec::with_capacity((VOLUME_BLOCKS * BS) as usize);
    for lba in 0..VOLUME_BLOCKS {
        image.extend_from_slice(&pattern(1000 + lba, BS as usize));
    }
    origin.write_at(0, &image).expect("seed the origin");
    let cache = SimDevice::new("cache", cache_bytes_small());
    Engine::format(
        Arc::new(cache.clone()),
        Arc::new(origin.clone()),
        &FormatOptions::default(),
    )
    .expect("format");
    let engine = open(&cache, origin).expect("open");
    (engine, cache, image)
}

/// The client read counters: requests, bytes and blocks by source.
fn client_reads(s: &cairn_engine::StatsSnapshot) -> [u64; 5] {
    [
        s.reads,
        s.read_bytes,
        s.read_hits,
        s.read_misses,
        s.read_zero_hits,
    ]
}

/// A client that only writes, in part, never reads: the old contents of
/// the blocks it covers in part are counted as the writes' own
/// (`write_rmw_*`, by where they came from), never as client reads, so
/// the hit ratio stays the clients' (it was moved by every base found in
/// memory or a zeroed range). Every path: as a task (read without the
/// lock), an unaligned WRITE_ZEROES as a task and blocking (read under
/// the lock), over a block in memory or on a slot, inside a zeroed range.
#[test]
fn partial_writes_are_not_counted_as_client_reads() {
    let origin = SimDevice::new("origin", VOLUME_BLOCKS * BS);
    let (engine, _cache, mut model) = engine_over_patterned(&origin);
    let mut write = |at: u64, data: &[u8]| {
        model[at as usize..at as usize + data.len()].copy_from_slice(data);
        at
    };
    let part = pattern(7, SECTOR);
    // Block 10, not cached: its old contents from the origin, read as a
    // task without the lock.
    let at = write(10 * BS + SECTOR as u64, &part);
    cairn_io::block_on(engine.write_async(at, &part, false)).expect("partial write");
    // From byte 1024 of block 20 to byte 512 of block 22, as a task: two
    // edge blocks read without the lock.
    let zeroes = vec![0u8; 2 * BS as usize];
    let (at, len) = (20 * BS + 1024, 2 * BS - 512);
    write(at, &zeroes[..len as usize]);
    cairn_io::block_on(engine.write_zeroes_async_in(0, at, len)).expect("zero as a task");
    // The same over blocks 30..=32, blocking: the edges read under the
    // lock; block 31 becomes a zeroed range.
    let at = write(30 * BS + 1024, &zeroes[..len as usize]);
    engine.write_zeroes(at, len).expect("blocking zero");
    let origin_reads = 5;
    // Block 10 again: cached now (in memory or, after the flush, a slot).
    let at = write(10 * BS + 3 * SECTOR as u64, &part);
    engine.write(at, &part, false).expect("over a cached block");
    engine.flush().expect("flush");
    let at = write(10 * BS, &part);
    engine
        .write(at, &part, false)
        .expect("over a flushed block");
    // Inside the zeroed range of block 31.
    let at = write(31 * BS + 100, &part);
    engine
        .write(at, &part, false)
        .expect("inside a zeroed range");

    let s = engine.stats();
    assert_eq!(
        client_reads(&s),
        [0; 5],
        "partial writes moved the client read counters (reads, read_bytes, read_hits, read_misses, read_zero_hits)"
    );
    assert_eq!(
        (
            s.write_rmw,
            s.write_rmw_hits,
            s.write_rmw_zero_hits,
            s.write_rmw_origin_reads,
            s.write_rmw_unlocked_reads,
        ),
        (8, 2, 1, origin_reads, 3),
        "write_rmw, then its bases: hits, zero hits, origin reads (of them without the lock)"
    );
    let mut volume = vec![0u8; (VOLUME_BLOCKS * BS) as usize];
    engine.read(0, &mut volume).expect("read the volume");
    assert!(volume == model, "every partial write merged into its block");
    engine.close().expect("close");
}

/// Degraded (the cache takes no writes), a partial write patches its edge
/// blocks through the read path: those reads are the write's too.
#[test]
fn degraded_partial_writes_are_not_counted_as_client_reads() {
    let origin = SimDevice::new("origin", VOLUME_BLOCKS * BS);
    let (engine, cache, mut model) = engine_over_patterned(&origin);
    // The log area stops taking writes: the next barrier degrades.
    let layout = cairn_format::Layout::compute(cache.size_bytes(), BS as u32).expect("layout");
    cache.fail_range(cairn_device::RangeFault {
        kinds: cairn_device::OpKinds::WRITES,
        start: layout.log_offset_bytes(),
        end: cache.size_bytes(),
        mode: cairn_device::FaultMode::Sticky,
    });
    let whole = pattern(8, BS as usize);
    model[..BS as usize].copy_from_slice(&whole);
    engine
        .write(0, &whole, true)
        .expect("the FUA write goes through");
    assert!(engine.is_degraded(), "the cache degraded");
    let before = engine.stats();

    let part = pattern(9, SECTOR);
    let at = 40 * BS + 100;
    model[at as usize..at as usize + SECTOR].copy_from_slice(&part);
    engine
        .write(at, &part, false)
        .expect("degraded partial write");
    let (at, len) = (50 * BS + 1024, 2 * BS - 512);
    model[at as usize..(at + len) as usize].fill(0);
    engine
        .write_zeroes(at, len)
        .expect("degraded unaligned zero");

    let s = engine.stats();
    assert_eq!(
        client_reads(&s),
        client_reads(&before),
        "degraded partial writes moved the client read counters (reads, read_bytes, read_hits, read_misses, read_zero_hits)"
    );
    assert_eq!(
        (
            s.write_rmw - before.write_rmw,
            s.write_rmw_origin_reads - before.write_rmw_origin_reads,
        ),
        (3, 3),
        "write_rmw and write_rmw_origin_reads: one edge block, then two"
    );
    let mut on_origin = vec![0u8; (VOLUME_BLOCKS * BS) as usize];
    origin.read_at(0, &mut on_origin).expect("read the origin");
    assert!(on_origin == model, "the origin holds every degraded write");
    engine.close().expect("close");
}
