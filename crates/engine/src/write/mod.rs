//! The write path on a cache that is not degraded: full blocks go into the
//! open record, partial blocks are read-modify-written, zero/discard become
//! logged ranges; space is reserved first (writers wait for write-back,
//! never fail); modes other than write-back write through before the
//! reply.

mod dirty_share;
mod partial;

pub(crate) use dirty_share::{default_dirty_share_pct, dirty_limit_blocks};

use std::sync::MutexGuard;

use cairn_format::{key_volume, RangeKind, PENDING_RANGES_MAX};

use crate::checkpoint;
use crate::error::{EngineError, EngineResult};
use crate::parts::Parts;
use crate::policy::CacheMode;
use crate::space::{self, Space};
use crate::state::State;
use crate::stats::Counters;
use crate::volume_set::VolumeSet;
use crate::writeback::Want;
use partial::write_partial;

/// A checkpoint is taken once this fraction of the log (1/N) was written
/// since the last one: replay never covers more than that.
const CHECKPOINT_EVERY_LOG_FRACTION: u64 = 4;

/// Rounds of "the log is full: write back one group" a writer waits at
/// most before giving up with an error.
const SPACE_RETRIES_MAX: usize = 100_000;

/// Write `data` at `offset` into the log. Returns the records the write
/// filled, claimed: the caller writes them outside the lock
/// (`sealed::write_claimed`), then writes through to the origin in the
/// modes other than write-back ([`write_through`]). Not durable until a
/// flush (a FUA write is this and then a flush: see `Engine::write_async`).
pub(crate) fn write(
    p: Parts<'_>,
    offset: u64,
    data: &[u8],
) -> EngineResult<Vec<std::sync::Arc<crate::sealed::SealedRecord>>> {
    let env = p.env;
    let block_bytes = env.block_size_bytes as u64;
    let end = offset + data.len() as u64;
    // Reserve space in chunks, so a huge write never asks for more than a
    // fraction of the log at once.
    let chunk_blocks = (env.layout.log_blocks / 8).max(1);
    let mut st = p.state.normal(env)?;
    let mut at = offset;
    while at < end {
        let first = at / block_bytes;
        let chunk_end = ((first + chunk_blocks) * block_bytes).min(end);
        let blocks = (chunk_end - first * block_bytes).div_ceil(block_bytes);
        st = dirty_share::wait_within(p, st, key_volume(first), blocks)?;
        st = reserve(p, st, blocks, 0)?;
        while at < chunk_end {
            let lba = at / block_bytes;
            let within = (at % block_bytes) as usize;
            let n = (block_bytes as usize - within).min((chunk_end - at) as usize);
            let src = &data[(at - offset) as usize..(at - offset) as usize + n];
            if within == 0 && n == block_bytes as usize {
                let st = &mut *st;
                st.log.append_data(env, &mut st.index, lba, src, false)?;
            } else {
                Counters::add(&env.counters.write_rmw, 1);
                write_partial(env, &mut st, lba, within, src)?;
            }
            at += n as u64;
        }
    }
    // Records this write filled are written outside the lock, so other
    // writers keep going and several records are in flight at once.
    Ok(st.log.claim_filled())
}

/// Zero or discard a range. Whole blocks become a logged range (no data is
/// written); partial blocks at the edges of a zero are zeroed by
/// read-modify-write (a discard, a hint, leaves them alone).
pub(crate) fn zero_range(
    p: Parts<'_>,
    offset: u64,
    length_bytes: u64,
    kind: RangeKind,
) -> EngineResult<()> {
    let env = p.env;
    let block_bytes = env.block_size_bytes as u64;
    let end = offset + length_bytes;
    let first_full = offset.div_ceil(block_bytes);
    let end_full = end / block_bytes;
    let mut st = p.state.normal(env)?;
    if kind == RangeKind::Zero {
        let zeroes = vec![0u8; block_bytes as usize];
        for (lba, within, n) in partial_edges(offset, end, block_bytes) {
            st = reserve(p, st, 1, 0)?;
            write_partial(env, &mut st, lba, within, &zeroes[..n])?;
        }
    }
    let mut lba = first_full;
    while lba < end_full {
        let count = (end_full - lba).min(u32::MAX as u64);
        st = reserve(p, st, 0, 2)?;
        let st = &mut *st;
        st.log.append_range(env, &mut st.index, kind, lba, count)?;
        lba += count;
    }
    drop(st);
    let mode = p
        .policy
        .mode_of(cairn_format::key_volume(offset / block_bytes));
    if mode != CacheMode::WriteBack {
        write_through(p, mode, offset / block_bytes, end.div_ceil(block_bytes))?;
    }
    Ok(())
}

/// The blocks of `[offset, end)` covered only in part, as (lba, first byte
/// covered, bytes covered); at most two, each once.
pub(crate) fn partial_edges(offset: u64, end: u64, block_bytes: u64) -> Vec<(u64, usize, usize)> {
    let mut edges: Vec<(u64, usize, usize)> = Vec::new();
    for lba in [offset / block_bytes, (end - 1) / block_bytes] {
        let block_start = lba * block_bytes;
        let lo = offset.max(block_start);
        let hi = end.min(block_start + block_bytes);
        if hi - lo < block_bytes && !edges.iter().any(|&(l, _, _)| l == lba) {
            edges.push((lba, (lo - block_start) as usize, (hi - lo) as usize));
        }
    }
    edges
}

/// A client flush: seal what is open and wait (as a task) until it and
/// everything sealed before it is durable, sharing the barrier with every
/// flush that arrives meanwhile (see `crate::commit`).
pub(crate) async fn flush(p: Parts<'_>) -> EngineResult<()> {
    let env = p.env;
    let target = {
        let mut st = p.state.normal(env)?;
        let st = &mut *st;
        st.log.seal_for_flush(env, &mut st.index)?
    };
    match target {
        None => Ok(()),
        Some(target) => p.commit.wait_durable(env, p.state, target).await,
    }
}

/// Make room for `blocks` data blocks and `ranges` range entries, running
/// write-back if the log is full of dirty data. Writers wait; they never
/// fail for lack of space and nothing is dropped.
fn reserve<'a>(
    p: Parts<'a>,
    mut st: MutexGuard<'a, State>,
    blocks: u64,
    ranges: usize,
) -> EngineResult<MutexGuard<'a, State>> {
    let env = p.env;
    if st.log.unsynced_blocks() >= env.config.unsynced_blocks_max {
        Counters::add(&env.counters.internal_flushes, 1);
        st.flush(env)?;
    }
    // Bound recovery: replay never covers more than a fraction of the log.
    if st.log.head() - st.log.checkpoint_head()
        > st.log.slot_count() / CHECKPOINT_EVERY_LOG_FRACTION
    {
        checkpoint::write(env, &mut st)?;
    }
    for retry in 0..SPACE_RETRIES_MAX {
        let ranges_full = st.index.range_count() + ranges > PENDING_RANGES_MAX;
        match space::ensure_space(env, &mut st, blocks)? {
            Space::Ready if !ranges_full => return Ok(st),
            _ => {
                // Writes that waited, not rounds: a round may only wait
                // for another thread's step.
                if retry == 0 {
                    Counters::add(&env.counters.writeback_stalls, 1);
                }
                if st.log.writeback_position() == st.log.writeback_limit() {
                    // No complete epoch to write back: end one now.
                    Counters::add(&env.counters.internal_flushes, 1);
                    st.flush(env)?;
                }
                drop(st);
                // The tail waits for the least write-back position.
                p.writeback.run_group(env, p.state, Want::Laggards)?;
                st = p.state.normal(env)?;
            }
        }
    }
    Err(EngineError::Failed(
        "no log space could be reclaimed after many write-back rounds".into(),
    ))
}

/// The modes other than write-back acknowledge a write only once the
/// origin has it: the write goes through the log as usual (so ordering and
/// crash safety are the same), is made durable, and is written back before
/// the reply. Write-around and pass-through then drop the new cached copy.
pub(crate) fn write_through(
    p: Parts<'_>,
    mode: CacheMode,
    first: u64,
    end: u64,
) -> EngineResult<()> {
    let env = p.env;
    Counters::add(&env.counters.writethrough_waits, 1);
    p.state.normal(env)?.flush(env)?;
    // The write is sealed before the last durable epoch end now; it is on
    // the origin once its own volume's write-back passed that (another
    // volume's failing origin does not hold it back).
    let volume = key_volume(first);
    let target = p.state.normal(env)?.log.writeback_limit();
    let position = |st: &State| {
        st.log
            .volume_writeback_position(volume)
            .ok_or(EngineError::NoSuchVolume { volume_id: volume })
    };
    for _ in 0..=env.layout.log_blocks {
        if position(&*p.state.normal(env)?)? >= target {
            break;
        }
        p.writeback
            .run_group(env, p.state, Want::Progress(VolumeSet::single(volume)))?;
    }
    let mut st = p.state.normal(env)?;
    if position(&st)? < target {
        // Each round stepped or waited for a step of this volume; steps
        // that kept failing without an error reaching this writer end here.
        return Err(EngineError::Failed(format!(
            "a write-through write of volume {volume} did not reach its origin after {} write-back rounds",
            env.layout.log_blocks + 1
        )));
    }
    if !mode.keeps_written_copy() && end - first <= 65536 {
        for lba in first..end {
            if let Some(slot) = st.index.lookup(lba) {
                if !st.index.is_dirty(slot) {
                    st.index.retire(slot);
                }
            }
        }
    }
    Ok(())
}
