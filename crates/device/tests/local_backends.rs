//! The local backends (pread/pwrite, io_uring with O_DIRECT, io_uring
//! buffered) through the public API: every test runs against each of them,
//! chosen with a constructor parameter so tests never race on the
//! environment. One test checks the environment variable in a child process.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cairn_device::{
    open_local, open_local_with, Device, DeviceError, IoBackend, LocalOptions, OpenMode,
    UringOptions, IO_BACKEND_ENV,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const DEVICE_BYTES: u64 = 16 << 20;

struct TempDevice {
    dir: PathBuf,
    path: PathBuf,
}

impl TempDevice {
    fn new(tag: &str, size_bytes: u64) -> TempDevice {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        // The target directory lives on a real disk filesystem, where
        // O_DIRECT works.
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "cairn-local-{}-{}-{}",
            std::process::id(),
            tag,
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("dev.img");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(size_bytes)
            .unwrap();
        TempDevice { dir, path }
    }
}

impl Drop for TempDevice {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[derive(Debug, Clone, Copy)]
enum Flavor {
    Pread,
    UringDirect,
    UringBuffered,
}

const FLAVORS: [Flavor; 3] = [Flavor::Pread, Flavor::UringDirect, Flavor::UringBuffered];

fn options(flavor: Flavor) -> LocalOptions {
    match flavor {
        Flavor::Pread => LocalOptions {
            backend: IoBackend::Pread,
            ..LocalOptions::default()
        },
        Flavor::UringDirect => LocalOptions {
            backend: IoBackend::Uring,
            uring: UringOptions {
                // A small queue so batches larger than the ring are covered.
                queue_depth: 8,
                ring_count: 2,
                direct_io: true,
            },
        },
        Flavor::UringBuffered => LocalOptions {
            backend: IoBackend::Uring,
            uring: UringOptions {
                direct_io: false,
                ..UringOptions::default()
            },
        },
    }
}

fn open(flavor: Flavor, path: &Path) -> Box<dyn Device> {
    let device = open_local_with(path, OpenMode::Exclusive, &options(flavor)).unwrap();
    let expected: &[&str] = match flavor {
        Flavor::Pread => &["pread"],
        // On a filesystem without O_DIRECT this falls back to buffered.
        Flavor::UringDirect => &["uring-direct", "uring-buffered"],
        Flavor::UringBuffered => &["uring-buffered"],
    };
    assert!(
        expected.contains(&device.backend()),
        "{flavor:?} opened {}",
        device.backend()
    );
    device
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen()).collect()
}

/// A buffer whose data starts `misalign` bytes into an allocation aligned to
/// 4 KiB, so O_DIRECT has to bounce it.
struct Misaligned {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl Misaligned {
    fn new(len: usize, misalign: usize) -> Misaligned {
        let storage = vec![0u8; len + 4096 + misalign];
        let base = storage.as_ptr() as usize;
        let start = (4096 - base % 4096) % 4096 + misalign;
        Misaligned {
            storage,
            start,
            len,
        }
    }

    fn get(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }

    fn get_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

fn read_vec(device: &dyn Device, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    device.read_at(offset, &mut buf).unwrap();
    buf
}

#[test]
fn uring_direct_is_used_where_the_filesystem_supports_it() {
    let temp = TempDevice::new("direct-probe", DEVICE_BYTES);
    let direct_works = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags_direct()
        .open(&temp.path)
        .is_ok();
    let device = open(Flavor::UringDirect, &temp.path);
    if direct_works {
        assert_eq!(device.backend(), "uring-direct");
    } else {
        eprintln!(
            "note: {} refuses O_DIRECT; tested the buffered fallback",
            temp.path.display()
        );
        assert_eq!(device.backend(), "uring-buffered");
    }
}

trait CustomFlagsDirect {
    fn custom_flags_direct(&mut self) -> &mut Self;
}

impl CustomFlagsDirect for std::fs::OpenOptions {
    fn custom_flags_direct(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.custom_flags(libc::O_DIRECT)
    }
}

#[test]
fn aligned_and_unaligned_reads_and_writes() {
    for flavor in FLAVORS {
        let temp = TempDevice::new("rw", DEVICE_BYTES);
        let device = open(flavor, &temp.path);
        assert_eq!(device.size_bytes(), DEVICE_BYTES);

        // Aligned offset, aligned memory (a large Vec is page aligned by the
        // allocator more often than not; both cases are covered below).
        let data = pattern(1, 64 << 10);
        device.write_at(1 << 20, &data).unwrap();
        assert_eq!(
            read_vec(device.as_ref(), 1 << 20, data.len()),
            data,
            "{flavor:?}"
        );

        // Aligned offset and length, memory off by 1..511 bytes: bounced.
        for (i, misalign) in [1usize, 8, 100, 511].into_iter().enumerate() {
            let offset = (2 << 20) + (i as u64) * (64 << 10);
            let mut src = Misaligned::new(12288, misalign);
            src.get_mut()
                .copy_from_slice(&pattern(10 + i as u64, 12288));
            device.write_at(offset, src.get()).unwrap();
            let mut dst = Misaligned::new(12288, misalign + 3);
            device.read_at(offset, dst.get_mut()).unwrap();
            assert_eq!(dst.get(), src.get(), "{flavor:?} misalign {misalign}");
        }

        // An unaligned memory buffer larger than one bounce chunk (1 MiB).
        let mut big = Misaligned::new(3 << 20, 7);
        big.get_mut().copy_from_slice(&pattern(20, 3 << 20));
        device.write_at(4 << 20, big.get()).unwrap();
        let mut big_back = Misaligned::new(3 << 20, 9);
        device.read_at(4 << 20, big_back.get_mut()).unwrap();
        assert!(big_back.get() == big.get(), "{flavor:?} big bounced I/O");

        // Unaligned offsets and lengths (served outside O_DIRECT).
        device
            .write_at(8 * 4096 + 100, b"hello, unaligned world")
            .unwrap();
        assert_eq!(
            read_vec(device.as_ref(), 8 * 4096 + 100, 22),
            b"hello, unaligned world",
            "{flavor:?}"
        );
        // ... and an aligned read over it sees the unaligned write.
        let block = read_vec(device.as_ref(), 8 * 4096, 4096);
        assert_eq!(&block[100..122], b"hello, unaligned world", "{flavor:?}");
        assert!(block[..100].iter().all(|&b| b == 0));

        // Aligned write over the same block, then an unaligned read of it.
        let fresh = pattern(30, 4096);
        device.write_at(8 * 4096, &fresh).unwrap();
        assert_eq!(
            read_vec(device.as_ref(), 8 * 4096 + 1, 10),
            fresh[1..11].to_vec(),
            "{flavor:?}"
        );

        // Out of range is refused without I/O.
        let mut past = vec![0u8; 4096];
        assert!(matches!(
            device.read_at(DEVICE_BYTES - 512, &mut past),
            Err(DeviceError::OutOfRange { .. })
        ));
        assert!(matches!(
            device.write_at(DEVICE_BYTES, &past),
            Err(DeviceError::OutOfRange { .. })
        ));
        device.flush().unwrap();
    }
}

#[test]
fn vectored_and_batched_io() {
    for flavor in FLAVORS {
        let temp = TempDevice::new("batch", DEVICE_BYTES);
        let device = open(flavor, &temp.path);

        // Vectored write of aligned pieces (one writev).
        let a = pattern(40, 4096);
        let b = pattern(41, 8192);
        device.write_vectored_at(0, &[&a, &b]).unwrap();
        let back = read_vec(device.as_ref(), 0, 12288);
        assert_eq!(&back[..4096], &a[..]);
        assert_eq!(&back[4096..], &b[..]);

        // Vectored write of odd-sized pieces whose total is aligned
        // (coalesced through bounce buffers), plus the flush in one call.
        let pieces: Vec<Vec<u8>> = [100usize, 3000, 996, 4096, 1]
            .iter()
            .enumerate()
            .map(|(i, &n)| pattern(50 + i as u64, n))
            .collect();
        let mut tail = pieces.clone();
        tail.push(pattern(60, 8192 - 1)); // total is 16 KiB
        let refs: Vec<&[u8]> = tail.iter().map(|p| p.as_slice()).collect();
        device.write_vectored_and_flush(64 << 10, &refs).unwrap();
        let expected: Vec<u8> = tail.concat();
        assert_eq!(expected.len(), 16384);
        assert_eq!(
            read_vec(device.as_ref(), 64 << 10, expected.len()),
            expected,
            "{flavor:?}"
        );

        // Vectored write at an unaligned offset.
        device
            .write_vectored_at(200_001, &[b"abc", b"defg"])
            .unwrap();
        assert_eq!(read_vec(device.as_ref(), 200_001, 7), b"abcdefg");

        // More writes in one batch than the ring holds (queue depth 8 for
        // the direct flavor), mixed aligned and unaligned, then read_many.
        let writes: Vec<(u64, Vec<u8>)> = (0..100u64)
            .map(|i| {
                let offset = (1 << 20) + i * 8192 + if i % 10 == 3 { 17 } else { 0 };
                let len = if i % 7 == 0 { 4096 * 2 } else { 4096 };
                (
                    offset,
                    pattern(100 + i, len - if i % 10 == 3 { 17 } else { 0 }),
                )
            })
            .collect();
        let requests: Vec<(u64, &[u8])> = writes.iter().map(|(o, d)| (*o, d.as_slice())).collect();
        device.write_many_and_flush(&requests).unwrap();
        let mut buffers: Vec<Vec<u8>> = writes.iter().map(|(_, d)| vec![0u8; d.len()]).collect();
        {
            let mut reads: Vec<(u64, &mut [u8])> = writes
                .iter()
                .zip(buffers.iter_mut())
                .map(|((o, _), b)| (*o, b.as_mut_slice()))
                .collect();
            device.read_many(&mut reads).unwrap();
        }
        for ((offset, data), back) in writes.iter().zip(&buffers) {
            assert_eq!(back, data, "{flavor:?} offset {offset}");
        }
        device.write_many(&[]).unwrap();
        device.read_many(&mut []).unwrap();
        device.write_vectored_and_flush(0, &[]).unwrap();

        // Several vectored runs in one call (write-back's origin writes):
        // aligned runs of aligned and misaligned memory, and one run at an
        // unaligned offset; then the same through the page cache reads.
        let mut misaligned = Misaligned::new(4096, 3);
        misaligned.get_mut().copy_from_slice(&pattern(70, 4096));
        let run_a = [pattern(71, 4096), pattern(72, 8192)];
        let run_c = [pattern(73, 10), pattern(74, 5)];
        let a_refs: Vec<&[u8]> = run_a.iter().map(|p| p.as_slice()).collect();
        let b_refs: Vec<&[u8]> = vec![misaligned.get(), &run_a[0]];
        let c_refs: Vec<&[u8]> = run_c.iter().map(|p| p.as_slice()).collect();
        let runs: Vec<(u64, &[&[u8]])> = vec![
            (2 << 20, &a_refs),
            ((2 << 20) + 65536, &b_refs),
            ((2 << 20) + 300_001, &c_refs),
        ];
        device.write_many_vectored(&runs).unwrap();
        device.flush().unwrap();
        for (offset, bufs) in &runs {
            let expected: Vec<u8> = bufs.concat();
            assert_eq!(
                read_vec(device.as_ref(), *offset, expected.len()),
                expected,
                "{flavor:?} run at {offset}"
            );
            let mut cached = vec![0u8; expected.len()];
            device
                .read_many_cacheable(&mut [(*offset, cached.as_mut_slice())])
                .unwrap();
            assert_eq!(cached, expected, "{flavor:?} cacheable read at {offset}");
        }
        device.write_many_vectored(&[]).unwrap();
    }
}

#[test]
fn write_zeroes_and_discard() {
    for flavor in FLAVORS {
        let temp = TempDevice::new("zero", DEVICE_BYTES);
        let device = open(flavor, &temp.path);
        let ones = vec![0xffu8; 3 << 20];
        device.write_at(0, &ones).unwrap();

        device.write_zeroes(4096, (2 << 20) + 8192).unwrap();
        let back = read_vec(device.as_ref(), 0, 3 << 20);
        assert!(back[..4096].iter().all(|&b| b == 0xff), "{flavor:?}");
        assert!(
            back[4096..4096 + (2 << 20) + 8192].iter().all(|&b| b == 0),
            "{flavor:?}"
        );
        assert!(
            back[4096 + (2 << 20) + 8192..].iter().all(|&b| b == 0xff),
            "{flavor:?}"
        );

        // Unaligned zeroing.
        device.write_zeroes(10, 5).unwrap();
        let head = read_vec(device.as_ref(), 0, 20);
        assert!(head[..10].iter().all(|&b| b == 0xff));
        assert!(head[10..15].iter().all(|&b| b == 0));
        assert!(head[15..].iter().all(|&b| b == 0xff));

        // Discard is a hint: it succeeds, keeps the size, and the range
        // stays readable and writable.
        device.discard(1 << 20, 1 << 20).unwrap();
        let _ = read_vec(device.as_ref(), 1 << 20, 4096);
        device.write_at(1 << 20, &ones[..4096]).unwrap();
        assert!(read_vec(device.as_ref(), 1 << 20, 4096)
            .iter()
            .all(|&b| b == 0xff));
        assert_eq!(device.size_bytes(), DEVICE_BYTES);
        assert!(matches!(
            device.discard(DEVICE_BYTES, 1),
            Err(DeviceError::OutOfRange { .. })
        ));
        assert!(matches!(
            device.write_zeroes(DEVICE_BYTES - 1, 2),
            Err(DeviceError::OutOfRange { .. })
        ));
        device.flush().unwrap();
    }
}

#[test]
fn data_survives_reopen_across_backends() {
    let temp = TempDevice::new("reopen", DEVICE_BYTES);
    let mut expected = Vec::new();
    for (i, flavor) in FLAVORS.iter().enumerate() {
        let device = open(*flavor, &temp.path);
        for (offset, data) in &expected {
            assert_eq!(
                &read_vec(device.as_ref(), *offset, 8192),
                data,
                "{flavor:?} reads older data"
            );
        }
        let data = pattern(200 + i as u64, 8192);
        let offset = i as u64 * (1 << 20);
        device
            .write_vectored_and_flush(offset, &[&data[..4096], &data[4096..]])
            .unwrap();
        expected.push((offset, data));
    }
    let raw = std::fs::read(&temp.path).unwrap();
    for (offset, data) in &expected {
        assert_eq!(&raw[*offset as usize..*offset as usize + 8192], &data[..]);
    }
}

#[test]
fn exclusive_lock_is_kept_by_every_backend() {
    for flavor in FLAVORS {
        let temp = TempDevice::new("lock", 1 << 20);
        let first = open(flavor, &temp.path);
        for other in FLAVORS {
            let second = open_local_with(&temp.path, OpenMode::Exclusive, &options(other));
            assert!(
                matches!(second, Err(DeviceError::Busy { .. })),
                "{flavor:?} then {other:?}"
            );
        }
        drop(first);
        let shared_a = open_local_with(&temp.path, OpenMode::Shared, &options(flavor)).unwrap();
        let shared_b = open_local_with(&temp.path, OpenMode::Shared, &options(flavor)).unwrap();
        assert_eq!(shared_a.identity(), shared_b.identity());
        assert!(shared_a.identity().starts_with("file:/"));
    }
}

/// Many threads hammer disjoint ranges of one device with every kind of I/O,
/// each keeping a model of its range; then everything is verified, through
/// the same device and after reopening with another backend.
#[test]
fn concurrent_threads_on_disjoint_ranges() {
    const THREADS: usize = 8;
    const RANGE_BYTES: u64 = 1 << 20;
    const ROUNDS: usize = 150;
    for flavor in FLAVORS {
        let temp = TempDevice::new("hammer", THREADS as u64 * RANGE_BYTES);
        let device: Arc<dyn Device> = Arc::from(open(flavor, &temp.path));
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let device = Arc::clone(&device);
                std::thread::spawn(move || {
                    let base = t as u64 * RANGE_BYTES;
                    let mut model = vec![0u8; RANGE_BYTES as usize];
                    let mut rng = ChaCha8Rng::seed_from_u64(1000 + t as u64);
                    for round in 0..ROUNDS {
                        let block = rng.gen_range(0..(RANGE_BYTES / 4096 - 4));
                        let offset = block * 4096;
                        match rng.gen_range(0..6) {
                            0 => {
                                let data: Vec<u8> = (0..4096).map(|_| rng.gen()).collect();
                                device.write_at(base + offset, &data).unwrap();
                                model[offset as usize..offset as usize + 4096]
                                    .copy_from_slice(&data);
                            }
                            1 => {
                                let a: Vec<u8> = (0..4096).map(|_| rng.gen()).collect();
                                let b: Vec<u8> = (0..8192).map(|_| rng.gen()).collect();
                                device.write_vectored_at(base + offset, &[&a, &b]).unwrap();
                                model[offset as usize..offset as usize + 4096].copy_from_slice(&a);
                                model[offset as usize + 4096..offset as usize + 12288]
                                    .copy_from_slice(&b);
                            }
                            2 => {
                                let other = rng.gen_range(0..(RANGE_BYTES / 4096 - 1)) * 4096;
                                let a: Vec<u8> = (0..4096).map(|_| rng.gen()).collect();
                                let b: Vec<u8> = (0..4096).map(|_| rng.gen()).collect();
                                if other == offset {
                                    continue;
                                }
                                let writes =
                                    [(base + offset, a.as_slice()), (base + other, b.as_slice())];
                                if round % 2 == 0 {
                                    device.write_many(&writes).unwrap();
                                } else {
                                    device.write_many_and_flush(&writes).unwrap();
                                }
                                model[offset as usize..offset as usize + 4096].copy_from_slice(&a);
                                model[other as usize..other as usize + 4096].copy_from_slice(&b);
                            }
                            3 => {
                                // Unaligned write inside the block.
                                let at = offset as usize + rng.gen_range(0..4000);
                                let data: Vec<u8> =
                                    (0..rng.gen_range(1..96)).map(|_| rng.gen()).collect();
                                device.write_at(base + at as u64, &data).unwrap();
                                model[at..at + data.len()].copy_from_slice(&data);
                            }
                            4 => {
                                device.write_zeroes(base + offset, 8192).unwrap();
                                model[offset as usize..offset as usize + 8192].fill(0);
                            }
                            _ => {
                                let mut a = vec![0u8; 4096];
                                let mut b = vec![0u8; 8192];
                                let other = rng.gen_range(0..(RANGE_BYTES / 4096 - 2)) * 4096;
                                {
                                    let mut reads = [
                                        (base + offset, a.as_mut_slice()),
                                        (base + other, b.as_mut_slice()),
                                    ];
                                    device.read_many(&mut reads).unwrap();
                                }
                                assert_eq!(a, model[offset as usize..offset as usize + 4096]);
                                assert_eq!(b, model[other as usize..other as usize + 8192]);
                            }
                        }
                        if round % 50 == 49 {
                            device.flush().unwrap();
                        }
                    }
                    model
                })
            })
            .collect();
        let models: Vec<Vec<u8>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        device.flush().unwrap();
        for (t, model) in models.iter().enumerate() {
            let got = read_vec(
                device.as_ref(),
                t as u64 * RANGE_BYTES,
                RANGE_BYTES as usize,
            );
            assert!(got == *model, "{flavor:?} thread {t} range differs");
        }
        drop(device);
        let reopened = open(Flavor::Pread, &temp.path);
        for (t, model) in models.iter().enumerate() {
            let got = read_vec(
                reopened.as_ref(),
                t as u64 * RANGE_BYTES,
                RANGE_BYTES as usize,
            );
            assert!(
                got == *model,
                "{flavor:?} thread {t} range differs after reopen"
            );
        }
    }
}

/// `open_local` reads CAIRN_IO_BACKEND. Setting the variable in this process
/// would race with other tests, so the check runs in a child process: this
/// test binary again, running only `env_child`.
#[test]
fn env_var_selects_the_backend() {
    let exe = std::env::current_exe().unwrap();
    for (value, expected) in [
        ("pread", "pread"),
        ("uring", "uring-direct|uring-buffered"),
        ("auto", "uring-direct|uring-buffered"),
        ("bogus", "error"),
    ] {
        let output = std::process::Command::new(&exe)
            .args([
                "env_child",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(IO_BACKEND_ENV, value)
            .env("CAIRN_TEST_EXPECT_BACKEND", expected)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{IO_BACKEND_ENV}={value}: child failed:\n{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            String::from_utf8_lossy(&output.stdout).contains("1 passed"),
            "the child test did not run"
        );
    }
}

#[test]
#[ignore = "run by env_var_selects_the_backend in a child process"]
fn env_child() {
    let expected =
        std::env::var("CAIRN_TEST_EXPECT_BACKEND").expect("run by env_var_selects_the_backend");
    let temp = TempDevice::new("env", 1 << 20);
    match open_local(&temp.path, OpenMode::Exclusive) {
        Ok(device) => {
            assert!(
                expected.split('|').any(|e| e == device.backend()),
                "expected {expected}, got {}",
                device.backend()
            );
            device.write_at(0, &[7u8; 4096]).unwrap();
            device.flush().unwrap();
        }
        Err(err) => {
            assert_eq!(expected, "error", "unexpected error: {err}");
            assert!(err.to_string().contains(IO_BACKEND_ENV), "{err}");
        }
    }
}

/// `read_many_cacheable` may read through the page cache while writes go
/// around it (O_DIRECT): on a regular file, a read that starts after a
/// write completed must see that write, never a page cached before it
/// (Linux invalidates the range again when a direct write completes). One
/// thread rewrites blocks with a rising generation (every way the engine
/// writes: single, vectored, batched, with and without a flush), marking
/// each block before its write starts and publishing the generation once
/// the write returned. Readers check each block they read: with no write to
/// it started since the last one published before the read, it must be
/// whole and exactly that generation; otherwise it may be torn (the
/// engine's checksums catch that) but never older than what was published.
#[test]
fn cacheable_reads_see_every_completed_write() {
    for flavor in FLAVORS {
        let temp = TempDevice::new("cacheable", (HAMMER_BLOCKS * 4096) as u64);
        let device: Arc<dyn Device> = Arc::from(open(flavor, &temp.path));
        let report = hammer_cacheable_reads(device);
        assert_eq!(report.stale, 0, "{flavor:?}: {report:?}");
        eprintln!("{flavor:?}: {report:?}");
    }
}

/// What [`hammer_cacheable_reads`] saw.
#[derive(Debug)]
pub struct HammerReport {
    pub writes: u64,
    pub reads: u64,
    /// Reads of a block a write was in flight on that mixed two versions.
    pub torn: u64,
    /// Reads older than a write that completed before the read started.
    pub stale: u64,
    /// Distinct (block, generation) versions those stale reads returned:
    /// roughly how many pages stayed cached across a write.
    pub stale_versions: u64,
}

const HAMMER_BLOCKS: usize = 32;

pub fn hammer_cacheable_reads(device: Arc<dyn Device>) -> HammerReport {
    use std::sync::atomic::AtomicU64;
    const BLOCKS: usize = HAMMER_BLOCKS;
    // The writer goes on until it wrote this many blocks and the readers
    // checked this many (bounded).
    const WRITES_WANTED: u64 = 3_000;
    const READS_WANTED: u64 = 50_000;
    const WRITES_MAX: u64 = 200_000;
    const READERS: usize = 2;
    fn block_of(generation: u64, index: usize) -> Vec<u8> {
        let mut block = vec![0u8; 4096];
        for word in block.chunks_mut(16) {
            word[..8].copy_from_slice(&generation.to_le_bytes());
            word[8..].copy_from_slice(&(index as u64).to_le_bytes());
        }
        block
    }
    /// The generation of a whole block, None if torn.
    fn generation_of(block: &[u8], index: usize) -> Option<u64> {
        let generation = u64::from_le_bytes(block[..8].try_into().unwrap());
        (block == block_of(generation, index).as_slice()).then_some(generation)
    }
    for index in 0..BLOCKS {
        device
            .write_at(index as u64 * 4096, &block_of(0, index))
            .unwrap();
    }
    let counters =
        || -> Arc<Vec<AtomicU64>> { Arc::new((0..BLOCKS).map(|_| AtomicU64::new(0)).collect()) };
    let (started, published) = (counters(), counters());
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    /// Stops the readers however this function ends (a failed assertion
    /// must not leave them spinning on the device).
    struct StopReaders(Arc<std::sync::atomic::AtomicBool>);
    impl Drop for StopReaders {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    let stop_readers = StopReaders(Arc::clone(&done));
    let reads_checked = Arc::new(AtomicU64::new(0));
    let readers: Vec<_> = (0..READERS)
        .map(|r| {
            let device = Arc::clone(&device);
            let (started, published) = (Arc::clone(&started), Arc::clone(&published));
            let done = Arc::clone(&done);
            let reads_checked = Arc::clone(&reads_checked);
            std::thread::spawn(move || {
                let reactor = (r % 2 == 1).then(|| {
                    let reactor = cairn_io::Reactor::new(&cairn_io::ReactorOptions::default())
                        .expect("io_uring available");
                    (reactor, Arc::new(cairn_device::BufPool::new(1 << 20)))
                });
                let mut rng = ChaCha8Rng::seed_from_u64(77 + r as u64);
                let (mut reads, mut torn, mut stale) = (0u64, 0u64, 0u64);
                let mut versions = std::collections::HashSet::new();
                while !done.load(Ordering::Acquire) {
                    let picks: Vec<usize> = (0..rng.gen_range(1..8))
                        .map(|_| rng.gen_range(0..BLOCKS))
                        .collect();
                    let floors: Vec<u64> = picks
                        .iter()
                        .map(|&i| published[i].load(Ordering::Acquire))
                        .collect();
                    let mut bufs: Vec<Vec<u8>> = picks.iter().map(|_| vec![0u8; 4096]).collect();
                    match &reactor {
                        // Odd readers read as a connection's event loop
                        // does: from the page cache at once when it can,
                        // else through the ring.
                        Some((reactor, pool)) => {
                            for (&i, buf) in picks.iter().zip(bufs.iter_mut()) {
                                let mut data = pool.lend(4096);
                                data.set_len(4096);
                                let shared = cairn_device::SharedBuf::new(data);
                                let slice = shared.slice(0..4096);
                                let device = Arc::clone(&device);
                                let (result, slice) = reactor.run(async move {
                                    device.read_into_cacheable(i as u64 * 4096, slice).await
                                });
                                result.unwrap();
                                drop(slice);
                                let data = shared.into_inner().ok().unwrap();
                                buf.copy_from_slice(&data);
                            }
                        }
                        None => {
                            let mut requests: Vec<(u64, &mut [u8])> = picks
                                .iter()
                                .zip(bufs.iter_mut())
                                .map(|(&i, b)| (i as u64 * 4096, b.as_mut_slice()))
                                .collect();
                            device.read_many_cacheable(&mut requests).unwrap();
                        }
                    }
                    for ((&i, &floor), buf) in picks.iter().zip(&floors).zip(&bufs) {
                        let newest = started[i].load(Ordering::Acquire);
                        match generation_of(buf, i) {
                            Some(seen) if seen < floor => {
                                stale += 1;
                                versions.insert((i, seen));
                            }
                            Some(seen) => assert!(
                                seen <= newest,
                                "block {i}: read generation {seen}, newest started {newest}"
                            ),
                            None if newest > floor => torn += 1,
                            None => {
                                stale += 1;
                                versions.insert((i, u64::MAX));
                            }
                        }
                    }
                    reads += picks.len() as u64;
                    reads_checked.fetch_add(picks.len() as u64, Ordering::Relaxed);
                }
                (reads, torn, stale, versions)
            })
        })
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let mut writes = 0u64;
    for generation in 1..=WRITES_MAX {
        if generation > WRITES_WANTED && reads_checked.load(Ordering::Relaxed) >= READS_WANTED {
            break;
        }
        writes = generation;
        let i = rng.gen_range(0..BLOCKS);
        let block = block_of(generation, i);
        let at = i as u64 * 4096;
        started[i].store(generation, Ordering::Release);
        match generation % 4 {
            0 => device.write_at(at, &block).unwrap(),
            1 => device.write_vectored_at(at, &[&block]).unwrap(),
            2 => device.write_many(&[(at, block.as_slice())]).unwrap(),
            _ => device.write_vectored_and_flush(at, &[&block]).unwrap(),
        }
        published[i].store(generation, Ordering::Release);
    }
    drop(stop_readers);
    let mut report = HammerReport {
        writes,
        reads: 0,
        torn: 0,
        stale: 0,
        stale_versions: 0,
    };
    let mut versions = std::collections::HashSet::new();
    for handle in readers {
        let (r, t, s, v) = handle.join().unwrap();
        report.reads += r;
        report.torn += t;
        report.stale += s;
        versions.extend(v);
    }
    report.stale_versions = versions.len() as u64;
    assert!(report.reads >= READS_WANTED, "{report:?}");
    // Dropping the cached pages makes a cacheable read see the medium.
    for index in 0..BLOCKS {
        let at = index as u64 * 4096;
        device.drop_cached_pages(at, 4096);
        let mut cached = vec![0u8; 4096];
        device
            .read_many_cacheable(&mut [(at, cached.as_mut_slice())])
            .unwrap();
        assert_eq!(cached, read_vec(device.as_ref(), at, 4096), "block {index}");
    }
    report
}

/// The same on a raw block device (a loop device over a file), where Linux
/// invalidates cached pages before an asynchronous direct write but not
/// after it. The backend drops the written ranges itself after each ring
/// write, but a drop cannot evict a page a racing read still holds locked,
/// so a stale page stays possible: with the drops, 0-4 stale reads in five
/// runs of 55k-484k reads; without them, 0-3542 stale reads from 0-3
/// stale versions per run of 3000 writes. The difference is too rare per
/// write for a bound that is both reliable and strict, so this test prints
/// the figures and checks only what must hold: no gross incoherence (at
/// most 1% of writes leave a stale version) and, at the end of the hammer,
/// that `drop_cached_pages` makes a cacheable read see the medium. The
/// engine's checksums are the guard against what remains (see
/// `fio_verify_with_the_cache_on_a_block_device`). Needs root and losetup;
/// skips without them (fails under CI=true).
#[test]
fn cacheable_reads_on_a_block_device() {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let skip = |why: &str| {
        assert!(
            !ci,
            "cacheable_reads_on_a_block_device: {why} (CI=true: not skipping)"
        );
        eprintln!("SKIP cacheable_reads_on_a_block_device: {why}");
    };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip("needs root for losetup");
    }
    let temp = TempDevice::new("loopdev", 1 << 20);
    let out = match std::process::Command::new("losetup")
        .args(["--find", "--show"])
        .arg(&temp.path)
        .output()
    {
        Ok(out) if out.status.success() => out,
        Ok(out) => {
            return skip(&format!(
                "losetup failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
        Err(e) => return skip(&format!("losetup not runnable: {e}")),
    };
    let loop_dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    struct Detach(String);
    impl Drop for Detach {
        fn drop(&mut self) {
            let _ = std::process::Command::new("losetup")
                .args(["-d", &self.0])
                .status();
        }
    }
    let _detach = Detach(loop_dev.clone());
    let device: Arc<dyn Device> = Arc::from(open(Flavor::UringDirect, Path::new(&loop_dev)));
    let report = hammer_cacheable_reads(device);
    eprintln!("{loop_dev}: {report:?}");
    assert!(
        report.stale_versions * 100 <= report.writes,
        "more than 1% of writes left a stale cached version: {report:?}"
    );
}

/// How many of this process's descriptors are open on `path`.
fn descriptors_on(path: &Path) -> usize {
    let target = std::fs::canonicalize(path).unwrap();
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .filter(|link| *link == target)
        .count()
}

/// io_uring devices opened for writing flush through 2 lanes, each its own
/// open file description (so a write-back error reaches every overlapping
/// fdatasync, see `Device::flush_lanes`); overlapping flushes in them all
/// succeed and cover the writes made before them. The pread backend and a
/// read-only device have one lane.
#[test]
fn flush_lanes_are_descriptors_of_their_own() {
    for flavor in FLAVORS {
        let temp = TempDevice::new("lanes", DEVICE_BYTES);
        let before = descriptors_on(&temp.path);
        let device: Arc<dyn Device> = Arc::from(open(flavor, &temp.path));
        let lanes = device.flush_lanes();
        let own_descriptors = match (flavor, device.backend()) {
            (Flavor::Pread, _) => {
                assert_eq!(lanes, 1, "{flavor:?}");
                1
            }
            (_, backend) => {
                assert_eq!(lanes, 2, "{flavor:?}");
                // The ring's descriptor, the buffered one beside a direct
                // one, and a descriptor per lane.
                lanes + if backend == "uring-direct" { 2 } else { 1 }
            }
        };
        assert_eq!(
            descriptors_on(&temp.path) - before,
            own_descriptors,
            "{flavor:?}"
        );

        let threads: Vec<_> = (0..lanes)
            .map(|lane| {
                let device = device.clone();
                std::thread::spawn(move || {
                    let data = pattern(lane as u64, 8192);
                    let at = lane as u64 * 8192;
                    device.write_vectored_inline(at, &[&data[..4096], &data[4096..]])?;
                    device.flush_lane(lane)
                })
            })
            .collect();
        for t in threads {
            t.join().expect("flushing thread").expect("flush lane");
        }
        for lane in 0..lanes {
            let got = read_vec(&*device, lane as u64 * 8192, 8192);
            assert!(got == pattern(lane as u64, 8192), "{flavor:?} lane {lane}");
        }
        drop(device);
        assert_eq!(descriptors_on(&temp.path), before, "{flavor:?}: closed");

        let read_only = open_local_with(&temp.path, OpenMode::ReadOnly, &options(flavor)).unwrap();
        assert_eq!(read_only.flush_lanes(), 1, "{flavor:?} read-only");
    }
}
