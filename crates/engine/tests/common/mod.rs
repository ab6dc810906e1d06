//! Shared rig for the engine's model, crash, fault and corruption tests:
//! simulated cache and origin devices, a seeded workload generator, and a
//! reference model (a plain byte image of the volume).
#![allow(dead_code)]

/// Print a summary line that shows in `cargo test` output even when the
/// test passes (libtest captures `println!`, not the stderr handle).
#[macro_export]
macro_rules! report {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

pub mod crash_check;
pub mod flush_gated;
pub mod gate;
pub mod gated_origin;

use std::sync::Arc;

use cairn_device::{Device, SimDevice};
use cairn_engine::{Engine, EngineConfig, FormatOptions, OpenOptions};
use cairn_format::Layout;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub const BS: u64 = 4096;

/// The smallest cache the format accepts, so the log wraps often.
pub fn cache_bytes_small() -> u64 {
    Layout::cache_bytes_min(BS as u32) + 64 * BS
}

/// The smallest cache whose records may carry 1 MiB
/// (`FEATURE_LARGE_RECORDS`), so its log wraps often too.
pub fn cache_bytes_large_records() -> u64 {
    Layout::cache_bytes_min_for(BS as u32, cairn_format::FEATURE_LARGE_RECORDS) + 64 * BS
}

/// A cache a little too small for large records, so it writes 256 KiB
/// records (64 blocks) into a log of about 1,960 blocks: for tests whose
/// scenario needs several records sealed from a few hundred blocks (of a
/// 256-block volume) and no bound reached.
pub fn cache_bytes_small_records() -> u64 {
    Layout::cache_bytes_min_for(BS as u32, cairn_format::FEATURE_LARGE_RECORDS) - 64 * BS
}

pub fn config() -> EngineConfig {
    EngineConfig {
        promote_read_misses: true,
        unsynced_blocks_max: 512,
        promote_after_misses: 1,
        sequential_cutoff_bytes: 64 << 10,
        cache_write_attempts: 4,
        cache_read_attempts: 4,
        // Deterministic and fast: retries do not wait.
        cache_write_backoff_us: 0,
        origin_write_attempts: 4,
        origin_read_attempts: 3,
        page_cache_reads: true,
        origin_queue_depth: 64,
        // A write out of room whose write-back fails fails at once.
        space_wait_for_writeback_ms: 0,
        // Barriers overlap in the tests (the daemon's default is 1), so the
        // paths of two in flight stay covered.
        barriers_in_flight_max: 2,
    }
}

pub fn open_opts() -> OpenOptions {
    OpenOptions {
        force_origin: false,
        config: config(),
    }
}

pub struct Rig {
    pub cache: SimDevice,
    pub origin: SimDevice,
    pub engine: Option<Engine>,
}

impl Rig {
    pub fn new(cache_bytes: u64, volume_blocks: u64) -> Rig {
        Self::with_format(cache_bytes, volume_blocks, false)
    }

    /// A rig whose cache keeps origin integrity tags, recalculated over the
    /// (zeroed) origin before returning.
    pub fn with_integrity(cache_bytes: u64, volume_blocks: u64) -> Rig {
        let rig = Self::with_format(cache_bytes, volume_blocks, true);
        rig.engine().recalc_all(|_| {}).expect("recalculation");
        rig
    }

    pub fn with_format(cache_bytes: u64, volume_blocks: u64, integrity: bool) -> Rig {
        let cache = SimDevice::new("cache", cache_bytes);
        let origin = SimDevice::new("origin", volume_blocks * BS);
        Engine::format(
            Arc::new(cache.clone()),
            Arc::new(origin.clone()),
            &FormatOptions {
                integrity,
                ..FormatOptions::default()
            },
        )
        .expect("format");
        let engine = Engine::open(
            Arc::new(cache.clone()),
            Arc::new(origin.clone()),
            &open_opts(),
        )
        .expect("open");
        Rig {
            cache,
            origin,
            engine: Some(engine),
        }
    }

    pub fn engine(&self) -> &Engine {
        self.engine.as_ref().expect("engine open")
    }

    /// Clean close and reopen on the same devices.
    pub fn reopen_clean(&mut self) {
        let e = self.engine.take().expect("engine open");
        e.close().expect("close");
        drop(e);
        self.engine = Some(open(&self.cache, &self.origin).expect("reopen"));
    }
}

/// Format `cache` over `origin` with the default options and open an
/// engine on them with [`open_opts`], shared by the threads of a test.
pub fn format_and_open(cache: Arc<dyn Device>, origin: &SimDevice) -> Arc<Engine> {
    format_and_open_with(cache, origin, config())
}

/// [`format_and_open`] with the engine configured by `config`.
pub fn format_and_open_with(
    cache: Arc<dyn Device>,
    origin: &SimDevice,
    config: EngineConfig,
) -> Arc<Engine> {
    let origin: Arc<dyn Device> = Arc::new(origin.clone());
    Engine::format(cache.clone(), origin.clone(), &FormatOptions::default()).expect("format");
    let opts = OpenOptions {
        config,
        ..open_opts()
    };
    Arc::new(Engine::open(cache, origin, &opts).expect("open"))
}

pub fn open(cache: &SimDevice, origin: &SimDevice) -> Result<Engine, cairn_engine::EngineError> {
    Engine::open(
        Arc::new(cache.clone()) as Arc<dyn Device>,
        Arc::new(origin.clone()) as Arc<dyn Device>,
        &open_opts(),
    )
}

#[derive(Debug, Clone)]
pub enum Op {
    Write {
        offset: u64,
        len: u64,
        fua: bool,
        seed: u64,
    },
    Read {
        offset: u64,
        len: u64,
    },
    Flush,
    Discard {
        offset: u64,
        len: u64,
    },
    Zero {
        offset: u64,
        len: u64,
    },
    WritebackStep,
    Drain,
    Checkpoint,
    ReopenClean,
    SetMode(cairn_engine::CacheMode),
}

/// Deterministic, distinct bytes for a write.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

pub struct Workload {
    rng: ChaCha8Rng,
    volume_blocks: u64,
    next_seed: u64,
    pub allow_reopen: bool,
    pub allow_mode_switch: bool,
    /// Writes across the whole volume instead of write-back steps, drains,
    /// checkpoints and reopens: with a volume larger than the log, live
    /// dirty data fills it and writers run write-back for space.
    pub keep_log_full: bool,
}

impl Workload {
    pub fn new(seed: u64, volume_blocks: u64) -> Workload {
        Workload {
            rng: ChaCha8Rng::seed_from_u64(seed),
            volume_blocks,
            next_seed: seed << 20,
            allow_reopen: true,
            allow_mode_switch: false,
            keep_log_full: false,
        }
    }

    fn extent(&mut self) -> (u64, u64) {
        let vol = self.volume_blocks * BS;
        // Small hot region half of the time, so blocks are overwritten often.
        let hot = !self.keep_log_full && self.rng.gen_bool(0.5);
        let span_blocks = if hot {
            (self.volume_blocks / 8).max(4)
        } else {
            self.volume_blocks
        };
        match self.rng.gen_range(0..10) {
            0..=6 => {
                let blocks = self.rng.gen_range(1..=8u64).min(span_blocks);
                let lba = self.rng.gen_range(0..=span_blocks - blocks);
                (lba * BS, blocks * BS)
            }
            7..=8 => {
                let sectors = self.rng.gen_range(1..=16u64);
                let max_start = span_blocks * BS / 512 - sectors;
                (self.rng.gen_range(0..=max_start) * 512, sectors * 512)
            }
            _ => {
                let len = self.rng.gen_range(1..=3 * BS);
                let start = self.rng.gen_range(0..=(span_blocks * BS - len));
                (start.min(vol - len), len)
            }
        }
    }

    pub fn next_op(&mut self) -> Op {
        let roll = self.rng.gen_range(0..1000);
        let roll = if self.keep_log_full && (850..995).contains(&roll) {
            // A write instead (a few checkpoints and reopens stay).
            0
        } else {
            roll
        };
        match roll {
            0..=449 => {
                let (offset, len) = self.extent();
                self.next_seed += 1;
                Op::Write {
                    offset,
                    len,
                    fua: self.rng.gen_bool(0.05),
                    seed: self.next_seed,
                }
            }
            450..=719 => {
                let (offset, len) = self.extent();
                Op::Read { offset, len }
            }
            720..=819 => Op::Flush,
            820..=849 => {
                let (offset, len) = self.extent();
                Op::Discard { offset, len }
            }
            850..=879 => {
                let (offset, len) = self.extent();
                Op::Zero { offset, len }
            }
            880..=969 => Op::WritebackStep,
            970..=979 => Op::Drain,
            980..=984 => Op::Checkpoint,
            985..=989 if self.allow_mode_switch => {
                // Mostly back to write-back, so every mode sees traffic.
                let modes = cairn_engine::CacheMode::ALL;
                let m = if self.rng.gen_bool(0.4) {
                    modes[0]
                } else {
                    modes[self.rng.gen_range(1..4)]
                };
                Op::SetMode(m)
            }
            985..=989 => Op::Checkpoint,
            _ if self.allow_reopen => Op::ReopenClean,
            _ => Op::Flush,
        }
    }
}

/// The reference model: the volume as a byte image.
#[derive(Clone)]
pub struct Model {
    pub image: Vec<u8>,
}

impl Model {
    pub fn new(volume_blocks: u64) -> Model {
        Model {
            image: vec![0u8; (volume_blocks * BS) as usize],
        }
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) {
        self.image[offset as usize..offset as usize + data.len()].copy_from_slice(data);
    }

    /// Discard zeroes whole blocks only; partial edges are untouched.
    pub fn discard(&mut self, offset: u64, len: u64) {
        let first = offset.div_ceil(BS);
        let end = (offset + len) / BS;
        if first < end {
            self.image[(first * BS) as usize..(end * BS) as usize].fill(0);
        }
    }

    pub fn zero(&mut self, offset: u64, len: u64) {
        self.image[offset as usize..(offset + len) as usize].fill(0);
    }

    pub fn block(&self, lba: u64) -> &[u8] {
        &self.image[(lba * BS) as usize..((lba + 1) * BS) as usize]
    }
}

/// Apply one workload operation to the engine and the model, checking what
/// can be checked right away: reads against the model, and after a drain or
/// a switch away from write-back, the origin against the model.
pub fn apply_op(rig: &mut Rig, model: &mut Model, op: &Op, ctx: &dyn Fn() -> String) {
    use cairn_engine::CacheMode;
    match op {
        Op::Write {
            offset,
            len,
            fua,
            seed: s,
        } => {
            let data = pattern(*s, *len as usize);
            rig.engine()
                .write(*offset, &data, *fua)
                .unwrap_or_else(|e| panic!("{}: {e}", ctx()));
            model.write(*offset, &data);
        }
        Op::Read { offset, len } => {
            let mut buf = vec![0u8; *len as usize];
            rig.engine()
                .read(*offset, &mut buf)
                .unwrap_or_else(|e| panic!("{}: {e}", ctx()));
            let want = &model.image[*offset as usize..(*offset + *len) as usize];
            if buf != want {
                let at = buf.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
                panic!("{}: divergence at byte {}", ctx(), *offset + at as u64);
            }
        }
        Op::Flush => rig
            .engine()
            .flush()
            .unwrap_or_else(|e| panic!("{}: {e}", ctx())),
        Op::Discard { offset, len } => {
            rig.engine()
                .discard(*offset, *len)
                .unwrap_or_else(|e| panic!("{}: {e}", ctx()));
            model.discard(*offset, *len);
        }
        Op::Zero { offset, len } => {
            rig.engine()
                .write_zeroes(*offset, *len)
                .unwrap_or_else(|e| panic!("{}: {e}", ctx()));
            model.zero(*offset, *len);
        }
        Op::WritebackStep => {
            rig.engine()
                .writeback_step()
                .unwrap_or_else(|e| panic!("{}: {e}", ctx()));
        }
        Op::Drain => {
            let p = rig
                .engine()
                .drain()
                .unwrap_or_else(|e| panic!("{}: {e}", ctx()));
            assert_eq!(p.dirty_blocks, 0, "{}", ctx());
            // Drained: the origin alone is the volume.
            assert!(
                rig.origin.live_image() == model.image,
                "{}: origin differs after drain",
                ctx()
            );
        }
        Op::Checkpoint => rig
            .engine()
            .checkpoint()
            .unwrap_or_else(|e| panic!("{}: {e}", ctx())),
        Op::ReopenClean => rig.reopen_clean(),
        Op::SetMode(m) => {
            let p = rig
                .engine()
                .set_mode(*m, |_| {})
                .unwrap_or_else(|e| panic!("{}: {e}", ctx()));
            if *m != CacheMode::WriteBack {
                // Leaving write-back drains: the origin is the volume.
                assert_eq!(p.dirty_blocks, 0, "{}", ctx());
                assert!(
                    rig.origin.live_image() == model.image,
                    "{}: origin differs after switching to {}",
                    ctx(),
                    m.name()
                );
            }
        }
    }
}

pub fn read_volume(engine: &Engine) -> Result<Vec<u8>, cairn_engine::EngineError> {
    let mut buf = vec![0u8; engine.size_bytes() as usize];
    // In pieces, as a client would.
    for (i, chunk) in buf.chunks_mut(64 * BS as usize).enumerate() {
        engine.read(i as u64 * 64 * BS, chunk)?;
    }
    Ok(buf)
}

/// The tests' external tools are not needed here, but the seed and a
/// one-line reproduction go to the output on failure.
pub fn repro(test: &str, seed: u64) -> String {
    format!("reproduce: CAIRN_SEED={seed} cargo test --release -p cairn-engine --test {test}")
}

pub fn seeds(default_count: u64) -> Vec<u64> {
    if let Ok(s) = std::env::var("CAIRN_SEED") {
        if let Ok(seed) = s.parse() {
            return vec![seed];
        }
    }
    let count = std::env::var("CAIRN_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_count);
    (1..=count).collect()
}

/// Open `cache` with each volume on the one of `origins` whose identity
/// its table entry records (a volume whose origin is not given is an
/// error, as the daemon reports it).
pub fn open_by_identity(
    cache: &SimDevice,
    origins: &[&SimDevice],
) -> Result<Engine, cairn_engine::EngineError> {
    let by_identity: std::collections::HashMap<String, SimDevice> = origins
        .iter()
        .map(|o| (o.identity(), (*o).clone()))
        .collect();
    Engine::open_volumes(
        Arc::new(cache.clone()),
        &mut |v: &cairn_engine::VolumeEntry| {
            by_identity
                .get(&v.origin_identity)
                .map(|o| Arc::new(o.clone()) as Arc<dyn Device>)
                .ok_or_else(|| cairn_engine::EngineError::VolumeOriginMissing {
                    name: v.name.clone(),
                    origin: v.origin_identity.clone(),
                })
        },
        &open_opts(),
    )
}

/// Run `f` on a thread of its own: its result, or `None` if it did not
/// return within `timeout` (it is waiting for something that never comes;
/// the thread is left behind).
pub fn finishes_within<T: Send + 'static>(
    timeout: std::time::Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(timeout).ok()
}

/// `device` fails the operations of `kinds` on blocks `[first, end)` (the
/// flushes: every one, whatever the range), once or from now on.
pub fn fail_blocks(
    device: &SimDevice,
    kinds: cairn_device::OpKinds,
    (first, end): (u64, u64),
    mode: cairn_device::FaultMode,
) {
    device.fail_range(cairn_device::RangeFault {
        kinds,
        start: first * BS,
        end: end * BS,
        mode,
    });
}
