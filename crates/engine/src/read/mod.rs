//! The read path, one algorithm for every read:
//!
//! 1. plan every block under the engine lock: from memory (the open record,
//!    a sealed record in flight), zeroes (a pending range), a cache slot,
//!    or the origin;
//! 2. start every read at once, outside the lock: runs of hits in adjacent
//!    slots as one cache read, runs of misses as one origin read; as a task
//!    on a reactor they are all in flight together (one submission for the
//!    whole loop turn) while other tasks run, and elsewhere they are done
//!    one by one;
//! 3. verify every block: checksums for hits, integrity tags for origin
//!    reads; a block that fails takes the slow path in `recheck`;
//! 4. promote misses as clean copies, by policy, unless the block was
//!    written since it was planned (see `index::WriteStamp`).
//!
//! A read may be limited to requests whose every block is cached
//! ([`Scope::CachedOnly`]): the others are left untouched.

mod recheck;

pub(crate) use recheck::read_block_slow;
pub(crate) use recheck::verify_origin_read;

use cairn_device::{BufSlice, Device, DeviceError, DeviceResult, PooledBuf, SharedBuf};
use cairn_format::{block_checksum, key_lba};
use smallvec::SmallVec;

use crate::env::Env;
use crate::error::EngineResult;
use crate::index::Plan;
use crate::parts::Parts;
use crate::read_kind::ReadKind;
use crate::space;
use crate::stats::Counters;

/// Which reads are served, and how misses are treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Every read, counted as `kind`'s; misses are promoted if `promote`,
    /// counted as bypassed if `bypassed`; a prefetch promotes past the
    /// n-hit filter.
    All {
        promote: bool,
        bypassed: bool,
        kind: ReadKind,
    },
    /// Only reads whose every block is cached; the rest are untouched.
    CachedOnly,
}

impl Scope {
    /// Whose read this is, for the counters.
    pub(crate) fn kind(self) -> ReadKind {
        match self {
            Self::All { kind, .. } => kind,
            Self::CachedOnly => ReadKind::Client,
        }
    }
}

/// One device read of a planned request: blocks `[first, end)` of it, from
/// the cache (slot `slot`, then the adjacent slots) or from the origin.
struct Io {
    first: usize,
    end: usize,
    source: Source,
}

/// Per-request lists kept inline: a request of a few blocks, the usual
/// one, then allocates nothing for its plan (every allocation showed up on
/// a cached-read benchmark's profile).
type Plans = SmallVec<[Plan; 8]>;
type Ios = SmallVec<[Io; 4]>;
type Failures = SmallVec<[Option<DeviceError>; 4]>;

#[derive(Clone, Copy)]
enum Source {
    Cache { slot: u32 },
    Origin,
}

/// Read whole blocks from `offset` into `buf` (`buf.len()` bytes, a
/// multiple of the block size). `None` if `scope` left the read untouched.
pub(crate) async fn read_blocks(
    p: Parts<'_>,
    offset: u64,
    mut buf: PooledBuf,
    scope: Scope,
) -> (Option<EngineResult<()>>, PooledBuf) {
    let env = p.env;
    let block_bytes = env.block_size_bytes;
    assert!(offset.is_multiple_of(block_bytes as u64));
    assert!(buf.len().is_multiple_of(block_bytes));
    let first_lba = offset / block_bytes as u64;
    let plans = match plan(p, first_lba, &mut buf, scope) {
        Ok(Some(plans)) => plans,
        Ok(None) => return (None, buf),
        Err(e) => return (Some(Err(e)), buf),
    };
    let ios = ios(&plans);
    // A request lies in one volume: its misses go to that volume's origin,
    // looked up only when there are misses (hits need no origin).
    let origin = if ios.iter().any(|io| matches!(io.source, Source::Origin)) {
        match env.origins.of_key(first_lba) {
            Ok((volume, _)) => Some(volume),
            Err(e) => return (Some(Err(e)), buf),
        }
    } else {
        None
    };
    let origin = origin.as_ref().map(|v| v.device());
    tracing::trace!(
        first_lba,
        ios = ios.len(),
        origin_ios = ios
            .iter()
            .filter(|io| matches!(io.source, Source::Origin))
            .count(),
        "read planned"
    );
    let (buf, failures) = run_ios(env, origin, first_lba, buf, &ios).await;
    tracing::trace!(first_lba, "read ios done");
    let mut buf = buf;
    let result = verify(p, first_lba, scope.kind(), &plans, &ios, failures, &mut buf)
        .and_then(|()| promote(p, first_lba, &plans, &buf, scope));
    let result = match result {
        // Records the fills completed are written outside the lock, and
        // the reply does not wait for them.
        Ok(sealed) => crate::sealed::start_claimed(env, sealed).await,
        Err(e) => Err(e),
    };
    (Some(result), buf)
}

/// Step 1: plan every block under the engine lock; `None` if the scope
/// leaves this read untouched.
fn plan(p: Parts<'_>, first_lba: u64, buf: &mut [u8], scope: Scope) -> EngineResult<Option<Plans>> {
    let env = p.env;
    let block_bytes = env.block_size_bytes;
    let count = (buf.len() / block_bytes) as u64;
    let mut st = p.state.running(env)?;
    // A read that fails this check is served as if it had never been
    // looked at: the check has no side effects.
    if scope == Scope::CachedOnly
        && !(first_lba..first_lba + count).all(|lba| st.index.is_cached(lba))
    {
        return Ok(None);
    }
    let mut plans = Plans::with_capacity(count as usize);
    for (k, block) in buf.chunks_mut(block_bytes).enumerate() {
        plans.push(st.plan(env, first_lba + k as u64, scope.kind(), block)?);
    }
    Ok(Some(plans))
}

/// The device reads the plans need: a run of hits in adjacent slots, or of
/// misses, is one read.
fn ios(plans: &[Plan]) -> Ios {
    let mut ios = Ios::new();
    for (k, plan) in plans.iter().enumerate() {
        let source = match *plan {
            Plan::Done => continue,
            Plan::Cache { slot, .. } => Source::Cache { slot },
            Plan::Miss { .. } => Source::Origin,
        };
        if let Some(last) = ios.last_mut() {
            let extends = last.end == k
                && match (last.source, source) {
                    (Source::Cache { slot: a }, Source::Cache { slot: b }) => {
                        a as u64 + (k - last.first) as u64 == b as u64
                    }
                    (Source::Origin, Source::Origin) => true,
                    _ => false,
                };
            if extends {
                last.end = k + 1;
                continue;
            }
        }
        ios.push(Io {
            first: k,
            end: k + 1,
            source,
        });
    }
    ios
}

/// Step 2: every read at once; the buffer back, and the reads that failed
/// (by index into `ios`).
async fn run_ios(
    env: &Env,
    origin: Option<&dyn Device>,
    first_lba: u64,
    buf: PooledBuf,
    ios: &[Io],
) -> (PooledBuf, Failures) {
    let block_bytes = env.block_size_bytes;
    let shared = SharedBuf::new(buf);
    let slice_of = |io: &Io| shared.slice(io.first * block_bytes..io.end * block_bytes);
    let failures: Failures = match ios {
        [] => Failures::new(),
        // One read (most requests): awaited as it is, without a join.
        [io] => {
            let (result, slice) = start_read(env, origin, first_lba, io, slice_of(io)).await;
            drop(slice);
            std::iter::once(result.err()).collect()
        }
        _ => {
            let reads: Vec<_> = ios
                .iter()
                .map(|io| start_read(env, origin, first_lba, io, slice_of(io)))
                .collect();
            cairn_io::join_all(reads)
                .await
                .into_iter()
                .map(|(result, slice)| {
                    drop(slice);
                    result.err()
                })
                .collect()
        }
    };
    let buf = match shared.into_inner() {
        Ok(buf) => buf,
        Err(_) => unreachable!("every slice came back with its read"),
    };
    (buf, failures)
}

/// One whole block of the origin (`key`), read as a task within the
/// origin's queue depth, as a miss is: the old contents of a block a write
/// covers in part.
pub(crate) async fn read_origin_block(env: &Env, key: u64) -> EngineResult<Vec<u8>> {
    let block_bytes = env.block_size_bytes;
    let (volume, _) = env.origins.of_key(key)?;
    let mut buf = env.read_bufs.lend(block_bytes);
    buf.set_len(block_bytes);
    let io = Io {
        first: 0,
        end: 1,
        source: Source::Origin,
    };
    let (buf, failures) = run_ios(
        env,
        Some(volume.device()),
        key,
        buf,
        std::slice::from_ref(&io),
    )
    .await;
    if let Some(e) = failures.into_iter().flatten().next() {
        Counters::add(&env.counters.origin_read_errors, 1);
        return Err(crate::error::EngineError::Origin(e));
    }
    Ok(buf[..block_bytes].to_vec())
}

fn start_read<'a>(
    env: &'a Env,
    origin: Option<&'a dyn Device>,
    first_lba: u64,
    io: &Io,
    slice: BufSlice,
) -> cairn_device::DeviceFuture<'a, (DeviceResult<()>, BufSlice)> {
    match io.source {
        Source::Cache { slot } => {
            let at = env.slot_offset_bytes(slot);
            if env.config.page_cache_reads {
                env.cache.read_into_cacheable(at, slice)
            } else {
                env.cache.read_into(at, slice)
            }
        }
        Source::Origin => {
            let at = key_lba(first_lba + io.first as u64) * env.block_size_bytes as u64;
            let origin = origin.expect("an origin read is planned only with its origin looked up");
            Box::pin(async move {
                // Bounded origin concurrency: a miss beyond it waits here.
                if env.origin_slots.acquire(1).await {
                    Counters::add(&env.counters.origin_queue_waits, 1);
                }
                tracing::trace!(at, "origin read started");
                let _slot = OriginSlot(env);
                let (mut result, mut slice) = origin.read_into(at, slice).await;
                // Asked again as every origin read is; the last failure
                // is counted by `verify`.
                let mut reads = 1;
                while let Err(e) = &result {
                    if !crate::origin_retry::read_again(env, reads, e, "a read miss") {
                        break;
                    }
                    reads += 1;
                    (result, slice) = origin.read_into(at, slice).await;
                }
                tracing::trace!(at, ok = result.is_ok(), "origin read done");
                (result, slice)
            })
        }
    }
}

/// An origin read's slot, given back when the read ends (or is dropped).
struct OriginSlot<'a>(&'a Env);

impl Drop for OriginSlot<'_> {
    fn drop(&mut self) {
        self.0.origin_slots.release(1);
    }
}

/// Step 3: check every block read against its checksum or integrity tag.
/// A failed cache read leaves its blocks to the slow path; a failed origin
/// read fails the request.
fn verify(
    p: Parts<'_>,
    first_lba: u64,
    kind: ReadKind,
    plans: &[Plan],
    ios: &[Io],
    failures: Failures,
    buf: &mut [u8],
) -> EngineResult<()> {
    let env = p.env;
    let c = &env.counters;
    let block_bytes = env.block_size_bytes;
    for (io, failure) in ios.iter().zip(failures) {
        match (io.source, failure) {
            (Source::Origin, Some(e)) => {
                Counters::add(&c.origin_read_errors, 1);
                return Err(crate::error::EngineError::Origin(e));
            }
            (Source::Origin, None) => {
                Counters::add(kind.misses(c), (io.end - io.first) as u64);
            }
            (Source::Cache { .. }, Some(e)) => {
                Counters::add(&c.cache_read_errors, 1);
                tracing::warn!("cache read failed, retrying block by block: {e}");
                // Zeroed blocks fail their checksum: the slow path re-reads.
                buf[io.first * block_bytes..io.end * block_bytes].fill(0);
            }
            (Source::Cache { .. }, None) => {}
        }
    }
    for (k, plan) in plans.iter().enumerate() {
        let lba = first_lba + k as u64;
        let block = &mut buf[k * block_bytes..(k + 1) * block_bytes];
        match *plan {
            Plan::Done => {}
            Plan::Cache { slot, crc } => {
                if block_checksum(lba, block) == crc {
                    Counters::add(kind.hits(c), 1);
                } else {
                    read_block_slow(env, p.state, lba, kind, slot, crc, block)?;
                }
            }
            Plan::Miss { tag, .. } => verify_origin_read(env, p.state, lba, kind, tag, block)?,
        }
    }
    Ok(())
}

/// Step 4: promote the misses as clean copies, by policy, unless written
/// since they were planned (a fill must never replace newer data).
fn promote(
    p: Parts<'_>,
    first_lba: u64,
    plans: &[Plan],
    buf: &[u8],
    scope: Scope,
) -> EngineResult<Vec<std::sync::Arc<crate::sealed::SealedRecord>>> {
    let Scope::All {
        promote,
        bypassed,
        kind,
    } = scope
    else {
        return Ok(Vec::new());
    };
    let c = &p.env.counters;
    let block_bytes = p.env.block_size_bytes;
    let missed = plans
        .iter()
        .filter(|p| matches!(p, Plan::Miss { .. }))
        .count();
    if bypassed {
        Counters::add(&c.bypassed, missed as u64);
    }
    if !promote || missed == 0 {
        return Ok(Vec::new());
    }
    let mut st = p.state.running(p.env)?;
    for (k, plan) in plans.iter().enumerate() {
        let Plan::Miss { stamp, .. } = *plan else {
            continue;
        };
        let lba = first_lba + k as u64;
        if !st.index.fill_allowed(lba, stamp) {
            Counters::add(&c.fills_superseded, 1);
            continue;
        }
        if kind != ReadKind::Prefetch && !p.policy.miss_due(lba) {
            Counters::add(&c.promotions_skipped, 1);
            continue;
        }
        let block = &buf[k * block_bytes..(k + 1) * block_bytes];
        if !space::promote(p.env, &mut st, lba, block)? {
            // No room without evicting dirty data: stop here.
            break;
        }
        Counters::add(&c.promotions, 1);
    }
    if !p.env.health.cache_writable() {
        // A degrade is pending: nothing more is written to the cache. A
        // record left queued by a write that failed stays for the switch,
        // which takes its data from memory.
        return Ok(Vec::new());
    }
    Ok(st.log.claim_filled())
}
