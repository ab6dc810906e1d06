//! Write-back steps that writers on an event loop wait for as tasks
//! (`Engine::serve_writeback_requests`): a write-through write waiting for
//! its origin, and a writer waiting for space, leave their loop serving
//! its other requests; write-through writes in flight together share
//! epochs and steps; a step that fails answers every writer waiting for
//! it; writers still waiting when the request threads stop run their
//! steps themselves.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use cairn_device::{Device, DeviceResult, FaultMode, OpKinds, RangeFault, SimDevice};
use cairn_engine::{CacheMode, Engine, FormatOptions};
use cairn_io::{Reactor, ReactorOptions};
use common::gated_origin::{GatedOrigin, Hold};
use common::{cache_bytes_small, open_opts, pattern, BS};

/// How long a test waits for something that happens at once when the
/// code is right (and never when it is wrong).
const PATIENCE: Duration = Duration::from_secs(20);

/// An origin whose writes take `delay` each: a slow disk.
struct SlowOrigin {
    inner: SimDevice,
    delay: Duration,
}

impl Device for SlowOrigin {
    fn name(&self) -> &str {
        "slow-origin"
    }
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn identity(&self) -> String {
        self.inner.identity()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> DeviceResult<()> {
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> DeviceResult<()> {
        std::thread::sleep(self.delay);
        self.inner.write_at(offset, buf)
    }
    fn flush(&self) -> DeviceResult<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> DeviceResult<()> {
        self.inner.discard(offset, len)
    }
}

/// A cache of `cache_bytes` formatted for `origin_sim`, opened over
/// `origin` (a wrapper of it).
fn engine_over(cache_bytes: u64, origin_sim: &SimDevice, origin: Arc<dyn Device>) -> Arc<Engine> {
    let cache = SimDevice::new("cache", cache_bytes);
    Engine::format(
        Arc::new(cache.clone()),
        Arc::new(origin_sim.clone()),
        &FormatOptions::default(),
    )
    .expect("format");
    Arc::new(Engine::open(Arc::new(cache), origin, &open_opts()).expect("open"))
}

/// `count` threads serving the engine's write-back requests until the
/// returned guard is dropped.
struct Servers {
    engine: Arc<Engine>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Servers {
    fn start(engine: &Arc<Engine>, count: usize) -> Servers {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..count)
            .map(|_| {
                let (engine, stop) = (engine.clone(), stop.clone());
                std::thread::spawn(move || engine.serve_writeback_requests(&stop))
            })
            .collect();
        // Serving once registered: a request made before would run its
        // step on the caller's thread.
        let deadline = Instant::now() + PATIENCE;
        while engine.writeback_request_servers() < count {
            assert!(
                Instant::now() < deadline,
                "the request threads never started"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        Servers {
            engine: engine.clone(),
            stop,
            threads,
        }
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.engine.wake_writeback_request_servers();
        for t in self.threads.drain(..) {
            t.join().expect("request server");
        }
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.stop();
    }
}

fn block(lba: u64, version: u64) -> Vec<u8> {
    let mut data = pattern(lba * 1_000_003 + version, BS as usize);
    data[..8].copy_from_slice(&version.to_le_bytes());
    data
}

fn origin_block(origin: &SimDevice, lba: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BS as usize];
    origin.read_at(lba * BS, &mut buf).expect("origin read");
    buf
}

/// Run `main` on a reactor of its own thread; its result comes back on
/// the returned channel.
fn on_reactor<T: Send + 'static>(
    main: impl FnOnce(Reactor) -> std::pin::Pin<Box<dyn std::future::Future<Output = T>>>
        + Send
        + 'static,
) -> mpsc::Receiver<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let reactor = Reactor::new(&ReactorOptions::default()).expect("io_uring");
        let out = reactor.run(main(reactor.clone()));
        let _ = tx.send(out);
    });
    rx
}

/// 32 write-through writers on one event loop over an origin whose writes
/// take 2 ms: each write is on the origin when it is answered, and the
/// writes in flight together share epochs and write-back steps (one step
/// each cost 32 origin rounds per round of writes).
#[test]
fn write_through_writes_on_one_loop_share_steps_and_are_on_the_origin() {
    const TASKS: u64 = 32;
    const ROUNDS: u64 = 6;
    let origin_sim = SimDevice::new("origin", 256 * BS);
    let origin = Arc::new(SlowOrigin {
        inner: origin_sim.clone(),
        delay: Duration::from_millis(2),
    });
    let engine = engine_over(cache_bytes_small() + 256 * BS, &origin_sim, origin);
    engine
        .set_mode(CacheMode::WriteThrough, |_| {})
        .expect("mode");
    let _servers = Servers::start(&engine, 2);
    let before = engine.stats();
    let (e, o) = (engine.clone(), origin_sim.clone());
    let done = on_reactor(move |reactor| {
        Box::pin(async move {
            let writers: Vec<_> = (0..TASKS)
                .map(|t| {
                    let (engine, origin) = (e.clone(), o.clone());
                    reactor.spawn(async move {
                        for version in 1..=ROUNDS {
                            let data = block(t, version);
                            engine
                                .write_async(t * BS, &data, false)
                                .await
                                .expect("write");
                            assert!(
                                origin_block(&origin, t) == data,
                                "block {t} version {version} answered before it was on the origin"
                            );
                        }
                    })
                })
                .collect();
            for w in writers {
                w.await;
            }
        })
    });
    done.recv_timeout(PATIENCE).expect("the writers finished");
    let after = engine.stats();
    let writes = TASKS * ROUNDS;
    let groups = after.writeback_groups - before.writeback_groups;
    assert_eq!(after.writethrough_waits - before.writethrough_waits, writes);
    assert!(
        groups * 4 <= writes,
        "{writes} write-through writes took {groups} write-back steps: they did not share them"
    );
    for t in 0..TASKS {
        assert!(
            origin_block(&origin_sim, t) == block(t, ROUNDS),
            "block {t}"
        );
    }
}

/// A write-through write whose origin write is held: the loop it came
/// from answers a cached read meanwhile. With the step run in the
/// writer's own thread, the loop itself was held at the origin.
#[test]
fn a_write_through_write_waiting_for_its_origin_leaves_its_loop_serving() {
    let origin_sim = SimDevice::new("origin", 256 * BS);
    let origin = Arc::new(GatedOrigin::new(origin_sim.clone(), Hold::Write));
    let engine = engine_over(cache_bytes_small(), &origin_sim, origin.clone());
    engine
        .set_mode(CacheMode::WriteThrough, |_| {})
        .expect("mode");
    // Cached (write-through keeps a clean copy).
    engine.write(100 * BS, &block(100, 1), false).expect("warm");
    let _servers = Servers::start(&engine, 1);
    origin.gate.arm(None);
    let (read_tx, read_rx) = mpsc::channel();
    let (e, gated) = (engine.clone(), origin.clone());
    let done = on_reactor(move |reactor| {
        Box::pin(async move {
            let writer = {
                let engine = e.clone();
                reactor.spawn(async move { engine.write_async(5 * BS, &block(5, 1), false).await })
            };
            let deadline = Instant::now() + PATIENCE;
            while !gated.gate.is_entered() {
                assert!(
                    Instant::now() < deadline,
                    "the write never reached its origin"
                );
                reactor.sleep(Duration::from_millis(1)).await;
            }
            let data = e
                .read_async(100 * BS, BS as usize, false)
                .await
                .expect("read");
            let _ = read_tx.send(data.as_bytes() == block(100, 1));
            writer.await
        })
    });
    let read = read_rx.recv_timeout(PATIENCE);
    origin.gate.release();
    assert_eq!(
        read,
        Ok(true),
        "no cached read was answered while a write-through write waited for its origin"
    );
    done.recv_timeout(PATIENCE)
        .expect("the writer finished")
        .expect("write-through write");
    assert!(origin_block(&origin_sim, 5) == block(5, 1));
}

/// A write-through zeroing (and a discard) waits for its origin as a task
/// too: the loop answers a cached read while its step is held, and the
/// origin reads zeroes once it is answered.
#[test]
fn a_write_through_zeroing_waiting_for_its_origin_leaves_its_loop_serving() {
    let origin_sim = SimDevice::new("origin", 256 * BS);
    let origin = Arc::new(GatedOrigin::new(origin_sim.clone(), Hold::Write));
    let engine = engine_over(cache_bytes_small(), &origin_sim, origin.clone());
    engine
        .set_mode(CacheMode::WriteThrough, |_| {})
        .expect("mode");
    engine.write(100 * BS, &block(100, 1), false).expect("warm");
    engine
        .write(8 * BS, &block(8, 1), false)
        .expect("data to zero");
    assert!(origin_block(&origin_sim, 8) == block(8, 1));
    let _servers = Servers::start(&engine, 1);
    origin.gate.arm(None);
    let (read_tx, read_rx) = mpsc::channel();
    let (e, gated) = (engine.clone(), origin.clone());
    let done = on_reactor(move |reactor| {
        Box::pin(async move {
            let zeroing = {
                let engine = e.clone();
                reactor.spawn(async move { engine.write_zeroes_async_in(0, 8 * BS, 4 * BS).await })
            };
            let deadline = Instant::now() + PATIENCE;
            while !gated.gate.is_entered() {
                assert!(
                    Instant::now() < deadline,
                    "the zeroing never reached its origin"
                );
                reactor.sleep(Duration::from_millis(1)).await;
            }
            let data = e
                .read_async(100 * BS, BS as usize, false)
                .await
                .expect("read");
            let _ = read_tx.send(data.as_bytes() == block(100, 1));
            zeroing.await
        })
    });
    let read = read_rx.recv_timeout(PATIENCE);
    origin.gate.release();
    assert_eq!(
        read,
        Ok(true),
        "no cached read was answered while a write-through zeroing waited for its origin"
    );
    done.recv_timeout(PATIENCE)
        .expect("the zeroing finished")
        .expect("write-through zeroing");
    for lba in 8..12 {
        assert!(
            origin_block(&origin_sim, lba) == vec![0u8; BS as usize],
            "block {lba}"
        );
    }
}

/// A writer that finds the log full of dirty data waits for write-back as
/// a task: with the step held at the origin, the loop answers a cached
/// read; then every write lands and reads back.
#[test]
fn a_writer_waiting_for_space_leaves_its_loop_serving() {
    let volume_blocks = 4096;
    let origin_sim = SimDevice::new("origin", volume_blocks * BS);
    let origin = Arc::new(GatedOrigin::new(origin_sim.clone(), Hold::Write));
    let engine = engine_over(cache_bytes_small(), &origin_sim, origin.clone());
    engine.write(0, &block(0, 1), false).expect("cached block");
    engine.flush().expect("flush");
    let _servers = Servers::start(&engine, 1);
    origin.gate.arm(None);
    let (read_tx, read_rx) = mpsc::channel();
    let (e, gated) = (engine.clone(), origin.clone());
    // More blocks than the log holds, each written once, flushed now and
    // then so write-back has epochs to take.
    let blocks: Vec<u64> = (1..volume_blocks).collect();
    let written = blocks.clone();
    let done = on_reactor(move |reactor| {
        Box::pin(async move {
            let writer = {
                let engine = e.clone();
                reactor.spawn(async move {
                    for &lba in &written {
                        engine.write_async(lba * BS, &block(lba, 1), false).await?;
                        if lba % 64 == 0 {
                            engine.flush_async().await?;
                        }
                    }
                    Ok::<(), cairn_engine::EngineError>(())
                })
            };
            let deadline = Instant::now() + PATIENCE;
            while !gated.gate.is_entered() {
                assert!(
                    Instant::now() < deadline,
                    "the writer never waited for write-back"
                );
                reactor.sleep(Duration::from_millis(1)).await;
            }
            let data = e.read_async(0, BS as usize, false).await.expect("read");
            let _ = read_tx.send(data.as_bytes() == block(0, 1));
            writer.await
        })
    });
    let read = read_rx.recv_timeout(PATIENCE);
    origin.gate.release();
    assert_eq!(
        read,
        Ok(true),
        "no cached read was answered while a writer waited for space"
    );
    done.recv_timeout(Duration::from_secs(120))
        .expect("the writer finished")
        .expect("writes");
    assert!(
        engine.stats().writeback_stalls > 0,
        "no write waited for space"
    );
    for lba in std::iter::once(0).chain(blocks) {
        let mut buf = vec![0u8; BS as usize];
        engine.read(lba * BS, &mut buf).expect("read back");
        assert!(buf == block(lba, 1), "block {lba}");
    }
}

/// A step that fails (the origin refuses writes) answers every writer
/// waiting for it with the origin's error, and none of them hangs.
#[test]
fn a_failed_step_fails_every_write_through_write_waiting_for_it() {
    let origin_sim = SimDevice::new("origin", 256 * BS);
    let engine = engine_over(
        cache_bytes_small(),
        &origin_sim,
        Arc::new(origin_sim.clone()),
    );
    engine
        .set_mode(CacheMode::WriteThrough, |_| {})
        .expect("mode");
    let _servers = Servers::start(&engine, 2);
    origin_sim.fail_range(RangeFault {
        kinds: OpKinds {
            writes: true,
            ..OpKinds::default()
        },
        start: 0,
        end: 256 * BS,
        mode: FaultMode::Sticky,
    });
    let e = engine.clone();
    let done = on_reactor(move |reactor| {
        Box::pin(async move {
            let writers: Vec<_> = (0..8u64)
                .map(|t| {
                    let engine = e.clone();
                    reactor
                        .spawn(async move { engine.write_async(t * BS, &block(t, 1), false).await })
                })
                .collect();
            let mut results = Vec::new();
            for w in writers {
                results.push(w.await);
            }
            results
        })
    });
    let results = done.recv_timeout(PATIENCE).expect("the writers finished");
    for (t, r) in results.into_iter().enumerate() {
        let err = r.expect_err("a write-through write succeeded without its origin");
        assert_eq!(err.errno(), libc::EIO, "writer {t}: {err}");
    }
}

/// Writers still waiting when the request threads stop get no answer from
/// them: they run their steps themselves and finish.
#[test]
fn writers_left_waiting_when_the_servers_stop_run_their_own_steps() {
    let origin_sim = SimDevice::new("origin", 256 * BS);
    let origin = Arc::new(GatedOrigin::new(origin_sim.clone(), Hold::Write));
    let engine = engine_over(cache_bytes_small(), &origin_sim, origin.clone());
    engine
        .set_mode(CacheMode::WriteThrough, |_| {})
        .expect("mode");
    let mut servers = Servers::start(&engine, 1);
    origin.gate.arm(None);
    let e = engine.clone();
    let done = on_reactor(move |reactor| {
        Box::pin(async move {
            let writers: Vec<_> = (0..4u64)
                .map(|t| {
                    let engine = e.clone();
                    reactor
                        .spawn(async move { engine.write_async(t * BS, &block(t, 1), false).await })
                })
                .collect();
            let mut results = Vec::new();
            for w in writers {
                results.push(w.await);
            }
            results
        })
    });
    origin.gate.wait_entered(PATIENCE, "the first step");
    // Stop the server while its step is held: it answers that step's
    // writers, then leaves; the others' requests are dropped unanswered.
    let stopper = {
        let stop = servers.stop.clone();
        let engine = engine.clone();
        std::thread::spawn(move || {
            stop.store(true, Ordering::SeqCst);
            engine.wake_writeback_request_servers();
        })
    };
    stopper.join().expect("stopper");
    origin.gate.release();
    servers.stop();
    let results = done.recv_timeout(PATIENCE).expect("the writers finished");
    for (t, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("writer {t}: {e}"));
        assert!(origin_block(&origin_sim, t as u64) == block(t as u64, 1));
    }
}
