//! Write-back copies a group's final state and reads only that from the
//! cache: superseded versions of a block in the same group are skipped.

mod common;
use common::flush_gated::FlushGated;
use common::*;

use std::sync::Arc;

use cairn_device::{Device, SimDevice};
use cairn_engine::{Engine, FormatOptions};
use cairn_format::Layout;

#[test]
fn writeback_reads_only_the_final_version_of_each_block() {
    // Big enough that no checkpoint (an epoch end) splits the epoch.
    let rig = Rig::new(8 << 20, 1024);
    let e = rig.engine();
    // One epoch: block 7 written 4 times, each time in a different record
    // (70 other blocks in between fill and seal the record; a rewrite in
    // the open record replaces the block in place), then one flush.
    for round in 0..4u64 {
        e.write(7 * BS, &pattern(100 + round, BS as usize), false)
            .expect("write");
        for k in 0..70u64 {
            let lba = 100 + round * 70 + k;
            e.write(lba * BS, &pattern(lba, BS as usize), false)
                .expect("write");
        }
    }
    e.flush().expect("flush");
    let before = e.stats();
    rig.cache.reset_counters();
    let mut groups = 0;
    for _ in 0..16 {
        let step = e.writeback_step().expect("write-back");
        groups += step.groups;
        if step.groups == 0 {
            break;
        }
    }
    assert!(groups >= 1, "the flushed epoch was written back");
    let after = e.stats();
    let read_bytes = rig.cache.counters().bytes_read;
    let skipped = after.writeback_reads_skipped - before.writeback_reads_skipped;
    report!(
        "write-back of 284 block versions (281 final): {} versions skipped, {} KiB read from the cache",
        skipped,
        read_bytes >> 10
    );
    assert_eq!(
        skipped, 3,
        "the 3 superseded versions of block 7 are not read"
    );
    assert_eq!(after.writeback_blocks - before.writeback_blocks, 281);
    // The final blocks and the record headers, not the superseded blocks.
    assert!(
        read_bytes <= (281 + 16) * BS,
        "write-back read {read_bytes} bytes for 281 final blocks"
    );

    // The origin holds exactly the final versions.
    let mut block = vec![0u8; BS as usize];
    rig.origin.read_at(7 * BS, &mut block).expect("origin read");
    assert_eq!(
        block,
        pattern(103, BS as usize),
        "block 7: its last version"
    );
    for lba in 100..380u64 {
        rig.origin
            .read_at(lba * BS, &mut block)
            .expect("origin read");
        assert_eq!(block, pattern(lba, BS as usize), "block {lba}");
    }
}

/// Write-back merges a group's blocks into one origin write per run of
/// consecutive addresses, each at most 1 MiB (`RUN_BYTES_MAX`): 300
/// consecutive blocks written in address order (so across several
/// records) and 10 more after a gap go to the origin as exactly three
/// writes of 256, 44 and 10 blocks, then one flush, and are counted in
/// `writeback_blocks` and `writeback_bytes`. Not a data check: a write per
/// block, or runs past the bound, hold the same bytes.
#[test]
fn writeback_merges_consecutive_blocks_into_origin_writes_of_at_most_1_mib() {
    let rig = Rig::new(8 << 20, 1024);
    let e = rig.engine();
    let lbas: Vec<u64> = (100..400u64).chain(500..510).collect();
    for &lba in &lbas {
        e.write(lba * BS, &pattern(lba, BS as usize), false)
            .expect("write");
    }
    e.flush().expect("flush");
    let before = e.stats();
    let journal = cairn_device::Journal::default();
    rig.origin.attach_journal(&journal, 1);
    let step = e.writeback_step().expect("write-back");
    assert_eq!(step.groups, 1, "the flushed epoch is one group");
    let after = e.stats();
    assert_eq!(after.writeback_blocks - before.writeback_blocks, 310);
    assert_eq!(
        after.writeback_bytes - before.writeback_bytes,
        310 * BS,
        "writeback_bytes counts the bytes of the blocks written back"
    );
    let events = journal.since(0);
    let writes: Vec<(u64, u64)> = events
        .iter()
        .filter_map(|ev| match ev {
            cairn_device::JournalEvent::Write { offset, data, .. } => {
                Some((offset / BS, data.len() as u64 / BS))
            }
            cairn_device::JournalEvent::Flush { .. } => None,
        })
        .collect();
    report!("write-back of 310 blocks: origin writes (lba, blocks) {writes:?}");
    assert_eq!(
        writes,
        vec![(100, 256), (356, 44), (500, 10)],
        "origin writes as (lba, blocks): one per run of consecutive blocks, at most 1 MiB each"
    );
    assert!(
        matches!(
            events.last(),
            Some(cairn_device::JournalEvent::Flush { .. })
        ),
        "the group's origin writes end with an origin flush"
    );
    let mut block = vec![0u8; BS as usize];
    for &lba in &lbas {
        rig.origin
            .read_at(lba * BS, &mut block)
            .expect("origin read");
        assert_eq!(block, pattern(lba, BS as usize), "block {lba}");
    }
}

/// Write-back finds a dirty block damaged and skips it; before it commits
/// the group, a client writes that block again. The damaged copy's slot is
/// no longer live, so commit must not mark it corrupt: the block reads as
/// its new data, and `corrupt_blocks` and `checksum_mismatches` stay 0
/// (only `writeback_skipped_corrupt` counts the skipped copy). Marking
/// the retired slot (commit's guard `&&` turned into `||`, a cargo-mutants
/// survivor) leaves `corrupt_blocks` at 1 with nothing corrupt cached.
#[test]
fn a_damaged_block_rewritten_during_its_writeback_is_not_counted_corrupt() {
    let volume_blocks = 256u64;
    let lba = 9u64;
    let inner = SimDevice::new("origin", volume_blocks * BS);
    // An origin whose next flush, once the gate is armed, waits at the
    // gate: write-back has copied its group to the origin and not
    // committed it.
    let origin = Arc::new(FlushGated::new(inner.clone()));
    let cache = SimDevice::new("cache", cache_bytes_small());
    Engine::format(
        Arc::new(cache.clone()),
        origin.clone(),
        &FormatOptions::default(),
    )
    .expect("format");
    let e = Engine::open(Arc::new(cache.clone()), origin.clone(), &open_opts()).expect("open");
    // The block in a record of its own (header, then the block), flushed.
    let head_before = e.stats().head_offset;
    e.write(lba * BS, &pattern(1, BS as usize), false)
        .expect("write");
    e.flush().expect("flush");
    let layout = Layout::compute(cache_bytes_small(), BS as u32).expect("layout");
    let slot = (head_before + 1) % layout.log_blocks;
    cache.flip(layout.log_offset_bytes() + slot * BS + 123, 0x40);

    let new = pattern(2, BS as usize);
    origin.gate.arm(None);
    let step = std::thread::scope(|s| {
        let writeback = s.spawn(|| e.writeback_step());
        origin.gate.wait_entered(
            std::time::Duration::from_secs(100),
            "write-back's origin flush",
        );
        // Released before the result is checked: a failed write must not
        // leave write-back waiting at the gate.
        let wrote = e.write(lba * BS, &new, false);
        origin.gate.release();
        wrote.expect("write during write-back");
        writeback.join().expect("write-back thread")
    })
    .expect("write-back");
    assert_eq!(step.groups, 1, "the flushed group was written back");
    let s = e.stats();
    report!(
        "damaged block rewritten during its write-back: writeback_skipped_corrupt {}, corrupt_blocks {}, checksum_mismatches {}",
        s.writeback_skipped_corrupt,
        s.corrupt_blocks,
        s.checksum_mismatches
    );
    assert_eq!(
        s.writeback_skipped_corrupt, 1,
        "write-back saw the damage and skipped the block"
    );
    assert_eq!(
        s.corrupt_blocks, 0,
        "the damaged copy was retired by the rewrite: nothing cached is corrupt"
    );
    assert_eq!(
        s.checksum_mismatches, 0,
        "no live block failed its checksum"
    );
    let mut buf = vec![0u8; BS as usize];
    e.read(lba * BS, &mut buf)
        .expect("read of the rewritten block");
    assert!(buf == new, "the rewritten block reads as its new data");
    e.drain().expect("drain");
    let mut on_origin = vec![0u8; BS as usize];
    inner
        .read_at(lba * BS, &mut on_origin)
        .expect("origin read");
    assert!(
        on_origin == new,
        "the origin has the new data after a drain"
    );
    assert_eq!(e.stats().corrupt_blocks, 0);
}
