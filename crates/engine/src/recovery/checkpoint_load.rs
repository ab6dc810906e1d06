//! Step 1 of recovery: load the active checkpoint into a fresh index.

use cairn_format::{
    CheckpointEntry, CheckpointHeader, PendingRange, Reader, Superblock, CHECKPOINT_HEADER_BYTES,
};

use super::{checkpoint_damaged, checkpoint_unreadable};
use crate::env::Env;
use crate::error::EngineResult;
use crate::index::Index;
use crate::superblocks::LOG_COUNTER_LIMIT;

/// The active checkpoint's header, and the index it describes.
pub(crate) fn load(env: &Env, superblock: &Superblock) -> EngineResult<(CheckpointHeader, Index)> {
    let slot_count = env.layout.log_blocks;
    let damaged = |detail: String| checkpoint_damaged(env, superblock, detail);
    let at = env
        .layout
        .checkpoint_offset_bytes(superblock.active_checkpoint);
    let read = |offset_bytes: u64, buf: &mut [u8]| {
        env.cache
            .read_at(offset_bytes, buf)
            .map_err(|e| checkpoint_unreadable(env, superblock, offset_bytes, buf.len() as u64, e))
    };
    let mut header_buf = vec![0u8; CHECKPOINT_HEADER_BYTES];
    read(at, &mut header_buf)?;
    let header =
        CheckpointHeader::decode(&header_buf).map_err(|e| damaged(format!("header: {e}")))?;
    load_lifetime(env, &header_buf);
    if header.sequence != superblock.checkpoint_sequence {
        return Err(damaged(format!(
            "the slot holds checkpoint {} instead",
            header.sequence
        )));
    }
    // Check the header's claims before acting on them: device contents
    // must never make us read or allocate out of bounds, nor overflow.
    // The counts are bounded first, so the payload size cannot overflow.
    if header.entry_count > slot_count
        || header.range_count as usize > cairn_format::PENDING_RANGES_MAX
        || header.tail_offset > header.head_offset
        || header.writeback_offset > header.head_offset
        || header.tail_offset > header.writeback_offset
    {
        return Err(damaged("counts or offsets out of range".into()));
    }
    if header.head_offset >= LOG_COUNTER_LIMIT
        || header.next_record_sequence == 0
        || header.next_record_sequence >= LOG_COUNTER_LIMIT
    {
        return Err(damaged(format!(
            "log position out of range (head offset {}, next record sequence {})",
            header.head_offset, header.next_record_sequence
        )));
    }
    let payload_bytes =
        CheckpointHeader::payload_bytes(header.entry_count, header.range_count, header.lost_count);
    if CHECKPOINT_HEADER_BYTES as u64 + payload_bytes > env.layout.checkpoint_slot_bytes {
        return Err(damaged(format!(
            "payload of {payload_bytes} bytes does not fit the {}-byte slot",
            env.layout.checkpoint_slot_bytes
        )));
    }
    let mut payload = vec![0u8; payload_bytes as usize];
    if payload_bytes > 0 {
        read(at + CHECKPOINT_HEADER_BYTES as u64, &mut payload)?;
    }
    let crc = cairn_format::crc32c(&payload);
    if crc != header.payload_crc {
        return Err(damaged(format!(
            "payload checksum {crc:#x} != {:#x}",
            header.payload_crc
        )));
    }
    let mut index = Index::new(slot_count);
    let mut reader = Reader::new(&payload);
    for _ in 0..header.entry_count {
        let entry = CheckpointEntry::decode(&mut reader).map_err(|e| damaged(e.to_string()))?;
        index
            .load_entry(&entry, |key| env.key_valid(key))
            .map_err(damaged)?;
    }
    for _ in 0..header.range_count {
        let range = PendingRange::decode(&mut reader).map_err(|e| damaged(e.to_string()))?;
        if !env.keys_valid(range.start_lba, range.block_count) {
            return Err(damaged(format!("bad range {range:?}")));
        }
        index.load_range(&range);
    }
    for _ in 0..header.lost_count {
        let lba = reader.u64().map_err(|e| damaged(e.to_string()))?;
        if !env.key_valid(lba) {
            return Err(damaged(format!("bad lost block {lba}")));
        }
        index.load_lost(lba);
    }
    Ok((header, index))
}

/// The lifetime counters in the checkpoint header's block. They are
/// statistics, not data: damaged ones restart from this run instead of
/// refusing the cache.
fn load_lifetime(env: &Env, header_block: &[u8]) {
    match cairn_format::decode_lifetime(&header_block[cairn_format::CHECKPOINT_LIFETIME_OFFSET..]) {
        Ok(Some(pairs)) => env.lifetime.load(pairs),
        Ok(None) => {}
        Err(e) => tracing::warn!(
            "lifetime counters in the checkpoint are damaged ({e}); counting them from this run"
        ),
    }
}
