//! The read path, one algorithm for a single read and for a batch of
//! pipelined reads:
//!
//! 1. plan every block under one engine lock acquisition: from memory (the
//!    open record, a sealed record in flight), zeroes (a pending range),
//!    a cache slot, or the origin;
//! 2. read every cache hit of the batch with one device submission, and
//!    the misses from the origin (one read per run of consecutive blocks),
//!    outside the lock;
//! 3. verify every block (checksums for hits, integrity tags for origin
//!    reads); a block that fails takes the slow path in `recheck`;
//! 4. promote misses as clean copies, by policy, if nothing was written
//!    meanwhile.
//!
//! A batch may be limited to requests whose every block is cached
//! ([`Scope::CachedOnly`]): the others are left untouched, so a slow origin
//! read never holds up the cached reads it arrived with.

mod recheck;

pub(crate) use recheck::read_block_slow;
pub(crate) use recheck::verify_origin_read;

use cairn_format::block_checksum;

use crate::env::Env;
use crate::error::EngineResult;
use crate::index::Plan;
use crate::parts::Parts;
use crate::space;
use crate::state::State;
use crate::stats::Counters;

/// Which requests of a batch are served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Every request; misses are promoted if `promote`, counted as
    /// bypassed if `bypassed`; a prefetch promotes past the n-hit filter.
    All {
        promote: bool,
        bypassed: bool,
        prefetch: bool,
    },
    /// Only requests whose every block is cached; the rest are untouched.
    CachedOnly,
}

/// One batch of reads of whole blocks: `(offset_bytes, blocks)`.
struct Batch {
    scope: Scope,
    /// Per request: the plan of each block, or `None` if left untouched.
    plans: Vec<Option<Vec<Plan>>>,
    /// Per request: `None` while untouched or in progress, else the outcome.
    results: Vec<Option<EngineResult<()>>>,
    /// `Index::mutations` when the batch was planned: fills are promoted
    /// only if nothing was written since.
    mutations_before: u64,
}

/// Serve a batch of aligned whole-block reads. `result[i]` is the outcome
/// of `requests[i]`, or `None` if the scope left it untouched.
pub(crate) fn read_batch(
    p: Parts<'_>,
    requests: &mut [(u64, &mut [u8])],
    scope: Scope,
) -> Vec<Option<EngineResult<()>>> {
    let mut batch = {
        let mut st = match p.state.running(p.env) {
            Ok(st) => st,
            Err(e) => return fail_all(requests.len(), scope, e),
        };
        Batch::plan(p.env, &mut st, requests, scope)
    };
    batch.read_hits(p.env, requests);
    batch.read_misses(p, requests);
    batch.verify_hits(p, requests);
    batch.promote(p, requests);
    batch.finish()
}

/// Every request fails alike (the engine stopped).
fn fail_all(
    count: usize,
    scope: Scope,
    e: crate::error::EngineError,
) -> Vec<Option<EngineResult<()>>> {
    match scope {
        // Untouched: the caller's single-read path reports the error.
        Scope::CachedOnly => (0..count).map(|_| None).collect(),
        Scope::All { .. } => {
            let mut results: Vec<_> = (0..count).map(|_| None).collect();
            if let Some(first) = results.first_mut() {
                *first = Some(Err(e));
            }
            for r in results.iter_mut().skip(1) {
                *r = Some(Err(crate::error::EngineError::Failed(
                    "the engine stopped".into(),
                )));
            }
            results
        }
    }
}

impl Batch {
    /// Step 1: plan every block of every request under the engine lock.
    fn plan(env: &Env, st: &mut State, requests: &mut [(u64, &mut [u8])], scope: Scope) -> Batch {
        let block_bytes = env.block_size_bytes;
        let mut batch = Batch {
            scope,
            plans: Vec::with_capacity(requests.len()),
            results: (0..requests.len()).map(|_| None).collect(),
            mutations_before: st.index.mutations(),
        };
        for (i, (offset, buf)) in requests.iter_mut().enumerate() {
            assert!(offset.is_multiple_of(block_bytes as u64));
            assert!(buf.len().is_multiple_of(block_bytes));
            let first = *offset / block_bytes as u64;
            let count = (buf.len() / block_bytes) as u64;
            // A request that fails this check is served as if it had
            // never been looked at: the check has no side effects.
            if scope == Scope::CachedOnly
                && !(first..first + count).all(|lba| st.index.is_cached(lba))
            {
                batch.plans.push(None);
                continue;
            }
            let mut plans = Vec::with_capacity(count as usize);
            for (k, block) in buf.chunks_mut(block_bytes).enumerate() {
                match st.plan(env, first + k as u64, block) {
                    Ok(plan) => plans.push(plan),
                    Err(e) => {
                        batch.results[i] = Some(Err(e));
                        break;
                    }
                }
            }
            batch.plans.push(Some(plans));
        }
        batch
    }

    /// Is request `i` still being served (touched, no error yet)?
    fn active(&self, i: usize) -> bool {
        self.plans[i].is_some() && self.results[i].is_none()
    }

    /// Step 2a: every cache hit of the batch in one submission, outside the
    /// lock. Blocks of a failed submission are zeroed: they fail their
    /// checksum and take the slow path.
    fn read_hits(&mut self, env: &Env, requests: &mut [(u64, &mut [u8])]) {
        let block_bytes = env.block_size_bytes;
        let mut reads: Vec<(u64, &mut [u8])> = Vec::new();
        for (i, (_, buf)) in requests.iter_mut().enumerate() {
            if !self.active(i) {
                continue;
            }
            let plans = self.plans[i].as_ref().expect("active");
            for (plan, block) in plans.iter().zip(buf.chunks_mut(block_bytes)) {
                if let Plan::Cache { slot, .. } = *plan {
                    reads.push((env.slot_offset_bytes(slot), block));
                }
            }
        }
        if reads.is_empty() {
            return;
        }
        if let Err(e) = env.read_cache_hits(&mut reads) {
            Counters::add(&env.counters.cache_read_errors, 1);
            tracing::warn!("cache read failed, retrying block by block: {e}");
            for (_, block) in reads.iter_mut() {
                block.fill(0);
            }
        }
    }

    /// Step 2b and 3 for misses: one origin read per run of consecutive
    /// missed blocks, each block checked against its integrity tag.
    fn read_misses(&mut self, p: Parts<'_>, requests: &mut [(u64, &mut [u8])]) {
        let block_bytes = p.env.block_size_bytes;
        for (i, (offset, buf)) in requests.iter_mut().enumerate() {
            if !self.active(i) {
                continue;
            }
            let first = *offset / block_bytes as u64;
            let plans = self.plans[i].as_ref().expect("active");
            let result = miss_runs(plans).try_for_each(|(start, end)| {
                let run = &mut buf[start * block_bytes..end * block_bytes];
                p.env.read_origin(first + start as u64, run)?;
                Counters::add(&p.env.counters.read_misses, (end - start) as u64);
                for k in start..end {
                    let Plan::Miss { tag } = plans[k] else {
                        unreachable!("miss runs hold misses only")
                    };
                    let block = &mut buf[k * block_bytes..(k + 1) * block_bytes];
                    verify_origin_read(p.env, p.state, first + k as u64, tag, block)?;
                }
                Ok(())
            });
            if let Err(e) = result {
                self.results[i] = Some(Err(e));
            }
        }
    }

    /// Step 3 for hits: check every block read against the checksum taken
    /// before it was written; a mismatch takes the slow path.
    fn verify_hits(&mut self, p: Parts<'_>, requests: &mut [(u64, &mut [u8])]) {
        let block_bytes = p.env.block_size_bytes;
        for (i, (offset, buf)) in requests.iter_mut().enumerate() {
            if !self.active(i) {
                continue;
            }
            let first = *offset / block_bytes as u64;
            let plans = self.plans[i].as_ref().expect("active");
            for (k, block) in buf.chunks_mut(block_bytes).enumerate() {
                let Plan::Cache { slot, crc } = plans[k] else {
                    continue;
                };
                let lba = first + k as u64;
                if block_checksum(lba, block) == crc {
                    Counters::add(&p.env.counters.read_hits, 1);
                    continue;
                }
                if let Err(e) = read_block_slow(p.env, p.state, lba, slot, crc, block) {
                    self.results[i] = Some(Err(e));
                    break;
                }
            }
        }
    }

    /// Step 4: promote the misses as clean copies, by policy, if nothing
    /// was written since the batch was planned (a fill must never replace
    /// newer data).
    fn promote(&mut self, p: Parts<'_>, requests: &[(u64, &mut [u8])]) {
        let Scope::All {
            promote,
            bypassed,
            prefetch,
        } = self.scope
        else {
            return;
        };
        let c = &p.env.counters;
        let block_bytes = p.env.block_size_bytes;
        let missed = |plans: &[Plan]| {
            plans
                .iter()
                .filter(|p| matches!(p, Plan::Miss { .. }))
                .count()
        };
        if bypassed {
            for (i, plans) in self.plans.iter().enumerate() {
                if let (Some(plans), None) = (plans, &self.results[i]) {
                    Counters::add(&c.bypassed, missed(plans) as u64);
                }
            }
        }
        if !promote {
            return;
        }
        for (i, (offset, buf)) in requests.iter().enumerate() {
            if !self.active(i) || missed(self.plans[i].as_ref().expect("active")) == 0 {
                continue;
            }
            let mut st = match p.state.running(p.env) {
                Ok(st) => st,
                Err(e) => {
                    self.results[i] = Some(Err(e));
                    continue;
                }
            };
            if st.index.mutations() != self.mutations_before {
                continue;
            }
            let first = *offset / block_bytes as u64;
            let plans = self.plans[i].as_ref().expect("active");
            for (k, plan) in plans.iter().enumerate() {
                if !matches!(plan, Plan::Miss { .. }) {
                    continue;
                }
                let lba = first + k as u64;
                if st.index.is_cached(lba) {
                    continue;
                }
                if !prefetch && !p.policy.miss_due(lba) {
                    Counters::add(&c.promotions_skipped, 1);
                    continue;
                }
                let block = &buf[k * block_bytes..(k + 1) * block_bytes];
                match space::promote(p.env, &mut st, lba, block) {
                    Ok(true) => Counters::add(&c.promotions, 1),
                    // No room without evicting dirty data: stop here.
                    Ok(false) => break,
                    Err(e) => {
                        self.results[i] = Some(Err(e));
                        break;
                    }
                }
            }
        }
    }

    /// The outcome of every request the scope touched.
    fn finish(self) -> Vec<Option<EngineResult<()>>> {
        self.plans
            .iter()
            .zip(self.results)
            .map(|(plans, result)| plans.as_ref().map(|_| result.unwrap_or(Ok(()))))
            .collect()
    }
}

/// The runs `[start, end)` of consecutive missed blocks of one request.
fn miss_runs(plans: &[Plan]) -> impl Iterator<Item = (usize, usize)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        while i < plans.len() && !matches!(plans[i], Plan::Miss { .. }) {
            i += 1;
        }
        if i == plans.len() {
            return None;
        }
        let start = i;
        while i < plans.len() && matches!(plans[i], Plan::Miss { .. }) {
            i += 1;
        }
        Some((start, i))
    })
}

/// Serve one aligned read of whole blocks.
pub(crate) fn read_one(
    p: Parts<'_>,
    offset: u64,
    blocks: &mut [u8],
    scope: Scope,
) -> EngineResult<()> {
    let mut requests = [(offset, blocks)];
    read_batch(p, &mut requests, scope)
        .pop()
        .flatten()
        .unwrap_or(Ok(()))
}

/// Run `op` on the whole blocks covering `[offset, offset + buf.len())`:
/// on `buf` itself when the request is aligned, else on a staging buffer
/// whose covered bytes are copied out afterwards.
pub(crate) fn on_whole_blocks(
    offset: u64,
    buf: &mut [u8],
    block_bytes: usize,
    op: impl FnOnce(u64, &mut [u8]) -> EngineResult<()>,
) -> EngineResult<()> {
    let bs = block_bytes as u64;
    let aligned = offset.is_multiple_of(bs) && (buf.len() as u64).is_multiple_of(bs);
    if aligned {
        return op(offset, buf);
    }
    let first = offset / bs;
    let last = (offset + buf.len() as u64 - 1) / bs;
    let mut staging = vec![0u8; ((last - first + 1) * bs) as usize];
    op(first * bs, &mut staging)?;
    let skip = (offset - first * bs) as usize;
    buf.copy_from_slice(&staging[skip..skip + buf.len()]);
    Ok(())
}
