//! Step 4 of recovery: the replayed records applied to the index in order.

use cairn_format::{CheckpointHeader, RecordEntry};

use super::replay::Replayed;
use crate::env::Env;
use crate::index::Index;

/// What applying the chain found.
pub(crate) struct Rebuilt {
    /// End of the last epoch-end record: write-back may go this far.
    pub(crate) writeback_limit: u64,
    /// End of the last replayed record (or the checkpoint's head).
    pub(crate) head: u64,
    pub(crate) generation_max: u64,
}

pub(crate) fn apply(
    env: &Env,
    index: &mut Index,
    records: &[Replayed],
    durable: u64,
    checkpoint: &CheckpointHeader,
) -> Rebuilt {
    let slot_count = env.layout.log_blocks;
    let mut writeback_limit = checkpoint.head_offset;
    let mut cursor = checkpoint.head_offset;
    let mut generation_max = checkpoint.generation;
    for record in records {
        generation_max = generation_max.max(record.header.generation);
        // Every slot this record (and any lap skip before it) reuses held
        // older data: forget it.
        let end = record.at + record.header.length_blocks();
        for logical in cursor..end {
            index.replay_forget_slot((logical % slot_count) as u32);
        }
        cursor = end;
        apply_entries(env, index, record, durable);
        if record.header.epoch_end() {
            writeback_limit = cursor;
        }
    }
    Rebuilt {
        writeback_limit,
        head: cursor.max(checkpoint.head_offset),
        generation_max,
    }
}

fn apply_entries(env: &Env, index: &mut Index, record: &Replayed, durable: u64) {
    let slot_count = env.layout.log_blocks;
    let mut k = 0usize;
    for entry in &record.header.entries {
        match *entry {
            RecordEntry::Data { lba, crc, clean } => {
                let slot = ((record.at + 1 + k as u64) % slot_count) as u32;
                let valid = record.valid[k];
                k += 1;
                if valid {
                    index.replay_map(slot, lba, crc, clean, false);
                    continue;
                }
                if record.header.sequence > durable {
                    // Torn, never acknowledged as durable: the previous
                    // value stands.
                    continue;
                }
                tracing::error!(
                    lba,
                    seq = record.header.sequence,
                    "acknowledged block failed its checksum at recovery"
                );
                if clean {
                    // The origin has the data.
                    index.replay_unmap(lba);
                } else {
                    index.replay_map(slot, lba, crc, clean, true);
                }
            }
            RecordEntry::Range {
                kind,
                lba,
                block_count,
            } => {
                index.replay_range(kind, lba, lba + block_count as u64, record.at);
            }
        }
    }
}
