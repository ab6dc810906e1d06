//! Judging a block read from the origin against its integrity tag.

use cairn_format::{key_lba, key_volume, tag_matches, TAG_UNSET};

use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::stats::Counters;

/// Judge one origin block against its tag and report a mismatch (counted,
/// logged, EIO). Call only where the tag cannot have moved since it was
/// taken (the engine lock or the write-back lock is held).
pub(crate) fn check_origin_data(
    env: &Env,
    lba: u64,
    block: &[u8],
    tag: Option<u32>,
) -> EngineResult<()> {
    judge(env, lba, block, tag).inspect_err(|_| report_mismatch(env, lba))
}

/// Judge one origin block against its tag, counting verified and
/// unverified reads; `Err` on a mismatch, which the caller reports (or
/// rechecks first).
pub(crate) fn judge(env: &Env, lba: u64, block: &[u8], tag: Option<u32>) -> EngineResult<()> {
    let Some(tag) = tag else {
        return Ok(());
    };
    match tag_matches(tag, lba, block) {
        Some(true) => {
            Counters::add(&env.counters.origin_verified_reads, 1);
            Ok(())
        }
        None => {
            if tag == TAG_UNSET {
                Counters::add(&env.counters.origin_unverified_reads, 1);
            }
            Ok(())
        }
        Some(false) => Err(EngineError::OriginCorrupt {
            volume_id: key_volume(lba),
            lba: key_lba(lba),
            offset_bytes: key_lba(lba) * env.block_size_bytes as u64,
        }),
    }
}

pub(crate) fn report_mismatch(env: &Env, lba: u64) {
    Counters::add(&env.counters.origin_mismatches, 1);
    tracing::error!(
        volume_id = key_volume(lba),
        lba = key_lba(lba),
        offset_bytes = key_lba(lba) * env.block_size_bytes as u64,
        "origin block does not match its integrity tag; returning EIO"
    );
}
