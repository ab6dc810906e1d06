//! Misses and write-back over an origin that fails some requests. A read
//! miss the origin fails with an error worth retrying is asked again; a
//! write-back write is written again (its batch in halves, then the lone
//! run up to `origin_write_attempts` times), so a flaky origin still takes
//! every group; a write that keeps failing fails its group, which keeps
//! its dirty data for the next step.

mod common;
use common::*;

use cairn_device::{Device, FaultMode, OpKinds, RangeFault};

const VOLUME_BLOCKS: u64 = 256;
/// Blocks written, two apart so that each is a run of its own.
const RUNS: u64 = 32;
/// The block whose origin write fails.
const FAILING_LBA: u64 = 2 * 20;

/// A rig with `RUNS` dirty blocks, flushed (one group), and the model.
fn dirty_rig() -> (Rig, Model) {
    let rig = Rig::new(cache_bytes_small(), VOLUME_BLOCKS);
    let mut model = Model::new(VOLUME_BLOCKS);
    for i in 0..RUNS {
        let data = pattern(700 + i, BS as usize);
        rig.engine().write(2 * i * BS, &data, false).expect("write");
        model.write(2 * i * BS, &data);
    }
    rig.engine().flush().expect("flush");
    assert_eq!(rig.engine().stats().dirty_blocks, RUNS);
    (rig, model)
}

fn fail_writes_of_one_block(rig: &Rig, mode: FaultMode) {
    rig.origin.fail_range(RangeFault {
        kinds: OpKinds::WRITES,
        start: FAILING_LBA * BS,
        end: (FAILING_LBA + 1) * BS,
        mode,
    });
}

fn assert_origin_is(rig: &Rig, model: &Model, ctx: &str) {
    let mut origin = vec![0u8; (VOLUME_BLOCKS * BS) as usize];
    rig.origin.read_at(0, &mut origin).expect("read the origin");
    assert!(origin == model.image, "{ctx}: the origin differs");
}

/// One failed origin write costs a few more batches, not the group: the
/// step takes every block at once.
#[test]
fn a_group_survives_one_failed_origin_write() {
    let (rig, model) = dirty_rig();
    fail_writes_of_one_block(&rig, FaultMode::Once);
    let e = rig.engine();
    let step = e
        .writeback_step()
        .expect("the failed write is written again");
    assert_eq!((step.groups, step.blocks_written), (1, RUNS), "{step:?}");
    let s = e.stats();
    assert_eq!(s.dirty_blocks, 0, "{s:?}");
    assert_eq!(s.origin_write_errors, 1, "{s:?}");
    // The batch was written again as its two halves, once: the fault was
    // gone by then.
    assert_eq!(s.origin_write_retries, 1, "{s:?}");
    assert_origin_is(&rig, &model, "after the step");
}

/// A write that keeps failing fails its group after a bounded number of
/// attempts: nothing is committed, the dirty data stays, and once the
/// origin takes writes again the group is written.
#[test]
fn a_write_that_keeps_failing_fails_its_group_after_its_attempts() {
    let (rig, model) = dirty_rig();
    fail_writes_of_one_block(&rig, FaultMode::Sticky);
    let e = rig.engine();
    let err = e
        .writeback_step()
        .expect_err("the block never reaches the origin");
    assert_eq!(err.errno(), libc::EIO, "{err}");
    let s = e.stats();
    assert_eq!(s.dirty_blocks, RUNS, "nothing committed: {s:?}");
    // The batches holding the block fail once each (32, 16, 8, 4, 2 and
    // 1 runs: 6), and the lone run 3 more times (4 attempts in all).
    assert_eq!(s.origin_write_errors, 6 + 3, "{s:?}");
    // Five halvings, and three more writes of the lone run.
    assert_eq!(s.origin_write_retries, 5 + 3, "{s:?}");
    rig.origin.clear_faults();
    // A drain, which does not wait out the failing origin's backoff of
    // background steps.
    let drained = e.drain().expect("the origin is back");
    assert_eq!(drained.dirty_blocks, 0, "{drained:?}");
    assert_eq!(e.stats().dirty_blocks, 0);
    assert_origin_is(&rig, &model, "after the origin came back");
}

fn fail_reads_of_one_block(rig: &Rig, mode: FaultMode) {
    rig.origin.fail_range(RangeFault {
        kinds: OpKinds::READS,
        start: FAILING_LBA * BS,
        end: (FAILING_LBA + 1) * BS,
        mode,
    });
}

/// A read miss the origin fails once is asked again and answered.
#[test]
fn a_miss_the_origin_fails_once_is_asked_again() {
    let rig = Rig::new(cache_bytes_small(), VOLUME_BLOCKS);
    let model = Model::new(VOLUME_BLOCKS);
    fail_reads_of_one_block(&rig, FaultMode::Once);
    let e = rig.engine();
    let mut block = vec![0xEE; BS as usize];
    e.read(FAILING_LBA * BS, &mut block)
        .expect("the failed origin read is asked again");
    assert!(block == model.block(FAILING_LBA), "the miss's data");
    let s = e.stats();
    assert_eq!(
        (s.origin_read_errors, s.origin_read_retries),
        (1, 1),
        "{s:?}"
    );
    assert_eq!(s.read_misses, 1, "{s:?}");
}

/// One that keeps failing fails its request with EIO after
/// `origin_read_attempts` (3) reads.
#[test]
fn a_miss_the_origin_keeps_failing_fails_after_its_attempts() {
    let rig = Rig::new(cache_bytes_small(), VOLUME_BLOCKS);
    fail_reads_of_one_block(&rig, FaultMode::Sticky);
    let e = rig.engine();
    let mut block = vec![0u8; BS as usize];
    let err = e
        .read(FAILING_LBA * BS, &mut block)
        .expect_err("the origin never answers this block");
    assert_eq!(err.errno(), libc::EIO, "{err}");
    let s = e.stats();
    assert_eq!(
        (s.origin_read_errors, s.origin_read_retries),
        (3, 2),
        "{s:?}"
    );
    rig.origin.clear_faults();
    e.read(FAILING_LBA * BS, &mut block)
        .expect("the origin answers again");
}

/// A fenced origin (as a blocklisted RBD client: ESHUTDOWN) is not asked
/// again: one failed batch, no retry, the group fails.
#[test]
fn a_fenced_origin_is_not_asked_again() {
    let (rig, _model) = dirty_rig();
    rig.origin.fence("blocklisted by the cluster");
    let e = rig.engine();
    e.writeback_step()
        .expect_err("a fenced origin takes nothing");
    let s = e.stats();
    assert_eq!(
        (s.origin_write_errors, s.origin_write_retries),
        (1, 0),
        "{s:?}"
    );
    assert_eq!(s.dirty_blocks, RUNS, "{s:?}");
}
