//! The slow paths of a read, taken when a block failed its check: decide
//! under the engine lock whether the mapping (or the tag) moved meanwhile,
//! or the copy really is bad, and then serve, repair or refuse.

use cairn_format::block_checksum;

use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::index::Plan;
use crate::origin_check::{check_origin_data, judge};
use crate::read_kind::ReadKind;
use crate::retry::read_slot_retrying;
use crate::space;
use crate::state_lock::StateLock;
use crate::stats::Counters;

/// A mismatch that may have raced a write-back is re-read at most this
/// many times before it is reported.
const RECHECK_ROUNDS_MAX: usize = 4;

/// A cache hit that failed its checksum (or whose read failed): find out
/// whether the mapping moved under us, or the copy is really bad. A bad
/// clean copy is served from the origin and repaired; a bad dirty one is
/// marked corrupt and fails with EIO.
pub(crate) fn read_block_slow(
    env: &Env,
    state: &StateLock,
    lba: u64,
    kind: ReadKind,
    slot: u32,
    crc: u32,
    block: &mut [u8],
) -> EngineResult<()> {
    let c = &env.counters;
    let mut st = state.running(env)?;
    // Re-plan under the lock: nothing can move now.
    let (now_slot, now_crc) = match st.plan(env, lba, kind, block)? {
        Plan::Done => return Ok(()),
        Plan::Miss { tag, .. } => {
            drop(st);
            crate::origin_retry::read_origin(env, lba, block)?;
            return verify_origin_read(env, state, lba, kind, tag, block);
        }
        Plan::Cache { slot, crc } => (slot, crc),
    };
    // Retried under the lock (a device error is rare, and the mapping must
    // not move while it is judged).
    let read = read_slot_retrying(env, now_slot, block);
    if let Err(e) = &read {
        tracing::warn!("cache read of block {lba} failed: {e}");
    }
    if read.is_ok() && block_checksum(lba, block) == now_crc {
        Counters::add(kind.hits(c), 1);
        if (now_slot, now_crc) == (slot, crc) {
            // The mapping did not move, yet the first read was bad and the
            // device's copy is good: a failed batched read, or a stale
            // page-cache page (see `Device::drop_cached_pages`). Drop the
            // page so the next hit does not come here again.
            Counters::add(&c.hit_rereads_ok, 1);
            drop(st);
            if env.config.page_cache_reads {
                let at = env.slot_offset_bytes(slot);
                env.cache.drop_cached_pages(at, env.block_size_bytes as u64);
            }
        }
        return Ok(());
    }
    let delivered = match read {
        Ok(()) => true,
        // Not delivered is not corrupt: a dirty block keeps its only copy,
        // and the next read tries again.
        Err(e) if st.index.is_dirty(now_slot) => return Err(EngineError::Cache(e)),
        Err(_) => false,
    };
    if delivered {
        Counters::add(&c.checksum_mismatches, 1);
        if st.index.is_dirty(now_slot) {
            tracing::error!(
                lba,
                slot = now_slot,
                "dirty cache block failed its checksum"
            );
            st.index.mark_corrupt(now_slot);
            return Err(EngineError::DirtyBlockCorrupt { lba });
        }
    }
    // Clean: the origin has the data. Serve it and repair.
    tracing::warn!(
        lba,
        slot = now_slot,
        "clean cache block bad; serving from origin and repairing"
    );
    crate::origin_retry::read_origin(env, lba, block)?;
    // The lock is held: the tag cannot move under this check.
    let tag = st.tags.as_ref().and_then(|t| t.tag_of(lba));
    check_origin_data(env, lba, block, tag)?;
    st.index.retire(now_slot);
    if space::promote(env, &mut st, lba, block)? {
        Counters::add(&c.repairs, 1);
    }
    Ok(())
}

/// Check a block just read from the origin against the tag its read was
/// planned with. The read may have raced a write-back that moved the tag
/// (or cached the block): on a mismatch the block is planned again, and
/// only a mismatch against an unchanged tag is reported (EIO).
pub(crate) fn verify_origin_read(
    env: &Env,
    state: &StateLock,
    lba: u64,
    kind: ReadKind,
    planned: Option<u32>,
    block: &mut [u8],
) -> EngineResult<()> {
    if judge(env, lba, block, planned).is_ok() {
        return Ok(());
    }
    let mut tag = planned;
    for _ in 0..RECHECK_ROUNDS_MAX {
        let plan = state.running(env)?.plan(env, lba, kind, block)?;
        match plan {
            Plan::Done => return Ok(()),
            Plan::Cache { slot, crc } => {
                return read_block_slow(env, state, lba, kind, slot, crc, block)
            }
            Plan::Miss { tag: now, .. } if now == tag => break,
            Plan::Miss { tag: now, .. } => {
                crate::origin_retry::read_origin(env, lba, block)?;
                if judge(env, lba, block, now).is_ok() {
                    return Ok(());
                }
                tag = now;
            }
        }
    }
    check_origin_data(env, lba, block, tag)
}
