//! Model-based test: random sequences of reads, writes (aligned and not),
//! FUA, flushes, discards, zeroes, write-back steps, drains, checkpoints and
//! clean reopens run against the engine and a plain byte-image model. Any
//! divergence fails with the seed and the operation index.

mod common;
use common::*;

fn run_seed(seed: u64, ops: usize, volume_blocks: u64) -> usize {
    run_seed_modes(seed, ops, volume_blocks, false)
}

fn run_seed_modes(seed: u64, ops: usize, volume_blocks: u64, modes: bool) -> usize {
    let mut rig = Rig::new(cache_bytes_small(), volume_blocks);
    let mut model = Model::new(volume_blocks);
    let mut wl = Workload::new(seed, volume_blocks);
    wl.allow_mode_switch = modes;
    for i in 0..ops {
        let op = wl.next_op();
        let ctx = || format!("seed {seed} op #{i} {op:?}; {}", repro("model", seed));
        apply_op(&mut rig, &mut model, &op, &ctx);
    }
    let vol = read_volume(rig.engine()).expect("final read");
    assert!(
        vol == model.image,
        "seed {seed}: final volume differs; {}",
        repro("model", seed)
    );
    rig.engine().drain().expect("final drain");
    assert!(
        rig.origin.live_image() == model.image,
        "seed {seed}: origin differs after final drain"
    );
    rig.reopen_clean();
    let vol = read_volume(rig.engine()).expect("read after reopen");
    assert!(
        vol == model.image,
        "seed {seed}: volume differs after reopen"
    );
    let s = rig.engine().stats();
    assert_eq!(s.checksum_mismatches, 0);
    ops
}

#[test]
fn model_small_volume_many_seeds() {
    let mut total = 0;
    let seeds = seeds(24);
    for &seed in &seeds {
        total += run_seed(seed, 3000, 512);
    }
    report!(
        "model: {} seeds, {total} operations, 0 divergences",
        seeds.len()
    );
}

#[test]
fn model_with_mode_switches_and_policies() {
    let mut total = 0;
    let seeds: Vec<u64> = seeds(12).into_iter().map(|s| s + 2000).collect();
    for &seed in &seeds {
        total += run_seed_modes(seed, 3000, 1024, true);
    }
    report!(
        "model (mode switches, sequential cutoff): {} seeds, {total} operations, 0 divergences",
        seeds.len()
    );
}

#[test]
fn model_volume_larger_than_cache() {
    // The volume is several times the log: constant eviction and write-back
    // under space pressure.
    let mut total = 0;
    let seeds: Vec<u64> = seeds(6).into_iter().map(|s| s + 1000).collect();
    for &seed in &seeds {
        total += run_seed(seed, 3000, 8192);
    }
    report!(
        "model (volume > cache): {} seeds, {total} operations, 0 divergences",
        seeds.len()
    );
}
