//! The write path on a cache that is not degraded: full blocks go into the
//! open record, partial blocks are read-modify-written, zero/discard become
//! logged ranges; space is reserved first (writers wait for write-back,
//! never fail); modes other than write-back write through before the
//! reply.

mod dirty_share;
mod origin_block;
mod partial;

pub(crate) use dirty_share::{default_dirty_share_pct, dirty_limit_blocks};

use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use cairn_format::{key_volume, RangeKind, PENDING_RANGES_MAX};

use crate::checkpoint;
use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::flush_by::FlushBy;
use crate::parts::Parts;
use crate::policy::CacheMode;
use crate::sealed::SealedRecord;
use crate::space::{self, Space};
use crate::state::State;
use crate::stats::Counters;
use crate::volume_set::VolumeSet;
use crate::want::Want;
pub(crate) use origin_block::OriginBlock;
use partial::write_partial;
pub(crate) use partial::PartialReads;

/// A checkpoint is taken once this fraction of the log (1/N) was written
/// since the last one: replay never covers more than that.
const CHECKPOINT_EVERY_LOG_FRACTION: u64 = 4;

/// How many blocks ahead a write loads the index cells of the blocks it
/// will insert (a whole 64 KiB write at 4 KiB blocks, and then some).
const PREFETCH_AHEAD_BLOCKS: u64 = 32;

/// Rounds of "the log is full: write back one group" a writer waits at
/// most before giving up with an error.
const SPACE_RETRIES_MAX: usize = 100_000;

/// Who runs the write-back steps a writer waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Waits {
    /// The writer, in its own thread, under [`write`] (blocking callers).
    Inline,
    /// The caller of [`write_from`]: it gets [`WriteStep::NeedsWriteback`]
    /// back, waits for the step as a task and calls again.
    Caller,
}

/// First and longest wait between tries of a write-back step that failed
/// because an origin did.
const FAILED_STEP_RETRY_FIRST: Duration = Duration::from_millis(50);
const FAILED_STEP_RETRY_MAX: Duration = Duration::from_secs(1);

/// The write-back rounds one write has waited for so far, for the bound
/// and the counters (a write that waited counts once, not per round), and
/// how long the write-back it waits for has been failing.
#[derive(Debug, Default)]
pub(crate) struct WaitRounds {
    space: usize,
    dirty_share: usize,
    /// When a step this write waited for first failed for its origin.
    failing_since: Option<Instant>,
    retry_in: Duration,
    /// Blocks written in part, read from the origin without the lock.
    pub(crate) partial: PartialReads,
}

impl WaitRounds {
    /// The write-back step this write waited for failed with `error`. An
    /// origin that fails is waited for, retrying, up to
    /// `space_wait_for_writeback_ms` in all: returns how long to wait
    /// before the next try. After that the write fails with ENOSPC (no
    /// room, for now): a client such as qemu then pauses instead of
    /// passing an I/O error to its guest. Any other failure is the write's.
    pub(crate) fn step_failed(&mut self, env: &Env, error: EngineError) -> EngineResult<Duration> {
        if !error.is_origin_failure() {
            return Err(error);
        }
        let since = *self.failing_since.get_or_insert_with(Instant::now);
        let limit = Duration::from_millis(env.config.space_wait_for_writeback_ms);
        let left = limit.saturating_sub(since.elapsed());
        if left.is_zero() {
            Counters::add(&env.counters.no_space_refusals, 1);
            return Err(EngineError::NoSpace {
                cause: error.to_string(),
            });
        }
        self.retry_in = (self.retry_in * 2).clamp(FAILED_STEP_RETRY_FIRST, FAILED_STEP_RETRY_MAX);
        Ok(self.retry_in.min(left))
    }
}

/// How far [`write_from`] got.
pub(crate) enum WriteStep {
    /// All of it is in the log, before `end_position` (the log position
    /// past its last block); the records it filled, claimed.
    Done {
        sealed: Vec<Arc<SealedRecord>>,
        end_position: u64,
    },
    /// The bytes before `resume_at` are in the log (the records they filled
    /// claimed in `sealed`); the rest waits for a write-back step `want`.
    NeedsWriteback {
        resume_at: u64,
        want: Want,
        sealed: Vec<Arc<SealedRecord>>,
    },
    /// The bytes before `resume_at` are in the log (the records they filled
    /// claimed in `sealed`); the next block, `key`, is written in part and
    /// is not cached: read it from the origin as a task (a miss planned
    /// with `stamp`), give it to the write's [`PartialReads`] and resume.
    NeedsOriginBlock {
        resume_at: u64,
        key: u64,
        stamp: crate::index::WriteStamp,
        sealed: Vec<Arc<SealedRecord>>,
    },
}

/// A space or dirty-share check: go on, or wait for a step first.
enum Room<'a> {
    Ready(MutexGuard<'a, State>),
    Wait(Want),
}

/// Write `data` at `offset` into the log, running the write-back it waits
/// for itself. Returns the records the write filled, claimed: the caller
/// writes them outside the lock (`sealed::write_claimed`), then writes
/// through to the origin in the modes other than write-back. Not durable
/// until a flush (a FUA write is this and then a flush: see
/// `Engine::write_async`). The engine's writes go through [`write_from`].
#[cfg(test)]
pub(crate) fn write(
    p: Parts<'_>,
    offset: u64,
    data: &[u8],
) -> EngineResult<Vec<Arc<SealedRecord>>> {
    match write_from(
        p,
        offset,
        data,
        offset,
        Waits::Inline,
        &mut WaitRounds::default(),
    )? {
        WriteStep::Done { sealed, .. } => Ok(sealed),
        WriteStep::NeedsWriteback { .. } | WriteStep::NeedsOriginBlock { .. } => {
            unreachable!("an inline write runs its write-back steps and origin reads itself")
        }
    }
}

/// The bytes of `data` (written at `offset`) from `from` on into the log.
/// With [`Waits::Caller`], stops where it must wait for write-back and
/// says so; the caller waits, then calls again from `resume_at`.
pub(crate) fn write_from(
    p: Parts<'_>,
    offset: u64,
    data: &[u8],
    from: u64,
    waits: Waits,
    rounds: &mut WaitRounds,
) -> EngineResult<WriteStep> {
    let env = p.env;
    let block_bytes = env.block_size_bytes as u64;
    let end = offset + data.len() as u64;
    assert!(offset <= from && from <= end, "resuming outside the write");
    // Reserve space in chunks, so a huge write never asks for more than a
    // fraction of the log at once.
    let chunk_blocks = (env.layout.log_blocks / 8).max(1);
    let mut st = p.state.normal(env)?;
    if waits == Waits::Caller && from == offset && end > offset {
        // Blocks covered in part that are not cached are read from the
        // origin without the lock, before anything of the write is in the
        // log: stopping halfway would let an epoch end with part of the
        // write, and write-back put a state on the origin that the volume
        // never had at a flush (the crash harness caught it).
        for (lba, _, _) in partial_edges(offset, end, block_bytes) {
            let Some(stamp) = st.index.origin_stamp(lba) else {
                continue;
            };
            if rounds.partial.wants_read(lba, stamp) {
                let sealed = st.log.claim_filled();
                return Ok(WriteStep::NeedsOriginBlock {
                    resume_at: offset,
                    key: lba,
                    stamp,
                    sealed,
                });
            }
        }
    }
    let mut at = from;
    while at < end {
        let first = at / block_bytes;
        let chunk_end = ((first + chunk_blocks) * block_bytes).min(end);
        let blocks = (chunk_end - first * block_bytes).div_ceil(block_bytes);
        let room = dirty_share::wait_within(p, st, key_volume(first), blocks, waits, rounds)?;
        st = match room {
            Room::Ready(st) => st,
            Room::Wait(want) => return needs_writeback(p, at, want),
        };
        st = match reserve(p, st, blocks, 0, waits, rounds)? {
            Room::Ready(st) => st,
            Room::Wait(want) => return needs_writeback(p, at, want),
        };
        // The index cells of the next blocks are loaded ahead, so their
        // misses overlap: a write of 16 blocks otherwise waited for 16
        // misses in a row (a tenth of a connection's CPU on 64 KiB writes).
        let end_lba = chunk_end.div_ceil(block_bytes);
        let first_lba = at / block_bytes;
        for lba in first_lba..end_lba.min(first_lba + PREFETCH_AHEAD_BLOCKS) {
            st.index.prefetch(lba);
        }
        while at < chunk_end {
            let lba = at / block_bytes;
            if lba + PREFETCH_AHEAD_BLOCKS < end_lba {
                st.index.prefetch(lba + PREFETCH_AHEAD_BLOCKS);
            }
            let within = (at % block_bytes) as usize;
            let n = (block_bytes as usize - within).min((chunk_end - at) as usize);
            let src = &data[(at - offset) as usize..(at - offset) as usize + n];
            if within == 0 && n == block_bytes as usize {
                let st = &mut *st;
                st.log.append_data(env, &mut st.index, lba, src, false)?;
            } else {
                write_partial(env, &mut st, lba, within, src, &mut rounds.partial)?;
            }
            at += n as u64;
        }
    }
    // Records this write filled are written outside the lock, so other
    // writers keep going and several records are in flight at once.
    Ok(WriteStep::Done {
        sealed: st.log.claim_filled(),
        end_position: st.log.append_position(),
    })
}

/// A write stopped at `resume_at` to wait for `want`: the records it filled
/// so far are claimed, for the caller to write before it waits.
fn needs_writeback(p: Parts<'_>, resume_at: u64, want: Want) -> EngineResult<WriteStep> {
    let sealed = p.state.normal(p.env)?.log.claim_filled();
    Ok(WriteStep::NeedsWriteback {
        resume_at,
        want,
        sealed,
    })
}

/// Zero or discard a range, then, in the modes other than write-back,
/// write it through (running the write-back steps itself; see
/// [`zero_range_logged`] and [`write_through_async`] for a task).
pub(crate) fn zero_range(
    p: Parts<'_>,
    offset: u64,
    length_bytes: u64,
    kind: RangeKind,
) -> EngineResult<()> {
    zero_range_logged(p, offset, length_bytes, kind)?;
    let block_bytes = p.env.block_size_bytes as u64;
    let mode = p.policy.mode_of(key_volume(offset / block_bytes));
    if mode != CacheMode::WriteBack {
        let end = (offset + length_bytes).div_ceil(block_bytes);
        write_through(p, mode, offset / block_bytes, end)?;
    }
    Ok(())
}

/// Zero or discard a range in the log. Whole blocks become a logged range
/// (no data is written); partial blocks at the edges of a zero are zeroed
/// by read-modify-write (a discard, a hint, leaves them alone). Returns
/// the log position past it (what a write-through waits for).
pub(crate) fn zero_range_logged(
    p: Parts<'_>,
    offset: u64,
    length_bytes: u64,
    kind: RangeKind,
) -> EngineResult<u64> {
    let env = p.env;
    let block_bytes = env.block_size_bytes as u64;
    let end = offset + length_bytes;
    let first_full = offset.div_ceil(block_bytes);
    let end_full = end / block_bytes;
    let mut st = p.state.normal(env)?;
    if kind == RangeKind::Zero {
        let zeroes = vec![0u8; block_bytes as usize];
        for (lba, within, n) in partial_edges(offset, end, block_bytes) {
            st = reserve_inline(p, st, 1, 0)?;
            let mut reads = PartialReads::default();
            write_partial(env, &mut st, lba, within, &zeroes[..n], &mut reads)?;
        }
    }
    let mut lba = first_full;
    while lba < end_full {
        let count = (end_full - lba).min(u32::MAX as u64);
        st = reserve_inline(p, st, 0, 2)?;
        let st = &mut *st;
        st.log.append_range(env, &mut st.index, kind, lba, count)?;
        lba += count;
    }
    Ok(st.log.append_position())
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
pub(crate) async fn flush(p: Parts<'_>, by: FlushBy) -> EngineResult<()> {
    let env = p.env;
    let target = {
        let mut st = p.state.normal(env)?;
        let st = &mut *st;
        st.log.seal_for_flush(env, &mut st.index)?
    };
    match target {
        None => Ok(()),
        Some(target) => p.commit.wait_durable(env, p.state, target, by).await,
    }
}

/// Make room for `blocks` data blocks and `ranges` range entries, waiting
/// for write-back if the log is full of dirty data. Writers wait; they
/// never fail for lack of space and nothing is dropped. With
/// [`Waits::Caller`], the wait is the caller's: the lock is given up and
/// the step to wait for returned.
fn reserve<'a>(
    p: Parts<'a>,
    mut st: MutexGuard<'a, State>,
    blocks: u64,
    ranges: usize,
    waits: Waits,
    rounds: &mut WaitRounds,
) -> EngineResult<Room<'a>> {
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
    while rounds.space < SPACE_RETRIES_MAX {
        let ranges_full = st.index.range_count() + ranges > PENDING_RANGES_MAX;
        match space::ensure_space(env, &mut st, blocks)? {
            Space::Ready if !ranges_full => return Ok(Room::Ready(st)),
            _ => {
                // Writes that waited, not rounds: a round may only wait
                // for another thread's step.
                if rounds.space == 0 {
                    Counters::add(&env.counters.writeback_stalls, 1);
                }
                rounds.space += 1;
                if st.log.writeback_position() == st.log.writeback_limit() {
                    // No complete epoch to write back: end one now.
                    Counters::add(&env.counters.internal_flushes, 1);
                    st.flush(env)?;
                }
                drop(st);
                // The tail waits for the least write-back position.
                if waits == Waits::Caller {
                    return Ok(Room::Wait(Want::Laggards));
                }
                if let Err(e) = p.writeback.run_group(env, p.state, Want::Laggards) {
                    std::thread::sleep(rounds.step_failed(env, e)?);
                }
                st = p.state.normal(env)?;
            }
        }
    }
    Err(EngineError::Failed(
        "no log space could be reclaimed after many write-back rounds".into(),
    ))
}

/// [`reserve`] for callers that run their write-back themselves.
fn reserve_inline<'a>(
    p: Parts<'a>,
    st: MutexGuard<'a, State>,
    blocks: u64,
    ranges: usize,
) -> EngineResult<MutexGuard<'a, State>> {
    match reserve(
        p,
        st,
        blocks,
        ranges,
        Waits::Inline,
        &mut WaitRounds::default(),
    )? {
        Room::Ready(st) => Ok(st),
        Room::Wait(_) => unreachable!("an inline reservation runs its write-back itself"),
    }
}

/// The modes other than write-back acknowledge a write only once the
/// origin has it: the write goes through the log as usual (so ordering and
/// crash safety are the same), is made durable, and is written back before
/// the reply. Write-around and pass-through then drop the new cached copy.
/// Runs the write-back steps itself (blocking callers; see
/// [`write_through_async`]).
pub(crate) fn write_through(
    p: Parts<'_>,
    mode: CacheMode,
    first: u64,
    end: u64,
) -> EngineResult<()> {
    let env = p.env;
    Counters::add(&env.counters.writethrough_waits, 1);
    p.state.normal(env)?.flush(env)?;
    let volume = key_volume(first);
    let target = p.state.normal(env)?.log.writeback_limit();
    for _ in 0..=env.layout.log_blocks {
        if volume_position(p, volume)? >= target {
            break;
        }
        p.writeback
            .run_group(env, p.state, Want::Progress(VolumeSet::single(volume)))?;
    }
    finish_write_through(p, mode, first, end, target)
}

/// [`write_through`] as a task, for a write that is in the log before
/// `end_position`. The write-back steps, and the epoch end its write needs
/// first ([`Want::Through`]), are waited for as a task
/// ([`crate::writeback::Writeback::step_for`]): its event loop serves its
/// other requests meanwhile, and the write-through writes in flight share
/// epochs and steps. 32 of them in flight over a 5 ms origin were written
/// back one after another (an epoch and a step each: 163 IOPS where the
/// origin alone took 3,115).
pub(crate) async fn write_through_async(
    p: Parts<'_>,
    mode: CacheMode,
    first: u64,
    end: u64,
    end_position: u64,
) -> EngineResult<()> {
    let env = p.env;
    Counters::add(&env.counters.writethrough_waits, 1);
    let volume = key_volume(first);
    // Each round ends an epoch or steps (or waits for a step) of this
    // volume; the log holds at most `log_blocks` epochs.
    for _ in 0..=2 * env.layout.log_blocks + 1 {
        if volume_position(p, volume)? >= end_position {
            break;
        }
        p.writeback
            .step_for(env, p.state, Want::Through(volume))
            .await?;
    }
    finish_write_through(p, mode, first, end, end_position)
}

/// Volume `volume`'s write-back position.
fn volume_position(p: Parts<'_>, volume: u16) -> EngineResult<u64> {
    p.state
        .normal(p.env)?
        .log
        .volume_writeback_position(volume)
        .ok_or(EngineError::NoSuchVolume { volume_id: volume })
}

/// The end of a write-through write whose epoch ends at `target`: it must
/// be on its origin (its volume's write-back passed `target`), and in the
/// modes that keep no written copy its cached copies are dropped.
fn finish_write_through(
    p: Parts<'_>,
    mode: CacheMode,
    first: u64,
    end: u64,
    target: u64,
) -> EngineResult<()> {
    let env = p.env;
    // The write was sealed before the last durable epoch end `target`; it
    // is on the origin once its own volume's write-back passed that
    // (another volume's failing origin does not hold it back).
    let volume = key_volume(first);
    let mut st = p.state.normal(env)?;
    let position = st
        .log
        .volume_writeback_position(volume)
        .ok_or(EngineError::NoSuchVolume { volume_id: volume })?;
    if position < target {
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
