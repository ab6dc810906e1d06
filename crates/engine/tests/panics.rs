//! A panic inside a cache write (a bug somewhere below, caught by the NBD
//! server's per-request guard, which turns it into an EIO reply) must not
//! wedge the engine: later flushes, writes and reads still return, and
//! nothing acknowledged is lost. Two places held the whole engine hostage
//! on such a panic: a barrier's leader that unwound left the group commit
//! "leading" forever (every later flush waited for it), and a claimed
//! record whose writer unwound was never published as written or failed
//! (every later barrier waited for it).

mod common;
use common::*;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use cairn_device::{Device, DeviceResult, SimDevice};
use cairn_engine::{Engine, FormatOptions};

const WATCHDOG: Duration = Duration::from_secs(30);

/// A simulated cache whose next barrier write, or next plain vectored
/// write (a record writer's), panics once armed. An armed barrier first
/// tells the test it is inside the device and waits to be let go.
struct Panicking {
    inner: SimDevice,
    barrier_armed: AtomicBool,
    write_armed: AtomicBool,
    entered: std::sync::Mutex<Option<mpsc::Sender<()>>>,
    release: std::sync::Mutex<Option<mpsc::Receiver<()>>>,
}

impl Panicking {
    fn new(inner: SimDevice) -> Panicking {
        Panicking {
            inner,
            barrier_armed: AtomicBool::new(false),
            write_armed: AtomicBool::new(false),
            entered: std::sync::Mutex::new(None),
            release: std::sync::Mutex::new(None),
        }
    }

    /// An armed barrier reports that it entered, waits for the release,
    /// and panics.
    fn panic_if_armed(&self) {
        if self.barrier_armed.swap(false, Ordering::SeqCst) {
            if let Some(tx) = self.entered.lock().unwrap().take() {
                let _ = tx.send(());
            }
            if let Some(rx) = self.release.lock().unwrap().take() {
                let _ = rx.recv_timeout(WATCHDOG);
            }
            panic!("injected: a barrier panics");
        }
    }

    /// Arm the next barrier: returns (entered, release) for the test.
    fn arm_barrier(&self) -> (mpsc::Receiver<()>, mpsc::Sender<()>) {
        let (entered_tx, entered_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel();
        *self.entered.lock().unwrap() = Some(entered_tx);
        *self.release.lock().unwrap() = Some(release_rx);
        self.barrier_armed.store(true, Ordering::SeqCst);
        (entered_rx, release_tx)
    }
}

impl Device for Panicking {
    fn name(&self) -> &str {
        "panicking"
    }

    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> DeviceResult<()> {
        self.inner.read_at(offset, buf)
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> DeviceResult<()> {
        self.inner.write_at(offset, buf)
    }

    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        if self.write_armed.swap(false, Ordering::SeqCst) {
            panic!("injected: a record write panics");
        }
        self.inner.write_vectored_at(offset, bufs)
    }

    fn flush(&self) -> DeviceResult<()> {
        self.inner.flush()
    }

    /// A group-commit barrier's sync.
    fn flush_lane(&self, lane: usize) -> DeviceResult<()> {
        self.panic_if_armed();
        self.inner.flush_lane(lane)
    }

    fn write_vectored_and_flush(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        self.panic_if_armed();
        self.inner.write_vectored_at(offset, bufs)?;
        self.inner.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> DeviceResult<()> {
        self.inner.discard(offset, len)
    }
}

fn rig(volume_blocks: u64, cache_bytes: u64) -> (Arc<Panicking>, Arc<Engine>) {
    let cache = Arc::new(Panicking::new(SimDevice::new("cache", cache_bytes)));
    let origin = SimDevice::new("origin", volume_blocks * BS);
    Engine::format(
        cache.clone(),
        Arc::new(origin.clone()),
        &FormatOptions::default(),
    )
    .expect("format");
    let engine =
        Arc::new(Engine::open(cache.clone(), Arc::new(origin), &open_opts()).expect("open"));
    (cache, engine)
}

/// Run `f` on its own thread; fail if it does not return in time.
fn returns<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    finishes_within(WATCHDOG, f)
        .unwrap_or_else(|| panic!("{what} never returned after a panic in a cache write"))
}

/// The first `blocks` blocks of the volume, read on a thread that must
/// return within the watchdog.
fn read_within(engine: &Arc<Engine>, blocks: u64, what: &str) -> Vec<u8> {
    let e = engine.clone();
    returns(what, move || {
        let mut buf = vec![0u8; (blocks * BS) as usize];
        e.read(0, &mut buf).expect("read");
        buf
    })
}

fn silence_injected_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let injected = info
            .payload()
            .downcast_ref::<&str>()
            .is_some_and(|m| m.starts_with("injected"));
        if !injected || std::env::var_os("PANICS_VERBOSE").is_some() {
            default(info);
        }
    }));
}

#[test]
fn a_barrier_leader_that_panics_leaves_flushes_that_return() {
    silence_injected_panics();
    let (cache, engine) = rig(256, cache_bytes_small());
    let first = pattern(1, BS as usize);
    engine.write(0, &first, false).expect("write");
    engine.flush().expect("flush");

    let second = pattern(2, BS as usize);
    engine.write(BS, &second, false).expect("write");
    let (entered, release) = cache.arm_barrier();
    let leader = {
        let e = engine.clone();
        std::thread::spawn(move || catch_unwind(AssertUnwindSafe(|| e.flush())))
    };
    entered
        .recv_timeout(WATCHDOG)
        .expect("the leader reached its barrier");
    // A flush that arrives meanwhile waits for the leader's barrier as a
    // follower; the leader then panics.
    let follower = {
        let e = engine.clone();
        std::thread::spawn(move || e.flush())
    };
    std::thread::sleep(Duration::from_millis(200));
    release.send(()).expect("release");
    assert!(
        leader.join().expect("leader thread").is_err(),
        "the leader's flush panicked"
    );
    let followed = returns("the flush that followed the leader", move || {
        follower.join().expect("follower thread")
    });
    // Whatever the follower was told, the engine answers from here on and
    // still holds every write it acknowledged.
    let _ = followed;
    let e = engine.clone();
    let _ = returns("a later flush", move || e.flush());
    let e = engine.clone();
    let (a, b) = returns("reads", move || {
        let mut a = vec![0u8; BS as usize];
        let mut b = vec![0u8; BS as usize];
        e.read(0, &mut a).expect("read block 0");
        e.read(BS, &mut b).expect("read block 1");
        (a, b)
    });
    assert_eq!(a, first, "the flushed block");
    assert_eq!(b, second, "the block written before the panicking barrier");
}

/// Write `data` at 0 as a task on a reactor of its own thread (so full
/// records go to the record writer threads); whether it succeeded, or
/// `None` if it panicked.
fn write_on_a_reactor(engine: &Arc<Engine>, data: &[u8]) -> Option<bool> {
    let e = engine.clone();
    let d = data.to_vec();
    returns("a write whose record write panicked", move || {
        catch_unwind(AssertUnwindSafe(|| {
            let reactor = cairn_io::Reactor::new(&cairn_io::ReactorOptions::default())
                .expect("io_uring available");
            reactor.run(async move { e.write_async(0, &d, false).await.is_ok() })
        }))
        .ok()
    })
}

/// After the panic, the engine still answers, and a block written and
/// flushed afterwards reads back (the cache may have gone degraded, its
/// data is then on the origin).
fn still_answers(engine: &Arc<Engine>) {
    let e = engine.clone();
    let _ = returns("a flush after the panic", move || e.flush());
    let later = pattern(4, BS as usize);
    let e = engine.clone();
    let l = later.clone();
    let got = returns("a write and a read after the panic", move || {
        e.write(900 * BS, &l, false).expect("write after");
        e.flush().expect("flush after");
        let mut buf = vec![0u8; BS as usize];
        e.read(900 * BS, &mut buf).expect("read after");
        buf
    });
    assert_eq!(got, later);
}

#[test]
fn a_record_writer_that_panics_marks_its_record_failed() {
    silence_injected_panics();
    // Room for everything: no checkpoint or space wait writes records in
    // the caller's thread, so the full record goes to a writer thread.
    let (cache, engine) = rig(1024, 64 << 20);
    cache.write_armed.store(true, Ordering::SeqCst);
    // 300 blocks: more than a record holds (252 in a 64 MiB cache).
    let data = pattern(3, 300 * BS as usize);
    let written = write_on_a_reactor(&engine, &data);
    assert!(
        !cache.write_armed.load(Ordering::SeqCst),
        "the armed record write happened"
    );
    // The failed record sends the cache degraded, and the write goes to
    // the origin instead: acknowledged, and there.
    assert_eq!(written, Some(true), "the write returns and succeeds");
    let got = read_within(&engine, 300, "a read of the write");
    assert!(got == data, "the acknowledged write reads back");
    still_answers(&engine);
}

#[test]
fn a_record_write_that_panics_under_the_engine_lock_leaves_an_engine_that_answers() {
    silence_injected_panics();
    // The smallest cache: the write's reservation checkpoints, which seals
    // and writes the records in the caller's thread, holding the lock.
    let (cache, engine) = rig(1024, cache_bytes_small());
    cache.write_armed.store(true, Ordering::SeqCst);
    let written = write_on_a_reactor(&engine, &pattern(3, 300 * BS as usize));
    assert!(!cache.write_armed.load(Ordering::SeqCst));
    assert_ne!(written, Some(true), "not acknowledged");
    still_answers(&engine);
}

/// Found by review: a barrier made under the engine lock (here a
/// checkpoint's) that panicked had already taken the open record out of
/// the log, so the unwind dropped acknowledged writes that were nowhere
/// else. The record stays open now, and the writes read back.
#[test]
fn a_barrier_under_the_engine_lock_that_panics_keeps_the_open_record() {
    silence_injected_panics();
    let (cache, engine) = rig(1024, 64 << 20);
    let data = pattern(5, 8 * BS as usize);
    engine.write(0, &data, false).expect("write, acknowledged");
    cache.barrier_armed.store(true, Ordering::SeqCst);
    let e = engine.clone();
    let checkpoint = returns("a checkpoint whose barrier panics", move || {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| e.checkpoint())).is_err()
    });
    assert!(checkpoint, "the armed barrier panicked");
    assert!(!cache.barrier_armed.load(Ordering::SeqCst));
    let got = read_within(&engine, 8, "a read of the acknowledged write");
    assert!(got == data, "the acknowledged write reads back");
    still_answers(&engine);
    let got = read_within(&engine, 8, "a read after the flush");
    assert!(
        got == data,
        "the acknowledged write survives the flush after"
    );
}
