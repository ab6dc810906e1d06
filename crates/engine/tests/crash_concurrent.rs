//! Crash states of concurrent requests: writer threads that flush and
//! write FUA on their own schedules (so several barriers are in flight at
//! once and complete out of order with sealing, group commit joining
//! some), a reader whose misses fill the cache while writes race them, and
//! background write-back. Every device event is journaled; after the run,
//! each cache event is a cut point and its crash states are recovered and
//! read.
//!
//! Each request notes a global clock (one atomic counter, ticked before it
//! starts and after it returns: that orders requests) and the journal's
//! length (which device events may belong to it), so every rule below errs
//! on the safe side:
//! - a write is durable at a cut if it returned before some flush (or FUA
//!   write) started that itself returned before the cut: the block then
//!   holds that write or a later one that started before the cut;
//! - a read returns a write that started before the read returned, and
//!   never one older than the last write that returned before it began;
//! - the origin alone holds, in each block, nothing but values written to
//!   that block before the cut (or its initial zeroes).
//!
//! Thread interleavings differ from run to run; a failure prints the seed,
//! the cut and the plan, and the seed fixes the workload, not the schedule.

mod common;
use common::crash_check::*;
use common::*;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cairn_device::{Journal, JournalEvent};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const WRITERS: u64 = 3;
const VOLUME_BLOCKS: u64 = 96;
const OPS_PER_WRITER: usize = 120;
const READS: usize = 150;

/// When a request ran: clock ticks before and after it, and the journal's
/// length before it started and after it returned.
#[derive(Clone, Copy, Debug)]
struct Span {
    start_tick: u64,
    end_tick: u64,
    start_len: usize,
    end_len: usize,
}

impl Span {
    fn run<T>(clock: &AtomicU64, journal: &Journal, f: impl FnOnce() -> T) -> (T, Span) {
        let start_len = journal.len();
        let start_tick = clock.fetch_add(1, Ordering::SeqCst);
        let out = f();
        let end_tick = clock.fetch_add(1, Ordering::SeqCst);
        let end_len = journal.len();
        (
            out,
            Span {
                start_tick,
                end_tick,
                start_len,
                end_len,
            },
        )
    }

    /// It returned before `other` started.
    fn before(&self, other: &Span) -> bool {
        self.end_tick < other.start_tick
    }
}

#[derive(Clone, Copy)]
struct WriteRec {
    block: u64,
    crc: u32,
    fua: bool,
    span: Span,
}

struct ReadRec {
    block: u64,
    crc: u32,
    span: Span,
}

struct Run {
    /// Per block, its writes in program order (one writer owns a block).
    writes: Vec<Vec<WriteRec>>,
    /// Flushes, and FUA writes (a write, then a flush).
    flushes: Vec<Span>,
    reads: Vec<ReadRec>,
}

fn data_for(seed: u64, block: u64, version: usize) -> Vec<u8> {
    pattern(
        seed.wrapping_mul(1_000_003) ^ (block << 20) ^ version as u64,
        BS as usize,
    )
}

fn run_workload(seed: u64, rig: &Rig, journal: &Journal) -> Run {
    let engine = rig.engine();
    let stop = AtomicBool::new(false);
    let clock = &AtomicU64::new(0);
    let (mut writes, mut flushes, reads) = std::thread::scope(|s| {
        let writers: Vec<_> = (0..WRITERS)
            .map(|t| {
                let stop = &stop;
                s.spawn(move || {
                    let _ = stop;
                    let mut rng = ChaCha8Rng::seed_from_u64(seed * 31 + t);
                    let mut writes = Vec::new();
                    let mut flushes = Vec::new();
                    let owned: Vec<u64> = (0..VOLUME_BLOCKS).filter(|b| b % WRITERS == t).collect();
                    for version in 0..OPS_PER_WRITER {
                        if rng.gen_ratio(1, 5) {
                            let ((), span) =
                                Span::run(clock, journal, || engine.flush().expect("flush"));
                            flushes.push(span);
                            continue;
                        }
                        let block = owned[rng.gen_range(0..owned.len())];
                        let fua = rng.gen_ratio(1, 10);
                        let data = data_for(seed, block, version);
                        let ((), span) = Span::run(clock, journal, || {
                            engine.write(block * BS, &data, fua).expect("write")
                        });
                        writes.push(WriteRec {
                            block,
                            crc: crc(&data),
                            fua,
                            span,
                        });
                        if fua {
                            flushes.push(span);
                        }
                    }
                    (writes, flushes)
                })
            })
            .collect();
        let reader = s.spawn(|| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
            let mut reads = Vec::new();
            let mut buf = vec![0u8; BS as usize];
            for _ in 0..READS {
                let block = rng.gen_range(0..VOLUME_BLOCKS);
                let ((), span) = Span::run(clock, journal, || {
                    engine.read(block * BS, &mut buf).expect("read")
                });
                reads.push(ReadRec {
                    block,
                    crc: crc(&buf),
                    span,
                });
            }
            reads
        });
        let writeback = s.spawn(|| {
            for _ in 0..100_000 {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                engine.writeback_step().expect("write-back");
                std::thread::yield_now();
            }
        });
        // Checkpoints (which persist the index, the write-back position and
        // the tag pages) at any moment, also between a group's origin
        // writes and its origin flush.
        let checkpointer = s.spawn(|| {
            for _ in 0..100_000 {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                engine.checkpoint().expect("checkpoint");
                std::thread::sleep(std::time::Duration::from_micros(300));
            }
        });
        let mut writes = Vec::new();
        let mut flushes = Vec::new();
        for w in writers {
            let (w, f) = w.join().expect("writer");
            writes.extend(w);
            flushes.extend(f);
        }
        let reads = reader.join().expect("reader");
        stop.store(true, Ordering::SeqCst);
        writeback.join().expect("write-back thread");
        checkpointer.join().expect("checkpoint thread");
        (writes, flushes, reads)
    });
    writes.sort_by_key(|w| w.span.start_tick);
    let mut per_block = vec![Vec::new(); VOLUME_BLOCKS as usize];
    for w in writes.drain(..) {
        per_block[w.block as usize].push(w);
    }
    // One writer per block: program order is start order.
    for list in &per_block {
        assert!(list.windows(2).all(|p| p[0].span.before(&p[1].span)));
    }
    Run {
        writes: per_block,
        flushes: std::mem::take(&mut flushes),
        reads,
    }
}

/// Every read returned a value the rules allow.
fn check_reads(seed: u64, run: &Run) {
    let zero = crc(&vec![0u8; BS as usize]);
    for r in &run.reads {
        let list = &run.writes[r.block as usize];
        // The newest write that returned before the read began, if any.
        let floor = list.iter().rposition(|w| w.span.before(&r.span));
        let mut allowed: Vec<u32> = Vec::new();
        if floor.is_none() {
            allowed.push(zero);
        }
        for w in &list[floor.unwrap_or(0)..] {
            if w.span.start_tick < r.span.end_tick {
                allowed.push(w.crc);
            }
        }
        assert!(
            allowed.contains(&r.crc),
            "seed {seed}: a read of block {} ({:?}) returned a value no rule allows: stale or never written",
            r.block,
            r.span
        );
    }
}

/// The durable floor of every block at a cut of `len` journal events, and
/// the later values it may hold.
fn expectation(run: &Run, len: usize) -> (Vec<u8>, Vec<Vec<u32>>) {
    // Flushes whose barrier is inside the cut (they returned by then): the
    // one that started last covers the most.
    let latest = run
        .flushes
        .iter()
        .filter(|f| f.end_len <= len)
        .max_by_key(|f| f.start_tick);
    let mut durable = vec![0u8; (VOLUME_BLOCKS * BS) as usize];
    let mut allowed = vec![Vec::new(); VOLUME_BLOCKS as usize];
    for (b, list) in run.writes.iter().enumerate() {
        let floor = list.iter().rposition(|w| {
            latest.is_some_and(|f| w.span.before(f)) || (w.fua && w.span.end_len <= len)
        });
        let from = match floor {
            Some(i) => {
                let w = list[i];
                let data = data_for_crc(run, b as u64, w.crc);
                durable[b * BS as usize..(b + 1) * BS as usize].copy_from_slice(&data);
                i + 1
            }
            None => 0,
        };
        for w in &list[from..] {
            if w.span.start_len < len {
                allowed[b].push(w.crc);
            }
        }
    }
    (durable, allowed)
}

/// The data of the write to `block` with checksum `crc` (rebuilt: the
/// writers' data is a function of seed, block and version).
fn data_for_crc(run: &Run, block: u64, crc_wanted: u32) -> Vec<u8> {
    let seed = SEED.with(|s| *s.borrow());
    let _ = run;
    for version in 0..OPS_PER_WRITER {
        let data = data_for(seed, block, version);
        if crc(&data) == crc_wanted {
            return data;
        }
    }
    panic!("no version of block {block} has checksum {crc_wanted:#x}");
}

thread_local! {
    static SEED: std::cell::RefCell<u64> = const { std::cell::RefCell::new(0) };
}

fn run_seed(seed: u64, random_states_per_cut: usize) -> (usize, u64) {
    SEED.with(|s| *s.borrow_mut() = seed);
    // Half the seeds keep origin integrity tags: recovered states must
    // then also agree with the tags (no tag persisted ahead of its data).
    let integrity = seed % 2 == 1;
    let rig = if integrity {
        Rig::with_integrity(
            cache_bytes_small() + 2 * 4096 * cairn_format::tag_pages_for(VOLUME_BLOCKS),
            VOLUME_BLOCKS,
        )
    } else {
        Rig::new(cache_bytes_small(), VOLUME_BLOCKS)
    };
    let journal = Journal::default();
    let mut cache_shadow = Shadow::of(&rig.cache);
    let mut origin_shadow = Shadow::of(&rig.origin);
    rig.cache.attach_journal(&journal, 0);
    rig.origin.attach_journal(&journal, 1);
    let run = run_workload(seed, &rig, &journal);
    check_reads(seed, &run);
    let events = journal.since(0);
    let zero = crc(&vec![0u8; BS as usize]);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let before = STATES.load(Ordering::Relaxed);
    let mut cuts = 0;
    for (k, ev) in events.iter().enumerate() {
        match ev {
            JournalEvent::Write {
                device: 0,
                offset,
                data,
            } => cache_shadow.write(*offset, data),
            JournalEvent::Flush { device: 0 } => cache_shadow.flush(),
            JournalEvent::Write { offset, data, .. } => {
                origin_shadow.write(*offset, data);
                continue;
            }
            JournalEvent::Flush { .. } => {
                origin_shadow.flush();
                continue;
            }
        }
        cuts += 1;
        let len = k + 1;
        let ctx = |plan: &str| {
            format!(
                "seed {seed} cut after event {k} of {} plan {plan}",
                events.len()
            )
        };
        // The origin alone: every block holds its initial zeroes or a value
        // written to it before the cut.
        for (b, list) in run.writes.iter().enumerate() {
            let got = crc(&origin_shadow.durable[b * BS as usize..(b + 1) * BS as usize]);
            assert!(
                got == zero || list.iter().any(|w| w.crc == got && w.span.start_len < len),
                "{}: origin block {b} holds a value never written there before the cut",
                ctx("origin")
            );
        }
        let (durable, allowed) = expectation(&run, len);
        let expect = Expect {
            durable_model: &durable,
            allowed: &allowed,
            volume_blocks: VOLUME_BLOCKS,
            integrity,
        };
        check_cut(
            &ctx,
            &cache_shadow,
            &origin_shadow.durable,
            &expect,
            random_states_per_cut,
            k % 5 == 0,
            &mut rng,
        );
    }
    (cuts, STATES.load(Ordering::Relaxed) - before)
}

#[test]
fn crash_states_of_concurrent_flushes_fua_misses_and_writeback() {
    let seeds = seeds(6);
    let mut cuts = 0;
    let mut states = 0;
    for &seed in &seeds {
        let (c, s) = run_seed(seed, 2);
        cuts += c;
        states += s;
    }
    report!(
        "concurrent crash harness: {} seeds, {} cut points, {} crash states recovered and verified, 0 violations",
        seeds.len(),
        cuts,
        states
    );
    assert!(cuts > 0 && states > 0, "the harness checked nothing");
}
