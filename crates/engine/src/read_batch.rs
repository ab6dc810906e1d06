//! Batched reads: several client reads served together, so the cache
//! device gets every hit of the batch in one submission (one system call,
//! one device doorbell) and the engine lock is taken once for the whole
//! batch instead of once per read.
//!
//! Only reads whose every block is already cached are served here; the
//! others (an unaligned or out-of-range request, a block that misses and
//! may be promoted) are left untouched for [`Engine::read`], so the
//! policies, promotion and repair logic live in one place, and a slow
//! origin read never holds up the cached reads it arrived with. A block of
//! the batch that fails its checksum takes the same slow path as in a
//! single read ([`Engine::read_block_slow`]).

use cairn_format::block_checksum;

use crate::engine::*;
use crate::error::EngineResult;
use crate::stats::Counters;

/// One cache hit of a batch: which request and block it fills, and what its
/// checksum must be.
struct Hit {
    request: usize,
    block: usize,
    lba: u64,
    slot: u32,
    crc: u32,
}

impl Engine {
    /// Serve those of `requests` whose every block is cached, with one
    /// cache-device submission for all of them: `result[i]` is the outcome
    /// of `requests[i]` as [`Engine::read`] would give it, or `None` if the
    /// request was left untouched (not wholly cached, unaligned or out of
    /// range); serve those with [`Engine::read`].
    pub fn read_cached_many(
        &self,
        requests: &mut [(u64, &mut [u8])],
    ) -> Vec<Option<EngineResult<()>>> {
        let bs = self.env.bs;
        let count = requests.len();
        let mut results: Vec<Option<EngineResult<()>>> = (0..count).map(|_| None).collect();
        let mut batched = vec![false; count];
        let mut hits: Vec<Hit> = Vec::new();
        if let Ok(mut inner) = self.lock() {
            for (i, (offset, buf)) in requests.iter_mut().enumerate() {
                let len = buf.len() as u64;
                let aligned = offset.is_multiple_of(bs as u64) && len.is_multiple_of(bs as u64);
                if len == 0 || !aligned || self.check_range(*offset, len).is_err() {
                    continue;
                }
                let first = *offset / bs as u64;
                let blocks = len / bs as u64;
                // Only wholly cached reads: a miss needs the promotion
                // logic of the single-read path. This check has no side
                // effects, so a request that fails it is served as if it
                // had never been looked at.
                if !(first..first + blocks).all(|lba| inner.map.get(lba, &inner.slots).is_some()) {
                    continue;
                }
                batched[i] = true;
                let c = &self.env.counters;
                Counters::add(&c.reads, 1);
                Counters::add(&c.read_bytes, len);
                let hits_before = hits.len();
                for (k, block) in buf.chunks_mut(bs).enumerate() {
                    let lba = first + k as u64;
                    match inner.plan_read(&self.env, lba, block) {
                        Ok(Plan::Done) => {}
                        Ok(Plan::Cache { slot, crc }) => hits.push(Hit {
                            request: i,
                            block: k,
                            lba,
                            slot,
                            crc,
                        }),
                        Ok(Plan::Miss { .. }) => {
                            unreachable!("block {lba} was mapped under this lock")
                        }
                        Err(e) => {
                            hits.truncate(hits_before);
                            results[i] = Some(Err(e));
                            break;
                        }
                    }
                }
            }
        }
        // Every hit of the batch in one submission, outside the lock.
        if !hits.is_empty() {
            let mut reads: Vec<(u64, &mut [u8])> = Vec::with_capacity(hits.len());
            let mut next_hit = 0usize;
            for (i, (_, buf)) in requests.iter_mut().enumerate() {
                for (k, block) in buf.chunks_mut(bs).enumerate() {
                    if next_hit < hits.len()
                        && hits[next_hit].request == i
                        && hits[next_hit].block == k
                    {
                        reads.push((
                            self.env
                                .layout
                                .slot_offset_bytes(hits[next_hit].slot as u64),
                            block,
                        ));
                        next_hit += 1;
                    }
                }
            }
            assert_eq!(next_hit, hits.len(), "every hit has its block");
            if let Err(e) = self.env.read_cache_hits(&mut reads) {
                Counters::add(&self.env.counters.cache_read_errors, 1);
                tracing::warn!("batched cache read failed, retrying block by block: {e}");
                // Zeroed blocks fail their checksum and take the slow path.
                for (_, block) in reads.iter_mut() {
                    block.fill(0);
                }
            }
        }
        // Verify every block read (pairs with the checksum computed before
        // it was written); a mismatch takes the single-block slow path.
        for hit in &hits {
            if results[hit.request].is_some() {
                continue; // an earlier block of this request already failed
            }
            let buf = &mut requests[hit.request].1;
            let block = &mut buf[hit.block * bs..(hit.block + 1) * bs];
            if block_checksum(hit.lba, block) == hit.crc {
                Counters::add(&self.env.counters.read_hits, 1);
                continue;
            }
            if let Err(e) = self.read_block_slow(hit.lba, hit.slot, hit.crc, block) {
                results[hit.request] = Some(Err(e));
            }
        }
        // The sequential detector sees every read, as on the single path.
        let cutoff = self.env.config.sequential_cutoff_bytes;
        for (i, (offset, buf)) in requests.iter().enumerate() {
            if batched[i] {
                self.sequential.observe(*offset, buf.len() as u64, cutoff);
                results[i].get_or_insert(Ok(()));
            }
        }
        results
    }
}
