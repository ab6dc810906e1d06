//! Background recalculation: tags for origin blocks written before the
//! cache was formatted with integrity, computed from what the origin holds.

use cairn_format::{block_key, origin_tag, TAG_UNSET};

use super::INTEGRITY_STEP_BYTES;
use crate::error::EngineResult;
use crate::parts::Parts;
use crate::stats::Counters;
use crate::tags::TagTable;
use crate::volume_tags::VolumeTags;

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
}

/// One step of recalculation: compute the tags of the next origin blocks
/// that have none, from what the origin holds now, for the first volume
/// (by id) whose recalculation is not finished. Tags already set (by
/// write-back) are left alone. The position is persisted every so often
/// and at the end, so a restart resumes near here.
pub(crate) fn recalc_step(p: Parts<'_>) -> EngineResult<RecalcProgress> {
    let env = p.env;
    let block_bytes = env.block_size_bytes as u64;
    if !env.integrity {
        // No tag area: nothing to recalculate, ever.
        return Ok(RecalcProgress::default());
    }
    // A look without the write-back lock first: most calls find nothing.
    let next = {
        let st = p.state.normal(env)?;
        next_to_recalculate(&st.tags).ok_or_else(|| progress_of(&st.tags))
    };
    let (id, position) = match next {
        Ok(next) => next,
        Err(done) => return Ok(done),
    };
    let _serial = p.writeback.lock();
    let (blocks, serial) = {
        let st = p.state.normal(env)?;
        let volume = st.tags.as_ref().and_then(|t| t.volume(id));
        match volume {
            // Removed, or moved on, meanwhile: the next call looks again.
            Some(v) if v.recalc_pos == position => (v.blocks(), v.serial),
            _ => return Ok(progress_of(&st.tags)),
        }
    };
    let count = (INTEGRITY_STEP_BYTES / block_bytes)
        .max(1)
        .min(blocks - position);
    let mut buf = vec![0u8; (count * block_bytes) as usize];
    // The origin cannot change under this read: every origin writer holds
    // the write-back lock (or a lane of it) that we hold exclusively, and
    // so does a removal while it forgets a volume. The serial check below
    // is defence in depth: a step never applies what it read to a volume
    // other than the one it read for.
    let read = crate::origin_retry::read_origin(env, block_key(id, position), &mut buf);
    let mut st = p.state.normal(env)?;
    let same = |v: &&mut VolumeTags| v.serial == serial;
    let Some(volume) = st.tags.as_mut().and_then(|t| t.volume_mut(id)).filter(same) else {
        return Ok(progress_of(&st.tags));
    };
    read?;
    assert_eq!(volume.recalc_pos, position, "recalculation is serialized");
    let mut tagged = 0;
    for (k, block) in buf.chunks(block_bytes as usize).enumerate() {
        let lba = position + k as u64;
        if volume.get(lba) == TAG_UNSET {
            volume.set(lba, origin_tag(block_key(id, lba), block));
            tagged += 1;
        }
    }
    let after = position + count;
    volume.recalc_pos = after;
    Counters::add(&env.counters.recalc_blocks, count);
    let persist_every = (RECALC_PERSIST_EVERY_BYTES / block_bytes).max(1);
    if after >= blocks || after / persist_every != position / persist_every {
        st.write_superblock(env)?;
        if after >= blocks {
            tracing::info!(
                volume_id = id,
                "integrity recalculation complete: every origin block of the volume has a tag"
            );
        }
    }
    Ok(RecalcProgress {
        blocks_tagged: tagged,
        ..progress_of(&st.tags)
    })
}

/// The first volume (by id) with blocks left to recalculate, and where it
/// stands.
fn next_to_recalculate(tags: &Option<TagTable>) -> Option<(u16, u64)> {
    tags.as_ref()?
        .volumes()
        .iter()
        .find(|v| v.recalc_pos < v.blocks())
        .map(|v| (v.volume_id, v.recalc_pos))
}

/// Blocks recalculated (or never needing it) and blocks in all, over every
/// volume with tags.
pub(crate) fn progress_of(tags: &Option<TagTable>) -> RecalcProgress {
    let volumes = tags.as_ref().map_or(&[][..], |t| t.volumes());
    RecalcProgress {
        position_blocks: volumes.iter().map(|v| v.recalc_pos.min(v.blocks())).sum(),
        total_blocks: volumes.iter().map(|v| v.blocks()).sum(),
        blocks_tagged: 0,
    }
}
