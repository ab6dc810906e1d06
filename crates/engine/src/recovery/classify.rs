//! Step 3 of recovery: which replayed records a barrier covered, and a
//! check of the data of the others (the only ones a crash can tear).

use cairn_format::{block_checksum, CheckpointHeader, RecordEntry};

use super::replay::Replayed;
use crate::env::Env;
use crate::error::{EngineError, EngineResult};

/// The newest record known durable: records up to it were covered by a
/// completed barrier, so a bad block there is corruption (EIO), not a torn
/// write (old value).
pub(crate) fn durable_sequence(records: &[Replayed], checkpoint: &CheckpointHeader) -> u64 {
    records
        .iter()
        .map(|r| r.header.durable_sequence)
        .chain([
            checkpoint.next_record_sequence - 1,
            checkpoint.durable_sequence,
        ])
        .max()
        .unwrap_or(0)
}

/// Verify the data of records no barrier covered. Durable records are not
/// re-read (a whole log of them would make recovery read the whole cache);
/// every later read and write-back of their blocks verifies checksums.
pub(crate) fn verify_unsynced(
    env: &Env,
    records: &mut [Replayed],
    durable: u64,
) -> EngineResult<()> {
    let slot_count = env.layout.log_blocks;
    let block_bytes = env.block_size_bytes;
    for record in records.iter_mut().filter(|r| r.header.sequence > durable) {
        let data_count = record.header.data_count();
        if data_count == 0 {
            continue;
        }
        let mut data = vec![0u8; data_count * block_bytes];
        env.read_slot(((record.at + 1) % slot_count) as u32, &mut data)
            .map_err(EngineError::Cache)?;
        let mut k = 0;
        for entry in &record.header.entries {
            if let RecordEntry::Data { lba, crc, .. } = *entry {
                record.valid[k] =
                    block_checksum(lba, &data[k * block_bytes..(k + 1) * block_bytes]) == crc;
                k += 1;
            }
        }
    }
    Ok(())
}
