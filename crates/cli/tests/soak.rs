//! The soak (issue 15), like RocksDB's crash test: the real binary, several
//! clients, `kill -9` at random moments, origin faults, online mode
//! switches, and a verifier that knows what was acknowledged as durable.
//!
//! - The origin is `nbdkit --filter=error file`: while the trigger file
//!   exists, a share of its reads and writes fail with EIO.
//! - The cache device is a file on FUSE: nbdfuse over `nbdkit --filter=error
//!   file`, with one trigger for read faults and one for write faults
//!   (nbdkit 1.32's error filter cannot fail a flush). Write faults end in degraded mode (every dirty block written
//!   back, writes straight to the origin); after such an iteration the
//!   verifier reads everything from the origin through the degraded
//!   daemon, and the cache is formatted again (`format --force`).
//! - Each client owns a range of blocks (so the model of a block has one
//!   writer) and runs one request at a time: writes of 1-8 self-verifying
//!   blocks (some with FUA), flushes, trims, write-zeroes, and reads that
//!   check what they get.
//! - The model of a block: the values it may hold now (one after an
//!   acknowledged write; more after a write whose outcome is unknown), and
//!   the values it may hold after a crash (everything written since its
//!   last acknowledged flush or FUA write, plus the value as of then).
//! - Each iteration serves for 0.5-3 s, toggling faults and mode
//!   switches meanwhile, then ends with `kill -9` (or, one time in four, a
//!   clean SIGTERM, after which every acknowledged write must be there,
//!   unless the daemon's engine had stopped and its stop failed: then it
//!   is a crash).
//!   After the restart, every block of every client is read: a value the
//!   model does not allow is a lost or corrupted write.
//!
//! `CAIRN_SOAK_SECONDS` (default 40) bounds the run; `CAIRN_SOAK_SEED`
//! repeats one. `bench/soak.sh --minutes N` runs it longer.

mod common;

#[path = "../../nbd/tests/common/mod.rs"]
#[allow(unused_imports)]
mod nbd_client;

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cairn_nbd::proto::*;
use common::*;
use nbd_client::{Client, Mode};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const BLOCK: usize = 4096;
const CLIENTS: usize = 3;
/// Blocks each client owns: 3 x 8 MiB written over a 6 MiB cache, so the
/// log wraps and write-back and eviction run under every cut.
const BLOCKS_PER_CLIENT: u64 = 2048;
const CACHE_BYTES: u64 = 6 << 20;
const ORIGIN_BYTES: u64 = 32 << 20;
const MAGIC: &[u8; 8] = b"CAIRNSOK";
/// Longest a request may take before the soak calls the daemon hung.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(90);

/// What a block holds: zeroes, or the data of write `seq` to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Val {
    Zero,
    Data(u64),
}

fn block_bytes(lba: u64, seq: u64) -> Vec<u8> {
    let mut block = vec![0u8; BLOCK];
    block[..8].copy_from_slice(MAGIC);
    block[8..16].copy_from_slice(&lba.to_le_bytes());
    block[16..24].copy_from_slice(&seq.to_le_bytes());
    let mut x = lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seq.wrapping_mul(0xD1B5_4A32_D192_ED03);
    for chunk in block[24..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let n = chunk.len();
        chunk.copy_from_slice(&x.to_le_bytes()[..n]);
    }
    block
}

/// The value `bytes` holds at `lba`, or why it is none.
fn decode(lba: u64, bytes: &[u8]) -> Result<Val, String> {
    if bytes.iter().all(|&b| b == 0) {
        return Ok(Val::Zero);
    }
    if &bytes[..8] != MAGIC {
        return Err("neither zeroes nor a soak block".into());
    }
    let at = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
    let seq = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
    if at != lba {
        return Err(format!("the block written for lba {at} (write {seq})"));
    }
    if bytes != block_bytes(lba, seq).as_slice() {
        return Err(format!("write {seq}'s header over damaged data"));
    }
    Ok(Val::Data(seq))
}

#[derive(Debug, Clone)]
struct BlockModel {
    now: Vec<Val>,
    after_crash: Vec<Val>,
}

impl BlockModel {
    fn add(set: &mut Vec<Val>, v: Val) {
        if !set.contains(&v) {
            set.push(v);
        }
    }
}

/// One client's blocks and what it knows of them.
struct Model {
    first_lba: u64,
    blocks: Vec<BlockModel>,
}

impl Model {
    fn new(first_lba: u64) -> Model {
        let block = BlockModel {
            now: vec![Val::Zero],
            after_crash: vec![Val::Zero],
        };
        Model {
            first_lba,
            blocks: vec![block; BLOCKS_PER_CLIENT as usize],
        }
    }

    fn block(&mut self, lba: u64) -> &mut BlockModel {
        &mut self.blocks[(lba - self.first_lba) as usize]
    }

    /// A write of `vals` from `lba`: acknowledged (`Some(fua)`) or of
    /// unknown outcome (`None`).
    fn wrote(&mut self, lba: u64, vals: &[Val], acked: Option<bool>) {
        for (k, &v) in vals.iter().enumerate() {
            let b = self.block(lba + k as u64);
            match acked {
                Some(true) => {
                    b.now = vec![v];
                    b.after_crash = vec![v];
                }
                Some(false) => {
                    b.now = vec![v];
                    BlockModel::add(&mut b.after_crash, v);
                }
                None => {
                    BlockModel::add(&mut b.now, v);
                    BlockModel::add(&mut b.after_crash, v);
                }
            }
        }
    }

    fn flushed(&mut self) {
        for b in &mut self.blocks {
            b.after_crash = b.now.clone();
        }
    }
}

/// What the run saw, for the report.
#[derive(Default)]
struct Tally {
    requests: AtomicU64,
    writes: AtomicU64,
    fua_writes: AtomicU64,
    flushes: AtomicU64,
    trims: AtomicU64,
    zeroes: AtomicU64,
    reads_checked: AtomicU64,
    errors_during_faults: AtomicU64,
}

/// The faults the soak injects, each on while its trigger files exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// A share of the origin's reads and writes fail.
    Origin = 0,
    /// A share of the cache device's reads fail.
    CacheReads = 1,
    /// A share of the cache device's writes fail.
    CacheWrites = 2,
}

struct Switch {
    triggers: Vec<PathBuf>,
    on: AtomicBool,
    periods: AtomicU64,
}

/// The fault switches. `generation` moves at every switch, so a request
/// that overlapped faults can tell.
struct Faults {
    switches: [Switch; 3],
    /// The daemon said it serves nothing any more (cache_state `failed`:
    /// even the switch to degraded failed, for good) or not for now
    /// (`degrading`: an attempt at the switch failed and waits to be tried
    /// again): every error is excused until the next restart.
    held: AtomicBool,
    generation: AtomicU64,
}

impl Faults {
    fn new(origin: PathBuf, cache_reads: PathBuf, cache_writes: PathBuf) -> Faults {
        let switch = |triggers: Vec<PathBuf>| Switch {
            triggers,
            on: AtomicBool::new(false),
            periods: AtomicU64::new(0),
        };
        Faults {
            switches: [
                switch(vec![origin]),
                switch(vec![cache_reads]),
                switch(vec![cache_writes]),
            ],
            held: AtomicBool::new(false),
            generation: AtomicU64::new(0),
        }
    }

    fn is_on(&self, fault: Fault) -> bool {
        self.switches[fault as usize].on.load(Ordering::SeqCst)
    }

    fn periods(&self, fault: Fault) -> u64 {
        self.switches[fault as usize]
            .periods
            .load(Ordering::Relaxed)
    }

    fn set(&self, fault: Fault, on: bool) {
        let switch = &self.switches[fault as usize];
        if on == switch.on.load(Ordering::SeqCst) {
            return;
        }
        self.generation.fetch_add(1, Ordering::SeqCst);
        for trigger in &switch.triggers {
            if on {
                std::fs::write(trigger, b"on").expect("creating a fault trigger");
            } else {
                let _ = std::fs::remove_file(trigger);
            }
        }
        if on {
            switch.periods.fetch_add(1, Ordering::Relaxed);
        }
        switch.on.store(on, Ordering::SeqCst);
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    fn toggle(&self, fault: Fault) {
        self.set(fault, !self.is_on(fault));
    }

    fn all_off(&self) {
        for fault in [Fault::Origin, Fault::CacheReads, Fault::CacheWrites] {
            self.set(fault, false);
        }
    }

    /// The daemon failed for good, or its switch to degraded mode failed
    /// and waits to be tried again: excuse its errors until `release`.
    fn hold(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.held.store(true, Ordering::SeqCst);
    }

    fn release(&self) {
        self.held.store(false, Ordering::SeqCst);
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    /// The origin died and is restarted by `restart`: requests meanwhile
    /// are excused like those during injected faults.
    fn origin_gone(&self, restart: impl FnOnce()) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        restart();
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    /// A mark to take before a request; `excused` after it says whether
    /// faults may have been on meanwhile.
    fn mark(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    fn excused(&self, mark: u64) -> bool {
        self.switches.iter().any(|s| s.on.load(Ordering::SeqCst))
            || self.held.load(Ordering::SeqCst)
            || self.generation.load(Ordering::SeqCst) != mark
    }
}

/// `cairn status --json`'s `cache_state` of the running daemon, if it
/// answers.
fn cache_state(ctx: &Ctx, cache: &Path) -> Option<String> {
    let out = ctx.cairn(&["status", "--cache", &cache.to_string_lossy(), "--json"]);
    if !out.status.success() {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    v["cache_state"].as_str().map(str::to_string)
}

/// Excuse the daemon's errors while it does not serve: stopped (`failed`,
/// until the restart) or between attempts at the switch to degraded mode
/// (`degrading`, until it reports `degraded` or `ok` again: errors on the
/// degraded path are checked as usual). `degrading` is the hold to drop;
/// `not_serving` counts the states seen.
fn watch_serving(
    ctx: &Ctx,
    cache: &Path,
    faults: &Faults,
    not_serving: &mut [u64; 2],
    degrading: &mut bool,
) {
    let held = faults.held.load(Ordering::SeqCst);
    if held && !*degrading {
        return;
    }
    match cache_state(ctx, cache).as_deref() {
        Some("failed") => {
            not_serving[0] += 1;
            *degrading = false;
            if !held {
                faults.hold();
            }
        }
        Some("degrading") if !held => {
            not_serving[1] += 1;
            *degrading = true;
            faults.hold();
        }
        Some("degraded") | Some("ok") if *degrading => {
            *degrading = false;
            faults.release();
        }
        _ => {}
    }
}

fn connect(socket: &Path) -> Option<Client> {
    let stream = UnixStream::connect(socket).ok()?;
    stream.set_read_timeout(Some(REQUEST_TIMEOUT)).ok()?;
    let mut client = Client::over(stream).ok()?;
    client.negotiate(Mode::Structured, false).ok()?;
    Some(client)
}

/// One request; `Err` if the connection is gone (the daemon died), or the
/// NBD error of its reply.
fn call(c: &mut Client, flags: u16, cmd: u16, lba: u64, count: u64, payload: &[u8]) -> Call {
    let offset = lba * BLOCK as u64;
    let length = count * BLOCK as u64;
    match c.call(flags, cmd, offset, length, payload) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            panic!(
                "command {cmd} at lba {lba} got no reply in {REQUEST_TIMEOUT:?}: the daemon hung"
            )
        }
        Err(_) => Call::Gone,
        Ok(r) if r.error != 0 => Call::Failed(r.error),
        Ok(r) => Call::Done(r.data),
    }
}

enum Call {
    Done(Vec<u8>),
    Failed(u32),
    Gone,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Write,
    Flush,
    Trim,
    Zero,
    Read,
}

/// An iteration's mix: rare flushes leave FUA writes as the only durable
/// ones for long (so a FUA that is not durable is lost at the kill), and
/// frequent ones cut many barriers.
#[derive(Debug, Clone, Copy)]
struct Mix {
    /// Of 100 requests; the rest of 50..65 are trims.
    flush_percent: u32,
    fua_share: f64,
}

/// What the clients of an iteration share.
struct Run {
    socket: PathBuf,
    /// Sequence numbers of writes, unique across clients and iterations.
    next_seq: Arc<AtomicU64>,
    faults: Arc<Faults>,
    stop: AtomicBool,
    tally: Arc<Tally>,
}

/// A client's work until the connection dies or `stop`: panics on a read
/// the model does not allow.
fn client_loop(id: usize, seed: u64, run: &Run, model: &Mutex<Model>, mix: Mix) {
    let Run {
        socket,
        next_seq,
        faults,
        stop,
        tally,
    } = run;
    let Some(mut c) = connect(socket) else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut model = model.lock().expect("model lock");
    let first = model.first_lba;
    while !stop.load(Ordering::SeqCst) {
        let count = rng.gen_range(1..=8u64);
        let lba = first + rng.gen_range(0..BLOCKS_PER_CLIENT - count + 1);
        let mark = faults.mark();
        tally.requests.fetch_add(1, Ordering::Relaxed);
        // Writes, flushes, trims, zeroes and reads in the iteration's mix.
        let roll = rng.gen_range(0..100);
        let op = if roll < 50 {
            Op::Write
        } else if roll < 50 + mix.flush_percent {
            Op::Flush
        } else if roll < 65 {
            Op::Trim
        } else if roll < 70 {
            Op::Zero
        } else {
            Op::Read
        };
        let gone = match op {
            Op::Write => {
                let fua = rng.gen_bool(mix.fua_share);
                let seqs: Vec<u64> = (0..count)
                    .map(|_| next_seq.fetch_add(1, Ordering::Relaxed))
                    .collect();
                let payload: Vec<u8> = seqs
                    .iter()
                    .enumerate()
                    .flat_map(|(k, &s)| block_bytes(lba + k as u64, s))
                    .collect();
                let vals: Vec<Val> = seqs.iter().map(|&s| Val::Data(s)).collect();
                let flags = if fua { CMD_FLAG_FUA } else { 0 };
                let outcome = call(&mut c, flags, CMD_WRITE, lba, count, &payload);
                wrote(
                    &mut model, lba, &vals, fua, outcome, faults, mark, tally, "write",
                )
            }
            Op::Flush => match call(&mut c, 0, CMD_FLUSH, 0, 0, &[]) {
                Call::Done(_) => {
                    model.flushed();
                    tally.flushes.fetch_add(1, Ordering::Relaxed);
                    false
                }
                Call::Failed(e) => {
                    excuse(
                        faults,
                        mark,
                        tally,
                        &format!("client {id}: FLUSH failed ({e})"),
                    );
                    false
                }
                Call::Gone => true,
            },
            Op::Trim | Op::Zero => {
                let (cmd, what) = if op == Op::Trim {
                    (CMD_TRIM, "trim")
                } else {
                    (CMD_WRITE_ZEROES, "write-zeroes")
                };
                let vals = vec![Val::Zero; count as usize];
                let outcome = call(&mut c, 0, cmd, lba, count, &[]);
                let counter = if cmd == CMD_TRIM {
                    &tally.trims
                } else {
                    &tally.zeroes
                };
                if matches!(outcome, Call::Done(_)) {
                    counter.fetch_add(1, Ordering::Relaxed);
                }
                wrote(
                    &mut model, lba, &vals, false, outcome, faults, mark, tally, what,
                )
            }
            Op::Read => match call(&mut c, 0, CMD_READ, lba, count, &[]) {
                Call::Done(data) => {
                    for k in 0..count {
                        let at = lba + k;
                        let bytes = &data[k as usize * BLOCK..(k as usize + 1) * BLOCK];
                        let b = model.block(at);
                        let got = decode(at, bytes)
                            .unwrap_or_else(|why| panic!("seed {seed}: lba {at} read {why}"));
                        assert!(
                            b.now.contains(&got),
                            "seed {seed}: lba {at} read {got:?}, but it can only hold {:?}",
                            b.now
                        );
                        b.now = vec![got];
                    }
                    tally.reads_checked.fetch_add(count, Ordering::Relaxed);
                    false
                }
                Call::Failed(e) => {
                    excuse(
                        faults,
                        mark,
                        tally,
                        &format!("client {id}: READ of lba {lba} failed ({e})"),
                    );
                    false
                }
                Call::Gone => true,
            },
        };
        if gone {
            return;
        }
    }
}

/// Apply a write's outcome to the model.
#[allow(clippy::too_many_arguments)]
fn wrote(
    model: &mut Model,
    lba: u64,
    vals: &[Val],
    fua: bool,
    outcome: Call,
    faults: &Faults,
    mark: u64,
    tally: &Tally,
    what: &str,
) -> bool {
    match outcome {
        Call::Done(_) => {
            model.wrote(lba, vals, Some(fua));
            if what == "write" {
                tally.writes.fetch_add(1, Ordering::Relaxed);
                if fua {
                    tally.fua_writes.fetch_add(1, Ordering::Relaxed);
                }
            }
            false
        }
        Call::Failed(e) => {
            model.wrote(lba, vals, None);
            excuse(
                faults,
                mark,
                tally,
                &format!("{what} at lba {lba} failed ({e})"),
            );
            false
        }
        Call::Gone => {
            model.wrote(lba, vals, None);
            true
        }
    }
}

/// An error reply is allowed only while faults may have been on,
/// or while the origin was gone: an origin that died is noticed by the
/// main loop within one of its steps, so an unexcused error waits for that
/// long before it counts as one.
fn excuse(faults: &Faults, mark: u64, tally: &Tally, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while !faults.excused(mark) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(faults.excused(mark), "{what} with no fault injected");
    tally.errors_during_faults.fetch_add(1, Ordering::Relaxed);
}

/// After a restart: every block must hold a value the model allows
/// (`clean`: every acknowledged write; else what a crash may leave).
/// Returns the blocks checked.
fn verify(socket: &Path, models: &[Mutex<Model>], clean: bool, seed: u64, iteration: u64) -> u64 {
    let mut c = connect(socket).expect("connecting the verifier");
    // What recovery kept is durable from here on.
    assert!(matches!(
        call(&mut c, 0, CMD_FLUSH, 0, 0, &[]),
        Call::Done(_)
    ));
    let mut checked = 0;
    for model in models {
        let mut model = model.lock().expect("model lock");
        let first = model.first_lba;
        for chunk in 0..BLOCKS_PER_CLIENT / 64 {
            let lba = first + chunk * 64;
            let data = match call(&mut c, 0, CMD_READ, lba, 64, &[]) {
                Call::Done(data) => data,
                Call::Failed(e) => panic!(
                    "seed {seed}, iteration {iteration}: verifier read of lba {lba} failed ({e})"
                ),
                Call::Gone => panic!(
                    "seed {seed}, iteration {iteration}: the daemon went away under the verifier"
                ),
            };
            for k in 0..64u64 {
                let at = lba + k;
                let bytes = &data[k as usize * BLOCK..(k as usize + 1) * BLOCK];
                let got = decode(at, bytes).unwrap_or_else(|why| {
                    panic!("seed {seed}, iteration {iteration}: lba {at} holds {why}")
                });
                let b = model.block(at);
                let allowed = if clean { &b.now } else { &b.after_crash };
                assert!(
                    allowed.contains(&got),
                    "seed {seed}, iteration {iteration}: after a {} lba {at} holds {got:?}, \
                     which the acknowledged writes do not allow ({allowed:?})",
                    if clean { "clean restart" } else { "kill -9" }
                );
                b.now = vec![got];
                b.after_crash = vec![got];
                checked += 1;
            }
        }
    }
    checked
}

#[test]
fn soak_kill9_origin_faults_and_mode_switches() {
    if !require_tools("soak", &["nbdkit"]) || !require_fuse_device("soak") {
        return;
    }
    let seconds: u64 = std::env::var("CAIRN_SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let seed: u64 = std::env::var("CAIRN_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64 % 1_000_000)
                .unwrap_or(1)
        });
    println!("soak: seed {seed} (CAIRN_SOAK_SEED={seed} repeats it), {seconds} s");
    let ctx = Ctx::new("soak");
    let origin = ctx.file("origin.img", ORIGIN_BYTES);
    let origin_sock = ctx.path("origin.sock");
    let faults = Arc::new(Faults::new(
        ctx.path("origin-faults"),
        ctx.path("cache-read-faults"),
        ctx.path("cache-write-faults"),
    ));
    let trigger = |fault: Fault| {
        faults.switches[fault as usize].triggers[0]
            .display()
            .to_string()
    };
    let origin_args: Vec<String> = vec![
        "--filter=error".into(),
        "file".into(),
        format!("file={}", origin.display()),
        "error=EIO".into(),
        "error-rate=30%".into(),
        format!("error-file={}", trigger(Fault::Origin)),
    ];
    let start_origin = || {
        let args: Vec<&str> = origin_args.iter().map(String::as_str).collect();
        start_nbdkit(&ctx, &origin_sock, &args)
    };
    let mut origin_proc = start_origin();
    let mut origin_restarts = 0u64;
    // The cache device is a file on FUSE (nbdfuse over nbdkit's error
    // filter), so its reads and writes really fail while the triggers
    // exist: reads 20%, writes 10%. (nbdkit 1.32's error filter cannot
    // fail a flush.)
    let cache_backing = ctx.file("cache.img", CACHE_BYTES);
    let cache_args: Vec<String> = vec![
        "--filter=error".into(),
        "file".into(),
        format!("file={}", cache_backing.display()),
        "error=EIO".into(),
        "error-pread=EIO".into(),
        "error-pread-rate=20%".into(),
        format!("error-pread-file={}", trigger(Fault::CacheReads)),
        "error-pwrite=EIO".into(),
        "error-pwrite-rate=10%".into(),
        format!("error-pwrite-file={}", trigger(Fault::CacheWrites)),
    ];
    let cache_args: Vec<&str> = cache_args.iter().map(String::as_str).collect();
    let mut cache_device = FuseDevice::start(&ctx, "cache", &cache_args);
    let cache = cache_device.file();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let integrity = rng.gen_bool(0.5);
    let origin_uri = nbd_unix_uri(&origin_sock);
    let format_args: &[&str] = if integrity { &["--integrity"] } else { &[] };
    ctx.format(&cache, &origin_uri, format_args);
    let socket = ctx.path("cairn.sock");
    // nbdkit itself can die when a client vanishes mid-reply (seen:
    // "raw_send_socket: Assertion `sock >= 0' failed" after a kill -9 of
    // cairn): an origin that goes away is restarted, one more fault.
    let revive_origin = |origin: &mut Proc, restarts: &mut u64| {
        if origin.try_status().is_some() {
            faults.origin_gone(|| {
                let _ = std::fs::remove_file(&origin_sock);
                *origin = start_origin();
            });
            *restarts += 1;
        }
    };
    let models: Arc<Vec<Mutex<Model>>> = Arc::new(
        (0..CLIENTS)
            .map(|i| Mutex::new(Model::new(i as u64 * BLOCKS_PER_CLIENT)))
            .collect(),
    );
    let next_seq = Arc::new(AtomicU64::new(1));
    let tally = Arc::new(Tally::default());
    let (mut kills, mut clean_stops, mut mode_switches, mut verified) = (0u64, 0u64, 0u64, 0u64);
    let (mut degrades, mut failed_stops) = (0u64, 0u64);
    // Daemons seen stopped (`failed`) and between switch attempts
    // (`degrading`).
    let mut failed_states = [0u64; 2];
    let started = Instant::now();
    let mut iteration = 0u64;
    let mut mode_now = "writeback";
    while started.elapsed() < Duration::from_secs(seconds) {
        iteration += 1;
        let mut server = ctx.serve(&cache, &socket, &[]);
        let run = Arc::new(Run {
            socket: socket.clone(),
            next_seq: next_seq.clone(),
            faults: faults.clone(),
            stop: AtomicBool::new(false),
            tally: tally.clone(),
        });
        let mix = Mix {
            flush_percent: [0, 1, 10][rng.gen_range(0..3)],
            fua_share: [0.05, 0.2, 0.5][rng.gen_range(0..3)],
        };
        // Cache write faults end in degraded mode (or, when even that
        // cannot be written, in a daemon that fails everything): one
        // iteration in four, so write-back stays the common case.
        let cache_writes_may_fail = rng.gen_range(0..4) == 0;
        let clients: Vec<_> = (0..CLIENTS)
            .map(|i| {
                let (run, models) = (run.clone(), models.clone());
                let client_seed = seed ^ (iteration << 8) ^ i as u64;
                std::thread::spawn(move || client_loop(i, client_seed, &run, &models[i], mix))
            })
            .collect();
        // Serve for a while, with faults and mode switches.
        let serve_for = Duration::from_millis(rng.gen_range(500..3000));
        let until = Instant::now() + serve_for;
        let mut switcher: Option<Proc> = None;
        // Errors are excused because the daemon was seen `degrading`.
        let mut degrading = false;
        let mut cache_writes_failed = false;
        while Instant::now() < until {
            std::thread::sleep(Duration::from_millis(rng.gen_range(50..400)));
            match rng.gen_range(0..14) {
                0..=2 => faults.toggle(Fault::Origin),
                3 if switcher.is_none() => {
                    // Away from writeback and back again: write-back, where
                    // acknowledged data lives only in the cache, stays the
                    // mode most of the time.
                    let others = ["writethrough", "writearound", "passthrough"];
                    let mode = if mode_now == "writeback" {
                        others[rng.gen_range(0..others.len())]
                    } else {
                        "writeback"
                    };
                    mode_now = mode;
                    let c = cache.to_string_lossy().to_string();
                    switcher =
                        Some(ctx.spawn("mode", &mut ctx.cmd(&["mode", "--cache", &c, mode])));
                    mode_switches += 1;
                }
                4 | 5 => faults.toggle(Fault::CacheReads),
                6 if cache_writes_may_fail => {
                    faults.toggle(Fault::CacheWrites);
                    cache_writes_failed = true;
                }
                _ => {}
            }
            if let Some(p) = switcher.as_mut() {
                if p.try_status().is_some() {
                    switcher = None;
                }
            }
            if cache_writes_failed {
                watch_serving(&ctx, &cache, &faults, &mut failed_states, &mut degrading);
            }
            revive_origin(&mut origin_proc, &mut origin_restarts);
        }
        let mut clean = rng.gen_range(0..4) == 0;
        if clean {
            // A clean stop drains nothing it need not, but every
            // acknowledged write must be there afterwards.
            faults.all_off();
            run.stop.store(true, Ordering::SeqCst);
            for c in clients {
                c.join().expect("a client panicked");
            }
            // The engine may have stopped since the serving loop last
            // looked (it stops when even the switch to degraded mode
            // cannot be written).
            if cache_writes_failed {
                watch_serving(&ctx, &cache, &faults, &mut failed_states, &mut degrading);
            }
            let status = server.terminate();
            assert!(
                status.success() || faults.held.load(Ordering::SeqCst),
                "seed {seed}: clean stop failed: {status:?}"
            );
            if status.success() {
                clean_stops += 1;
            } else {
                // A stopped engine cannot make its last writes durable,
                // and says so (its final flush fails, it exits non-zero):
                // what it acknowledged since the last flush may be lost,
                // as at a kill -9. Only a stop that succeeded promises
                // every acknowledged write.
                clean = false;
                failed_stops += 1;
            }
        } else {
            server.kill9();
            run.stop.store(true, Ordering::SeqCst);
            for c in clients {
                c.join().expect("a client panicked");
            }
            kills += 1;
        }
        if let Some(mut p) = switcher.take() {
            p.kill9();
        }
        faults.all_off();
        faults.release();
        revive_origin(&mut origin_proc, &mut origin_restarts);
        let mut server = ctx.serve(&cache, &socket, &[]);
        verified += verify(&socket, &models, clean, seed, iteration);
        let state = cache_state(&ctx, &cache);
        server.terminate();
        match state.as_deref() {
            Some("ok") => {}
            Some("degraded") => {
                // Every acknowledged write was drained to the origin and
                // the verifier read it from there: a new cache over the
                // same origin loses nothing.
                degrades += 1;
                let mut args = vec!["--force"];
                args.extend_from_slice(format_args);
                ctx.format(&cache, &origin_uri, &args);
                mode_now = "writeback";
            }
            other => panic!("seed {seed}, iteration {iteration}: cache_state {other:?} after a restart with no faults"),
        }
    }
    cache_device.stop();
    let t = &tally;
    let line = format!(
        "soak: seed {seed}, {iteration} iterations in {:.0} s, {kills} kill -9, {clean_stops} clean stops \
         ({failed_stops} more failed: engine stopped), \
         fault periods: {} origin, {} cache read, {} cache write; {degrades} degraded (re-formatted), \
         {stopped} failed, {degrading} seen degrading; {origin_restarts} origin restarts, {mode_switches} mode switches, integrity {}; {} requests \
         ({} writes, {} FUA, {} flushes, {} trims, {} write-zeroes, {} blocks read and checked, \
         {} errors while faults were on); {verified} blocks verified after restarts, 0 wrong",
        started.elapsed().as_secs_f64(),
        faults.periods(Fault::Origin),
        faults.periods(Fault::CacheReads),
        faults.periods(Fault::CacheWrites),
        if integrity { "on" } else { "off" },
        t.requests.load(Ordering::Relaxed),
        t.writes.load(Ordering::Relaxed),
        t.fua_writes.load(Ordering::Relaxed),
        t.flushes.load(Ordering::Relaxed),
        t.trims.load(Ordering::Relaxed),
        t.zeroes.load(Ordering::Relaxed),
        t.reads_checked.load(Ordering::Relaxed),
        t.errors_during_faults.load(Ordering::Relaxed),
        stopped = failed_states[0],
        degrading = failed_states[1],
    );
    // Straight to fd 2, so the report shows also when the test passes.
    let _ = std::io::Write::write_all(&mut std::io::stderr(), format!("{line}\n").as_bytes());
    assert!(
        kills >= 1,
        "the soak ran no kill -9 ({seconds} s is too short)"
    );
    assert!(verified > 0);
}
