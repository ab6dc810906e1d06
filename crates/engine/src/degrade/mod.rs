//! Degraded mode: what the engine does when the cache device stops taking
//! writes.
//!
//! A cache write that fails is first retried (`crate::retry`, and whole
//! checkpoints). When it fails for good, the engine's health marks a
//! degrade as pending and nothing more is written to the log. The next
//! request (any thread) runs [`enter`]:
//!
//! 1. every complete epoch group not yet written back (data durable in the
//!    log) is read from the cache, verified and copied to the origin, each
//!    followed by an origin flush: ordinary ordered write-back;
//! 2. the records sealed after the last epoch end are read back (verified);
//! 3. the superblock is written with the DEGRADED flag, to both copies,
//!    each with a barrier;
//! 4. those records and then the open record (acknowledged writes that
//!    were never flushed, or never reached the cache at all) go to the
//!    origin as one group with one flush, and the open record's slots leave
//!    the index.
//!
//! Only then does any request go straight to the origin. Nothing that is
//! not durable in the log reaches the origin before the DEGRADED flag is
//! durable, so a restart either replays a log that is at least as new as
//! the origin (flag not durable) or never replays it again (flag durable):
//! no record older than the origin's copy can be replayed over it. If step
//! 1 or 2 fails (a cache read, an origin write), nothing was done but
//! ordinary write-back and nothing was taken out of the log: the degrade
//! stays pending, the request fails, and a request after a wait tries
//! again (a clean shutdown at once), up to [`DEGRADE_ATTEMPTS_MAX`]
//! failures of the cache device (an origin that fails is waited for). If a
//! later step fails, or the attempts are spent, the engine stops (every
//! request fails) and nothing is written through. Once the flag is
//! durable, open never replays or reads the cache again (see
//! `crate::open`).
//!
//! Degraded writes, zeroes and discards (`degraded_io`) drop the cached
//! copy of every block they change, then write the origin and flush it
//! before the reply. Reads still use clean cached copies of blocks not
//! written since (they are verified like every cache read, and the cache is
//! never written again, so a slot can never change under its mapping);
//! everything else is read from the origin. See `docs/design.md`.

mod degraded_io;

pub(crate) use degraded_io::{degraded_flush, degraded_write, degraded_zero_range};

use std::time::Duration;

use cairn_format::{RecordHeader, FEATURE_DEGRADED, VOLUMES_MAX};

use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::group::{self, GroupRecord};
use crate::log::record_start;
use crate::parts::Parts;
use crate::state::State;
use crate::stats::Counters;
use crate::superblocks;
use crate::volume_set::VolumeSet;

/// Most attempts at the switch to degraded mode whose first steps fail (a
/// cache read of dirty data, an origin write) before the engine stops. A
/// failing device often fails some reads and not others: a switch that
/// stopped at the first read error left a daemon that fails every request
/// when the next attempt would have succeeded.
pub(crate) const DEGRADE_ATTEMPTS_MAX: u32 = 8;

/// The wait after the first failed attempt, in cache write backoffs
/// (`EngineConfig::cache_write_backoff_us`, 5 ms by default: 100 ms),
/// doubled after each further one (eight cache failures alone spread over
/// about 13 s). Meanwhile writes and flushes fail at once without a new
/// attempt; reads are served.
const DEGRADE_RETRY_WAIT_BACKOFFS: u64 = 20;

/// The wait stops doubling after this many failures (at 6.4 s by default),
/// so attempts over an origin that is down (which are not counted) keep
/// coming.
const DEGRADE_WAIT_DOUBLINGS_MAX: u32 = 6;

/// Why a switch to degraded mode did not complete.
enum SwitchError {
    /// Steps 1 or 2 failed: nothing but ordinary write-back was done and
    /// the log is whole, so the switch can be tried again.
    Retryable(EngineError),
    /// A later step failed: the log's unflushed records were taken out of
    /// it, or the DEGRADED flag may be half written. Only a restart
    /// (recovering from the log) is safe.
    Fatal(EngineError),
}

/// Enter degraded mode (see the module comment). Serialised with
/// write-back; the engine lock is held for the whole drain, so requests
/// wait for it. Idempotent: a second caller finds it done.
/// Once a clean shutdown has begun, attempts are not paced.
pub(crate) fn enter(p: Parts<'_>) -> EngineResult<()> {
    let env = p.env;
    let paced = !env.health.is_shutting_down();
    let _writeback = p.writeback.lock();
    let mut st = p.state.unchecked();
    env.health.check_running()?;
    if env.health.is_degraded() {
        return Ok(());
    }
    let reason = env
        .health
        .degrade_reason()?
        .expect("degrade runs only after a cache write failed for good");
    if let Some((left, failure)) = env.health.degrade_retry_wait().filter(|_| paced) {
        return Err(EngineError::DegradeDelayed {
            failure,
            retry_in_ms: left.as_millis().max(1) as u64,
        });
    }
    tracing::error!(
        dirty_blocks = st.index.dirty_blocks(),
        "cache device write failed ({reason}): writing every dirty block back to the origin before going degraded"
    );
    let failure = match drain_and_mark_degraded(env, &mut st) {
        Ok(drained_blocks) => {
            env.health.set_degraded();
            Counters::add(&env.counters.degrade_drained_blocks, drained_blocks);
            tracing::error!(
                drained_blocks,
                "cache {} is DEGRADED: every dirty block is on the origin and the DEGRADED flag is durable. From now on every write goes straight to the origin and is acknowledged once durable there; unchanged clean blocks are still read from the cache. The cache device must be fixed or replaced, then formatted again, to cache again",
                env.cache.name()
            );
            return Ok(());
        }
        Err(SwitchError::Retryable(e)) => {
            // An origin that fails is waited for as ordinary write-back
            // waits for it, without end: only failures of the cache device
            // count towards the attempts.
            let counted = !matches!(e, EngineError::Origin(_));
            let failed_before = env.health.degrade_failures_total();
            let wait_us = env
                .config
                .cache_write_backoff_us
                .saturating_mul(DEGRADE_RETRY_WAIT_BACKOFFS)
                .saturating_mul(1 << failed_before.min(DEGRADE_WAIT_DOUBLINGS_MAX));
            let failed = env.health.degrade_attempt_failed(
                e.to_string(),
                Duration::from_micros(wait_us),
                counted,
            );
            if failed < DEGRADE_ATTEMPTS_MAX {
                Counters::add(&env.counters.degrade_retries, 1);
                tracing::error!(
                    failures = failed_before + 1,
                    cache_failures = failed,
                    cache_failures_max = DEGRADE_ATTEMPTS_MAX,
                    retry_in_ms = wait_us / 1000,
                    "entering degraded mode failed ({e}) before anything but ordinary write-back was done: the log is whole and the cache is not written; requests fail until the next attempt"
                );
                return Err(e);
            }
            format!("{e} (attempt {failed} of {DEGRADE_ATTEMPTS_MAX})")
        }
        Err(SwitchError::Fatal(e)) => e.to_string(),
    };
    let stopped = format!(
        "{reason}; then entering degraded mode failed ({failure}), so nothing was written through to the origin"
    );
    tracing::error!(
        "cache device failed and degraded mode could not be entered: {failure}. The engine is stopped: every request fails until restart. The cache and the origin are as the ordinary write-back left them; a restart recovers from the log"
    );
    env.health.stop(stopped.clone());
    Err(EngineError::Failed(stopped))
}

/// Steps 1 to 4 of the module comment. Returns the blocks written back.
fn drain_and_mark_degraded(env: &Env, st: &mut State) -> Result<u64, SwitchError> {
    // The open record, if any, starts at the head: every sealed record
    // lies before it.
    let end = st.log.head();
    if let Some(start) = st.log.open_start() {
        assert_eq!(start, end, "the open record starts at the head");
    }
    let mut drained_blocks = drain_flushed_groups(env, st).map_err(SwitchError::Retryable)?;
    let on_device = read_unflushed(env, st, end).map_err(SwitchError::Retryable)?;
    // Nothing was taken out of the log up to here.
    let (unflushed, sealed_count, from, to) = take_unflushed(env, st, end, on_device);
    mark_degraded(env, st).map_err(SwitchError::Fatal)?;
    drained_blocks +=
        write_unflushed(env, st, unflushed, sealed_count, from, to).map_err(SwitchError::Fatal)?;
    // Nothing is dirty any more; what stays in the index are clean copies
    // (and corrupt ones, which keep reading as EIO).
    st.log.drained();
    st.index.mark_all_written_back();
    // Integrity tags live on the cache device, which is not written again:
    // they could never be persisted, and a restart ignores the cache.
    // Origin reads are not verified from here on.
    if st.tags.take().is_some() {
        tracing::error!(
            "integrity tags are dropped with the cache: origin reads are not verified while degraded"
        );
    }
    Ok(drained_blocks)
}

/// Step 1: complete epoch groups (up to the last durable epoch end), as
/// write-back does: only data that is durable in the log reaches the
/// origin, and the origin stays the volume as of a flush.
fn drain_flushed_groups(env: &Env, st: &mut State) -> EngineResult<u64> {
    let slot_count = st.log.slot_count();
    let mut drained_blocks = 0;
    // Bounded: each group moves at least one volume forward. Volumes that
    // lag (their origin failed) are written back first, group by group,
    // and a group is written to a volume only from its own position on:
    // another volume's older group written again would take that origin
    // back to a state that never existed.
    for _ in 0..=(slot_count + 1) * VOLUMES_MAX as u64 {
        let start = st.log.writeback_position();
        let limit = st.log.writeback_limit();
        if start >= limit {
            break;
        }
        let served = st.log.writeback_cursors().at(start, VolumeSet::all());
        let (records, end) = group::read_for_writeback(env, start, limit, slot_count, served)?;
        let mut applied = group::apply(env, &records, served);
        group::commit(env, st, start, end, &records, &applied);
        drained_blocks += applied.blocks_written;
        if let Some((_, e)) = applied.failed.pop() {
            return Err(e);
        }
    }
    assert_eq!(
        st.log.writeback_position(),
        st.log.writeback_limit(),
        "every complete epoch is on the origin"
    );
    Ok(drained_blocks)
}

/// The unflushed records of step 2/4, in log order.
type Unflushed = Vec<GroupRecord>;

/// The unflushed records on the device (step 2), read before anything is
/// taken out of the log: the records and the log range `[from, to)` they
/// cover.
struct OnDevice {
    records: Unflushed,
    from: u64,
    to: u64,
    /// Where the records kept in memory start (the head if none are).
    memory_start: u64,
}

/// Step 2: the rest was acknowledged but never flushed: records sealed
/// after the last epoch end, then the open record (the current request's
/// writes may be among them; it is re-run after the switch). The records
/// up to those still queued in memory (whose write failed, never started,
/// or completed behind one that had not: see `crate::sealed`) are read from
/// the device here, in log order, changing nothing: if the log cannot be
/// read, the switch can be tried again.
fn read_unflushed(env: &Env, st: &State, end: u64) -> EngineResult<OnDevice> {
    let slot_count = st.log.slot_count();
    let cache_end = st.log.settle_unflushed(env).unwrap_or(end);
    let from = st.log.writeback_position();
    let mut records = Vec::new();
    let mut position = from;
    for _ in 0..=slot_count {
        if record_start(position, slot_count) >= cache_end {
            break;
        }
        let (mut more, next) = group::read(env, position, cache_end, slot_count)?;
        records.append(&mut more);
        position = next;
    }
    assert!(
        record_start(position, slot_count) >= cache_end,
        "degrade read every sealed record"
    );
    Ok(OnDevice {
        records,
        from,
        to: position,
        memory_start: cache_end,
    })
}

/// Step 2, continued: the records kept in memory and the open record are
/// taken out of the log, after the ones read from the device. Their slots
/// leave the index (the origin gets their data in step 4). Returns the
/// records, how many of them were read from the device, and the log range
/// `[from, to)` those cover.
fn take_unflushed(
    env: &Env,
    st: &mut State,
    end: u64,
    on_device: OnDevice,
) -> (Unflushed, usize, u64, u64) {
    let OnDevice {
        mut records,
        from,
        to,
        memory_start,
    } = on_device;
    let (queued, open) = st.log.take_unflushed();
    assert_eq!(
        queued.first().map_or(end, |r| r.start),
        memory_start,
        "the queue did not change since it settled"
    );
    let sealed_count = records.len();
    for (i, record) in queued.iter().enumerate() {
        let next_start = queued.get(i + 1).map_or(end, |r| r.start);
        assert!(record.start < next_start, "queued records are in log order");
        records.push(group::record_from_memory(
            env,
            record.start,
            record.header_fields.clone(),
            &record.data,
        ));
        // It may never have reached the cache device.
        forget_record(st, record.start, record.data_count);
    }
    if let Some(open) = open {
        let header = RecordHeader {
            sequence: 0,
            log_offset: open.start(),
            generation: 0,
            durable_sequence: 0,
            prev_crc: 0,
            format_tag: 0,
            flags: 0,
            entries: open.entries().to_vec(),
        };
        records.push(group::record_from_memory(
            env,
            open.start(),
            header,
            open.data(),
        ));
        // It never reached the cache device.
        forget_record(st, open.start(), open.data_count());
    }
    (records, sealed_count, from, to)
}

/// The slots and ranges of a record held only in memory leave the index.
fn forget_record(st: &mut State, start: u64, data_count: u64) {
    for k in 0..data_count {
        let slot = st.log.phys(start + 1 + k);
        if st.index.is_live(slot) {
            st.index.retire(slot);
        }
    }
    st.index.retire_ranges(VolumeSet::all(), start, start + 1);
}

/// Step 3: DEGRADED, durable in both superblock copies, BEFORE any
/// unflushed data reaches the origin. Were it the other way round, a crash
/// in between would replay the log over an origin newer than it: reads
/// would serve the log's older copy of a block, and later (once evicted)
/// the origin's newer one. From here on a restart never replays the log,
/// whichever copy survives; it serves the origin, which holds at least
/// every flushed write (step 1).
fn mark_degraded(env: &Env, st: &mut State) -> EngineResult<()> {
    st.superblock.features |= FEATURE_DEGRADED;
    st.superblock.writeback_offset = st.log.writeback_position();
    for _ in 0..2 {
        superblocks::write_next(env, &mut st.superblock, true).map_err(EngineError::Cache)?;
    }
    st.log.writeback_position_persisted();
    Ok(())
}

/// Step 4: the unflushed rest, as one group with one origin flush: the
/// origin goes from the last flushed state straight to the acknowledged
/// one (plus possibly part of the request in flight).
fn write_unflushed(
    env: &Env,
    st: &mut State,
    records: Unflushed,
    sealed_count: usize,
    from: u64,
    to: u64,
) -> EngineResult<u64> {
    if records.is_empty() {
        return Ok(0);
    }
    // Every volume is at `from` (step 1 drained each to the last durable
    // epoch end).
    let served = st.log.writeback_cursors().volumes();
    assert_eq!(st.log.writeback_cursors().at(from, served), served);
    let mut applied = group::apply(env, &records, served);
    if let Some((_, e)) = applied.failed.pop() {
        return Err(e);
    }
    // Data taken from memory (queued records, the open record) matches its
    // checksums.
    let memory_start = records.get(sealed_count).map_or(u64::MAX, |r| r.at);
    assert!(
        applied
            .bad
            .iter()
            .all(|&(_, logical)| logical < memory_start),
        "in-memory record data matches its checksums"
    );
    if sealed_count > 0 {
        group::commit(env, st, from, to, &records[..sealed_count], &applied);
    }
    assert_eq!(
        st.index.range_count(),
        0,
        "every zero/discard range is on the origin"
    );
    Ok(applied.blocks_written)
}
