//! Background recalculation: tags for origin blocks written before the
//! cache was formatted with integrity, computed from what the origin holds.

use cairn_format::{origin_tag, TAG_UNSET};

use super::INTEGRITY_STEP_BYTES;
use crate::error::EngineResult;
use crate::parts::Parts;
use crate::stats::Counters;

/// Recalculation persists its position at least this often (in blocks
/// covered), so a restart redoes little.
const RECALC_PERSIST_EVERY_BYTES: u64 = 64 << 20;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecalcProgress {
    pub position_blocks: u64,
    pub total_blocks: u64,
    /// Tags computed by this step.
    pub blocks_tagged: u64,
}

impl RecalcProgress {
    pub fn done(&self) -> bool {
        self.position_blocks >= self.total_blocks
    }

    fn finished(total_blocks: u64) -> RecalcProgress {
        RecalcProgress {
            position_blocks: total_blocks,
            total_blocks,
            blocks_tagged: 0,
        }
    }
}

/// One step of recalculation: compute the tags of the next origin blocks
/// that have none, from what the origin holds now. Tags already set (by
/// write-back) are left alone. The position is persisted every so often
/// and at the end, so a restart resumes near here.
pub(crate) fn recalc_step(p: Parts<'_>) -> EngineResult<RecalcProgress> {
    let env = p.env;
    let block_bytes = env.block_size_bytes as u64;
    let total = env.volume_blocks;
    if !env.integrity {
        return Ok(RecalcProgress::finished(total));
    }
    let _serial = p.writeback.lock();
    let position = {
        let st = p.state.normal(env)?;
        st.tags.as_ref().map_or(total, |t| t.recalc_pos)
    };
    if position >= total {
        return Ok(RecalcProgress::finished(total));
    }
    let count = (INTEGRITY_STEP_BYTES / block_bytes)
        .max(1)
        .min(total - position);
    let mut buf = vec![0u8; (count * block_bytes) as usize];
    // The origin cannot change under this read: every origin writer holds
    // the write-back lock we hold.
    env.read_origin(position, &mut buf)?;
    let mut st = p.state.normal(env)?;
    let tags = st.tags.as_mut().expect("integrity on");
    assert_eq!(tags.recalc_pos, position, "recalculation is serialized");
    let mut tagged = 0;
    for (k, block) in buf.chunks(block_bytes as usize).enumerate() {
        let lba = position + k as u64;
        if tags.get(lba) == TAG_UNSET {
            tags.set(lba, origin_tag(lba, block));
            tagged += 1;
        }
    }
    let after = position + count;
    tags.recalc_pos = after;
    Counters::add(&env.counters.recalc_blocks, count);
    let persist_every = (RECALC_PERSIST_EVERY_BYTES / block_bytes).max(1);
    if after >= total || after / persist_every != position / persist_every {
        st.write_superblock(env)?;
        if after >= total {
            tracing::info!("integrity recalculation complete: every origin block has a tag");
        }
    }
    Ok(RecalcProgress {
        position_blocks: after,
        total_blocks: total,
        blocks_tagged: tagged,
    })
}
