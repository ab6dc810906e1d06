//! Reading record headers back from the cache device (write-back, replay,
//! degraded mode).

use cairn_format::{RecordEntry, RecordHeader};

use super::record_start;
use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::retry::read_slot_retrying;
use crate::volume_set::VolumeSet;

/// Read and decode the record header expected at `position` (after a lap
/// skip, if one applies). `None` if the block there is not a valid header
/// of this format for that logical offset. A header that is valid but
/// describes a record the engine never writes (see [`check_shape`], with
/// the entries of the `checked` volumes) is damage: an error.
pub(crate) fn read_record_header(
    env: &Env,
    position: u64,
    slot_count: u64,
    checked: VolumeSet,
) -> EngineResult<Option<(u64, RecordHeader)>> {
    let at = record_start(position, slot_count);
    let mut buf = vec![0u8; env.block_size_bytes];
    // Retried: the header of a record of dirty data is read before write-
    // back can copy it, and a read error must not stop write-back for long.
    read_slot_retrying(env, (at % slot_count) as u32, &mut buf).map_err(EngineError::Cache)?;
    match RecordHeader::decode(&buf, env.block_size_bytes as u32) {
        Ok((header, _)) if header.log_offset == at && header.format_tag == env.format_tag => {
            check_shape(env, at, &header, slot_count, checked)?;
            Ok(Some((at, header)))
        }
        _ => Ok(None),
    }
}

/// A record header read from the device passed its checksum, but its
/// claims are still device contents: before anything is sized, read or
/// written from them, check that the record is one the engine could have
/// written. Its data blocks fit one record buffer, it does not run past
/// the end of the lap (records never wrap), and every block it addresses
/// of a `checked` volume lies in that volume (a volume id outside the
/// cache's volumes is checked when `checked` has it). The entries of other
/// volumes are never used by the caller: an old record behind a lagging
/// volume's write-back position may name a volume removed since, or a
/// smaller one that took its id.
pub(crate) fn check_shape(
    env: &Env,
    at: u64,
    header: &RecordHeader,
    slot_count: u64,
    checked: VolumeSet,
) -> EngineResult<()> {
    let damaged = |detail: String| EngineError::LogDamaged {
        device: env.cache.name().to_string(),
        detail: format!("record {} at log offset {at}: {detail}", header.sequence),
    };
    let data_count = header.data_count() as u64;
    if data_count > env.record_data_blocks_max {
        return Err(damaged(format!(
            "{data_count} data blocks, more than the {} a record holds",
            env.record_data_blocks_max
        )));
    }
    if at % slot_count + header.length_blocks() > slot_count {
        return Err(damaged(format!(
            "{} blocks run past the end of the {slot_count}-block log",
            header.length_blocks()
        )));
    }
    for entry in &header.entries {
        let (lba, count) = match *entry {
            RecordEntry::Data { lba, .. } => (lba, 1),
            RecordEntry::Range {
                lba, block_count, ..
            } => (lba, block_count as u64),
        };
        if !checked.contains(cairn_format::key_volume(lba)) {
            continue;
        }
        // Decoding bounds keys by KEY_MAX and count by u32: no overflow.
        if !env.keys_valid(lba, count) {
            let id = cairn_format::key_volume(lba);
            let first = cairn_format::key_lba(lba);
            let within = match env.origins.get(id) {
                Some(v) => format!("past the end of the {}-block volume {id}", v.blocks),
                None => format!("in volume {id}, which the cache does not serve"),
            };
            return Err(damaged(format!(
                "blocks {first}..{} lie {within}",
                first + count
            )));
        }
    }
    Ok(())
}
