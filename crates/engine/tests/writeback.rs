//! Write-back copies a group's final state and reads only that from the
//! cache: superseded versions of a block in the same group are skipped.

mod common;
use common::*;

use cairn_device::Device;

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
/// writes of 256, 44 and 10 blocks, then one flush. Not a data check: a
/// write per block, or runs past the bound, hold the same bytes.
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
    let journal = cairn_device::Journal::default();
    rig.origin.attach_journal(&journal, 1);
    let step = e.writeback_step().expect("write-back");
    assert_eq!(step.groups, 1, "the flushed epoch is one group");
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
        matches!(events.last(), Some(cairn_device::JournalEvent::Flush { .. })),
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
