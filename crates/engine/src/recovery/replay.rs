//! Step 2 of recovery: follow the record chain after the checkpoint.

use cairn_format::{CheckpointHeader, RecordHeader, Superblock, RECORD_MAGIC};

use super::log_damaged;
use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::log::{check_shape, record_start};
use crate::volume_set::VolumeSet;

/// Blocks read per I/O by the scan past the chain's end.
const SCAN_CHUNK_BLOCKS: u64 = 256;

/// One record of the chain.
pub(crate) struct Replayed {
    pub(crate) at: u64,
    pub(crate) header: RecordHeader,
    /// Per data block: did it match its checksum? (All true until
    /// `classify` verifies the records no barrier covered.)
    pub(crate) valid: Vec<bool>,
}

/// The chain of records after the checkpoint.
pub(crate) struct Chain {
    pub(crate) records: Vec<Replayed>,
    /// Sequence and previous-header crc the next record must carry.
    pub(crate) next_sequence: u64,
    pub(crate) prev_crc: u32,
}

/// Read the chain of records after the checkpoint's head, then make sure
/// no record past its end proves a missing one was durable.
pub(crate) fn replay_chain(
    env: &Env,
    superblock: &Superblock,
    checkpoint: &CheckpointHeader,
) -> EngineResult<Chain> {
    let slot_count = env.layout.log_blocks;
    let block_bytes = env.block_size_bytes;
    let mut records = Vec::new();
    let mut position = checkpoint.head_offset;
    let mut next_sequence = checkpoint.next_record_sequence;
    let mut prev_crc = checkpoint.prev_crc;
    let limit = checkpoint.head_offset + slot_count;
    let mut buf = vec![0u8; block_bytes];
    for _ in 0..slot_count {
        let at = record_start(position, slot_count);
        if at + 2 > limit {
            break;
        }
        env.read_slot((at % slot_count) as u32, &mut buf)
            .map_err(EngineError::Cache)?;
        let Ok((header, header_crc)) = RecordHeader::decode(&buf, block_bytes as u32) else {
            break;
        };
        if header.log_offset != at
            || header.format_tag != env.format_tag
            || header.sequence != next_sequence
            || header.prev_crc != prev_crc
            || header.generation > superblock.generation
            || at + header.length_blocks() > limit
        {
            break;
        }
        // It chains: a record the engine could not have written is damage,
        // not a torn write (its header checksum matched).
        // Replayed records come after the newest checkpoint: a removed
        // volume's never do (its removal wrote one), so every entry is
        // checked.
        check_shape(env, at, &header, slot_count, VolumeSet::all())?;
        position = at + header.length_blocks();
        next_sequence += 1;
        prev_crc = header_crc;
        let valid = vec![true; header.data_count()];
        records.push(Replayed { at, header, valid });
    }
    scan_for_lost_records(env, position, next_sequence, limit)?;
    Ok(Chain {
        records,
        next_sequence,
        prev_crc,
    })
}

/// After the chain ends at `position`, look for a record that claims the
/// missing sequence was durable. Such a record can only be a bounded
/// distance ahead: the engine never lets more than `unsynced_blocks_max`
/// blocks wait for a barrier.
fn scan_for_lost_records(
    env: &Env,
    position: u64,
    expected_sequence: u64,
    limit: u64,
) -> EngineResult<()> {
    let slot_count = env.layout.log_blocks;
    let block_bytes = env.block_size_bytes;
    let window = env.config.unsynced_blocks_max + 4 * (env.record_data_blocks_max + 1);
    let end = (position + window).min(limit);
    let mut at = position;
    let mut buf = vec![0u8; SCAN_CHUNK_BLOCKS as usize * block_bytes];
    while at < end {
        // Read up to the end of the lap or the window, whichever is first.
        let count = SCAN_CHUNK_BLOCKS
            .min(end - at)
            .min(slot_count - at % slot_count);
        let chunk = &mut buf[..count as usize * block_bytes];
        env.read_slot((at % slot_count) as u32, chunk)
            .map_err(EngineError::Cache)?;
        for (k, block) in chunk.chunks(block_bytes).enumerate() {
            if block[..8] != RECORD_MAGIC.to_le_bytes() {
                continue;
            }
            let offset = at + k as u64;
            if let Ok((h, _)) = RecordHeader::decode(block, block_bytes as u32) {
                if h.log_offset == offset
                    && h.format_tag == env.format_tag
                    && h.durable_sequence >= expected_sequence
                {
                    return Err(log_damaged(
                        env,
                        format!(
                            "record {expected_sequence} near log offset {position} is unreadable, but record {} at offset {offset} shows it had been made durable",
                            h.sequence
                        ),
                    ));
                }
            }
        }
        at += count;
    }
    Ok(())
}
