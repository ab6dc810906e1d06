//! A quick, fio-like comparison of the local backends on one file, printed
//! as a table with ratios to pread/pwrite. Not a test: it times things.
//!
//! Usage: cargo run --release -p cairn-device --example devbench -- [FILE] [SECONDS_PER_CASE]
//! FILE (default: a 256 MiB scratch file in the temp directory, removed
//! afterwards) is overwritten.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use cairn_device::{open_local_with, Device, IoBackend, LocalOptions, OpenMode, UringOptions};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const FILE_BYTES: u64 = 256 << 20;
const BLOCK_BYTES: usize = 4096;
const QUEUE_DEPTH: usize = 32;

/// A 4 KiB-aligned buffer, as the engine's block buffers will be.
fn aligned(len: usize) -> (Vec<u8>, usize) {
    let storage = vec![0u8; len + 4096];
    let start = (4096 - storage.as_ptr() as usize % 4096) % 4096;
    (storage, start)
}

struct Case {
    name: &'static str,
    run: fn(&dyn Device, Duration) -> (u64, u64), // (operations, bytes)
}

fn rand_read_qd1(device: &dyn Device, budget: Duration) -> (u64, u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let (mut storage, start) = aligned(BLOCK_BYTES);
    let buf = &mut storage[start..start + BLOCK_BYTES];
    let blocks = device.size_bytes() / BLOCK_BYTES as u64;
    let started = Instant::now();
    let mut ops = 0u64;
    while started.elapsed() < budget {
        for _ in 0..64 {
            let block = rng.gen_range(0..blocks);
            device
                .read_at(block * BLOCK_BYTES as u64, buf)
                .expect("read");
            ops += 1;
        }
    }
    (ops, ops * BLOCK_BYTES as u64)
}

fn rand_read_qd32(device: &dyn Device, budget: Duration) -> (u64, u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let (mut storage, start) = aligned(BLOCK_BYTES * QUEUE_DEPTH);
    let blocks = device.size_bytes() / BLOCK_BYTES as u64;
    let started = Instant::now();
    let mut ops = 0u64;
    while started.elapsed() < budget {
        let offsets: Vec<u64> = (0..QUEUE_DEPTH)
            .map(|_| rng.gen_range(0..blocks) * BLOCK_BYTES as u64)
            .collect();
        let mut requests: Vec<(u64, &mut [u8])> = offsets
            .iter()
            .copied()
            .zip(storage[start..start + BLOCK_BYTES * QUEUE_DEPTH].chunks_mut(BLOCK_BYTES))
            .collect();
        device.read_many(&mut requests).expect("read_many");
        ops += QUEUE_DEPTH as u64;
    }
    (ops, ops * BLOCK_BYTES as u64)
}

fn write_then_flush(device: &dyn Device, budget: Duration) -> (u64, u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (mut storage, start) = aligned(BLOCK_BYTES);
    storage[start..start + BLOCK_BYTES].fill(0x5a);
    let buf = &storage[start..start + BLOCK_BYTES];
    let blocks = device.size_bytes() / BLOCK_BYTES as u64;
    let started = Instant::now();
    let mut ops = 0u64;
    while started.elapsed() < budget {
        let block = rng.gen_range(0..blocks);
        device
            .write_vectored_and_flush(block * BLOCK_BYTES as u64, &[buf])
            .expect("write+flush");
        ops += 1;
    }
    (ops, ops * BLOCK_BYTES as u64)
}

fn seq_write_64k(device: &dyn Device, budget: Duration) -> (u64, u64) {
    const IO_BYTES: usize = 64 << 10;
    const BATCH: usize = 16;
    let (mut storage, start) = aligned(IO_BYTES * BATCH);
    storage[start..].fill(0xa5);
    let data = &storage[start..start + IO_BYTES * BATCH];
    let started = Instant::now();
    let mut ops = 0u64;
    let mut at = 0u64;
    while started.elapsed() < budget {
        let requests: Vec<(u64, &[u8])> = data
            .chunks(IO_BYTES)
            .enumerate()
            .map(|(i, chunk)| ((at + (i * IO_BYTES) as u64) % device.size_bytes(), chunk))
            .collect();
        device.write_many(&requests).expect("write_many");
        at = (at + (IO_BYTES * BATCH) as u64) % device.size_bytes();
        ops += BATCH as u64;
    }
    device.flush().expect("flush");
    (ops, ops * IO_BYTES as u64)
}

fn cpu_seconds() -> f64 {
    // SAFETY: an all-zero rusage is valid; getrusage fills it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a pointer to a live rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let given = args.next().map(PathBuf::from);
    let path = given.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("cairn-devbench-{}.img", std::process::id()))
    });
    let seconds: f64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(2.0);
    let budget = Duration::from_secs_f64(seconds);
    {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .expect("create the bench file");
        file.set_len(FILE_BYTES).expect("size the bench file");
        // Fill it so reads hit allocated blocks, not holes.
        let chunk = vec![0x11u8; 1 << 20];
        for i in 0..(FILE_BYTES >> 20) {
            std::os::unix::fs::FileExt::write_all_at(&file, &chunk, i << 20).expect("fill");
        }
        file.sync_all().expect("sync");
    }
    let backends = [
        ("pread", IoBackend::Pread, true),
        ("uring-direct", IoBackend::Uring, true),
        ("uring-buffered", IoBackend::Uring, false),
    ];
    let cases = [
        Case {
            name: "4k randread qd1",
            run: rand_read_qd1,
        },
        Case {
            name: "4k randread qd32",
            run: rand_read_qd32,
        },
        Case {
            name: "4k write+flush",
            run: write_then_flush,
        },
        Case {
            name: "64k seq write x16",
            run: seq_write_64k,
        },
    ];
    println!(
        "file {} ({} MiB), {seconds} s per case",
        path.display(),
        FILE_BYTES >> 20
    );
    println!(
        "{:<20} {:<15} {:>10} {:>9} {:>11} {:>8}",
        "case", "backend", "IOPS", "MiB/s", "CPU us/op", "vs pread"
    );
    for case in &cases {
        let mut pread_iops = 0.0;
        for (label, backend, direct_io) in backends {
            let options = LocalOptions {
                backend,
                uring: UringOptions {
                    direct_io,
                    ..UringOptions::default()
                },
            };
            let device = open_local_with(&path, OpenMode::Exclusive, &options).expect("open");
            let cpu_before = cpu_seconds();
            let started = Instant::now();
            let (ops, bytes) = (case.run)(device.as_ref(), budget);
            let elapsed = started.elapsed().as_secs_f64();
            let cpu_us_per_op = (cpu_seconds() - cpu_before) * 1e6 / ops.max(1) as f64;
            let iops = ops as f64 / elapsed;
            if label == "pread" {
                pread_iops = iops;
            }
            println!(
                "{:<20} {:<15} {:>10.0} {:>9.1} {:>11.1} {:>7.2}x",
                case.name,
                device.backend(),
                iops,
                bytes as f64 / elapsed / (1 << 20) as f64,
                cpu_us_per_op,
                iops / pread_iops.max(f64::MIN_POSITIVE)
            );
        }
    }
    if given.is_none() {
        let _ = std::fs::remove_file(&path);
    }
}
