//! Checkpoints: the index streamed into the inactive checkpoint slot, then
//! the superblock pointed at it. Recovery loads the newest one and replays
//! the log after it.

mod payload_writer;

use cairn_device::DeviceError;
use cairn_format::{
    CheckpointHeader, Writer, CHECKPOINT_ENTRY_BYTES, CHECKPOINT_HEADER_BYTES, LOST_BLOCK_BYTES,
    PENDING_RANGE_BYTES,
};

use crate::env::Env;
use crate::error::EngineResult;
use crate::retry::retrying_cache_write;
use crate::state::State;
use crate::stats::Counters;
use payload_writer::{PayloadWriter, PAYLOAD_ALIGN_BYTES};

/// Snapshot the index into the inactive checkpoint slot, then point the
/// superblock at it (which also persists the write-back position).
pub(crate) fn write(env: &Env, st: &mut State) -> EngineResult<()> {
    // Everything the index maps must be in the log, behind a barrier.
    st.log.seal_everything(env, &mut st.index)?;
    // The slot is retried whole: its chunks are plain writes covered by
    // the header's barrier, so if that barrier fails the chunks must be
    // written again too, not just the header.
    let header = env
        .syncs
        .watch(|| retrying_cache_write(env, "writing a checkpoint", true, || write_slot(env, st)))
        .map_err(|e| env.health.cache_write_failed("writing a checkpoint", e))?;
    st.superblock.active_checkpoint = 1 - st.superblock.active_checkpoint;
    st.superblock.checkpoint_sequence = header.sequence;
    st.write_superblock(env)?;
    st.log.checkpointed();
    st.index.lost_persisted();
    Counters::add(&env.counters.checkpoints, 1);
    Ok(())
}

/// Stream the index into the inactive checkpoint slot and write its header
/// with a barrier. The superblock is not touched.
fn write_slot(env: &Env, st: &State) -> Result<CheckpointHeader, DeviceError> {
    let target = 1 - st.superblock.active_checkpoint;
    let slot_at = env.layout.checkpoint_offset_bytes(target);
    let ranges = st.index.pending_ranges();
    let live = st.index.live_blocks();
    // The slot holds the header and the largest payload (every log slot
    // live, every range pending), padded: the layout sizes it so.
    assert!(live <= env.layout.log_blocks);
    assert!(ranges.len() <= cairn_format::PENDING_RANGES_MAX);
    let lost = lost_that_fit(env, st, live, ranges.len() as u32);
    let payload_bytes =
        CheckpointHeader::payload_bytes(live, ranges.len() as u32, lost.len() as u32);
    assert!(
        CHECKPOINT_HEADER_BYTES as u64 + cairn_format::align_up(payload_bytes, PAYLOAD_ALIGN_BYTES)
            <= env.layout.checkpoint_slot_bytes,
        "checkpoint payload of {payload_bytes} bytes overflows its slot"
    );
    let mut payload = PayloadWriter::new(env, slot_at + CHECKPOINT_HEADER_BYTES as u64);
    let mut entry_count = 0u64;
    let mut bytes = [0u8; CHECKPOINT_ENTRY_BYTES];
    for entry in st.index.checkpoint_entries() {
        entry.encode(&mut Writer::new(&mut bytes));
        payload.put(&bytes)?;
        entry_count += 1;
    }
    assert_eq!(entry_count, live, "every live slot is in the checkpoint");
    let mut bytes = [0u8; PENDING_RANGE_BYTES];
    for range in &ranges {
        range.encode(&mut Writer::new(&mut bytes));
        payload.put(&bytes)?;
    }
    for lba in &lost {
        payload.put(&lba.to_le_bytes())?;
    }
    let (payload_crc, written_bytes) = payload.finish()?;
    Counters::add(&env.counters.cache_bytes_written, written_bytes);
    let log = &st.log;
    let header = CheckpointHeader {
        sequence: st.superblock.checkpoint_sequence + 1,
        generation: st.superblock.generation,
        head_offset: log.head(),
        next_record_sequence: log.next_sequence(),
        prev_crc: log.prev_crc(),
        tail_offset: log.tail(),
        writeback_offset: log.writeback_position(),
        durable_sequence: log.durable_sequence(),
        entry_count,
        range_count: ranges.len() as u32,
        payload_crc,
        lost_count: lost.len() as u32,
    };
    // The header goes last, with the barrier that covers the payload; the
    // lifetime counters ride in its block.
    let mut encoded = header.encode();
    let mut since_start = crate::stats::StatsSnapshot::default();
    env.counters.fill(&mut since_start);
    cairn_format::encode_lifetime(
        &mut encoded[cairn_format::CHECKPOINT_LIFETIME_OFFSET..],
        &env.lifetime.keyed_totals(&since_start.counter_pairs()),
    );
    env.cache.write_vectored_and_flush(slot_at, &[&encoded])?;
    Counters::add(&env.counters.cache_bytes_written, encoded.len() as u64);
    Counters::add(&env.counters.cache_barriers, 1);
    Ok(header)
}

/// The blocks lost to corruption that this checkpoint records: all of
/// them, unless the slot (sized for a full log and every pending range) has
/// no room left; then as many as fit, and the rest are reported, since
/// after a restart they would read the origin's older data.
fn lost_that_fit(env: &Env, st: &State, live: u64, ranges: u32) -> Vec<u64> {
    let mut lost = st.index.lost_list();
    let used = CHECKPOINT_HEADER_BYTES as u64 + CheckpointHeader::payload_bytes(live, ranges, 0);
    let room_bytes = env.layout.checkpoint_slot_bytes.saturating_sub(used);
    // Padding to the payload alignment comes out of the same room.
    let room =
        (room_bytes.saturating_sub(PAYLOAD_ALIGN_BYTES - 1) / LOST_BLOCK_BYTES as u64) as usize;
    if lost.len() > room {
        let dropped = lost.len() - room;
        tracing::error!(
            lost = lost.len(),
            recorded = room,
            "more blocks lost to corruption than a checkpoint can record: {dropped} of them will read the origin's older data after a restart; the cache device is failing, replace it"
        );
        Counters::add(&env.counters.lost_blocks_unrecorded, dropped as u64);
        lost.truncate(room);
    }
    lost
}
