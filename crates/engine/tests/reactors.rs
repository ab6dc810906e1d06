//! The engine driven the way `cairn serve` drives it: several threads, each
//! running a reactor with many request tasks, over io_uring devices (so
//! cache and origin reads and record writes are ring operations), with a
//! cache small enough that writes keep sealing records, checkpointing and
//! waiting for write-back. Nothing may deadlock (a watchdog fails the test
//! instead of hanging), and every block reads back as last written.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use cairn_device::{open_local, Device, OpenMode};
use cairn_engine::{Engine, FormatOptions, OpenOptions};
use cairn_io::{Reactor, ReactorOptions};
use common::{config, pattern, BS};

const REACTORS: u64 = 4;
const TASKS_PER_REACTOR: u64 = 8;
const BLOCKS_PER_TASK: u64 = 24;
const OPS_PER_TASK: u64 = 400;
const WATCHDOG_S: u64 = 60;

fn device(path: &std::path::Path, size: u64) -> Arc<dyn Device> {
    let f = std::fs::File::create(path).expect("create");
    f.set_len(size).expect("size");
    drop(f);
    Arc::from(open_local(path, OpenMode::Exclusive).expect("open"))
}

/// One task's writes, reads, FUA writes and flushes over its own blocks;
/// returns the last version written of each.
async fn task(engine: Arc<Engine>, first: u64, seed: u64) -> Vec<u64> {
    let mut last = vec![0u64; BLOCKS_PER_TASK as usize];
    for i in 0..OPS_PER_TASK {
        let k = (i * 7 + seed) % BLOCKS_PER_TASK;
        let lba = first + k;
        match (i + seed) % 5 {
            0..=2 => {
                let version = i + 1;
                let mut data = pattern(lba * 1_000_000 + version, BS as usize);
                data[..8].copy_from_slice(&version.to_le_bytes());
                let fua = i % 13 == 0;
                engine
                    .write_async(lba * BS, &data, fua)
                    .await
                    .expect("write");
                last[k as usize] = version;
            }
            3 => {
                let data = engine
                    .read_async(lba * BS, BS as usize, false)
                    .await
                    .expect("read");
                let version = last[k as usize];
                if version > 0 {
                    let mut want = pattern(lba * 1_000_000 + version, BS as usize);
                    want[..8].copy_from_slice(&version.to_le_bytes());
                    assert!(data.as_bytes() == want, "lba {lba} read its own write");
                }
            }
            _ => engine.flush_async().await.expect("flush"),
        }
    }
    last
}

#[test]
fn many_reactors_on_ring_devices_neither_deadlock_nor_lose_writes() {
    run(0);
}

/// The same with the daemon's write-back request threads: writers waiting
/// for space wait for them as tasks instead of stepping themselves.
#[test]
fn many_reactors_waiting_for_space_as_tasks_neither_deadlock_nor_lose_writes() {
    run(2);
}

/// The workload, with `request_servers` threads serving the writers'
/// write-back steps (none: each writer runs its own).
fn run(request_servers: usize) {
    let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
    let volume_blocks = REACTORS * TASKS_PER_REACTOR * BLOCKS_PER_TASK;
    let cache_bytes = cairn_format::Layout::cache_bytes_min(BS as u32) + 64 * BS;
    let cache = device(&dir.path().join("cache"), cache_bytes);
    let origin = device(&dir.path().join("origin"), volume_blocks * BS);
    Engine::format(cache.clone(), origin.clone(), &FormatOptions::default()).expect("format");
    let engine = Arc::new(
        Engine::open(
            cache,
            origin,
            &OpenOptions {
                force_origin: false,
                config: config(),
            },
        )
        .expect("open"),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let writeback = {
        let (engine, stop) = (engine.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                engine.writeback_step().expect("write-back");
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let servers: Vec<_> = (0..request_servers)
        .map(|_| {
            let (engine, stop) = (engine.clone(), stop.clone());
            std::thread::spawn(move || engine.serve_writeback_requests(&stop))
        })
        .collect();
    while engine.writeback_request_servers() < request_servers {
        std::thread::sleep(Duration::from_millis(1));
    }
    let (done_tx, done_rx) = mpsc::channel();
    for r in 0..REACTORS {
        let (engine, done_tx) = (engine.clone(), done_tx.clone());
        std::thread::spawn(move || {
            let reactor = Reactor::new(&ReactorOptions::default()).expect("io_uring");
            let lasts = reactor.clone().run(async move {
                let handles: Vec<_> = (0..TASKS_PER_REACTOR)
                    .map(|t| {
                        let first = (r * TASKS_PER_REACTOR + t) * BLOCKS_PER_TASK;
                        reactor.spawn(task(engine.clone(), first, r * 31 + t))
                    })
                    .collect();
                let mut lasts = Vec::new();
                for h in handles {
                    lasts.push(h.await);
                }
                lasts
            });
            let _ = done_tx.send((r, lasts));
        });
    }
    drop(done_tx);
    let deadline = Instant::now() + Duration::from_secs(WATCHDOG_S);
    let mut expected = vec![0u64; volume_blocks as usize];
    for _ in 0..REACTORS {
        let left = deadline.saturating_duration_since(Instant::now());
        let (r, lasts) = done_rx
            .recv_timeout(left)
            .expect("the reactors finished in time (a deadlock otherwise)");
        for (t, last) in lasts.into_iter().enumerate() {
            let first = (r * TASKS_PER_REACTOR + t as u64) * BLOCKS_PER_TASK;
            for (k, v) in last.into_iter().enumerate() {
                expected[(first + k as u64) as usize] = v;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    writeback.join().expect("write-back thread");
    engine.wake_writeback_request_servers();
    for server in servers {
        server.join().expect("request server");
    }
    engine.flush().expect("flush");
    let stats = engine.stats();
    assert!(
        stats.checkpoints > 0 && stats.writeback_groups > 0 && stats.writeback_stalls > 0,
        "{stats:?}"
    );
    for (lba, &version) in expected.iter().enumerate() {
        let mut buf = vec![0u8; BS as usize];
        engine.read(lba as u64 * BS, &mut buf).expect("read back");
        if version > 0 {
            let mut want = pattern(lba as u64 * 1_000_000 + version, BS as usize);
            want[..8].copy_from_slice(&version.to_le_bytes());
            assert!(buf == want, "lba {lba}: lost its last write");
        }
    }
}
