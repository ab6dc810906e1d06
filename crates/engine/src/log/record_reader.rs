//! Reading record headers back from the cache device (write-back, replay,
//! degraded mode).

use cairn_format::RecordHeader;

use super::record_start;
use crate::env::Env;
use crate::error::{EngineError, EngineResult};

/// Read and decode the record header expected at `position` (after a lap
/// skip, if one applies). `None` if the block there is not a valid header
/// of this format for that logical offset.
pub(crate) fn read_record_header(
    env: &Env,
    position: u64,
    slot_count: u64,
) -> EngineResult<Option<(u64, RecordHeader)>> {
    let at = record_start(position, slot_count);
    let mut buf = vec![0u8; env.block_size_bytes];
    env.read_slot((at % slot_count) as u32, &mut buf)
        .map_err(EngineError::Cache)?;
    match RecordHeader::decode(&buf, env.block_size_bytes as u32) {
        Ok((header, _)) if header.log_offset == at && header.format_tag == env.format_tag => {
            Ok(Some((at, header)))
        }
        _ => Ok(None),
    }
}
