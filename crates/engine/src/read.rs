//! The read path: plan each block (open record, cache slot, zeroed range
//! or origin), read hits outside the lock, verify every checksum, repair
//! clean blocks from the origin, and promote misses by policy.

use cairn_format::block_checksum;

use crate::engine::*;
use crate::error::{EngineError, EngineResult};
use crate::index::state;
use crate::stats::Counters;

impl Engine {
    // ----------------------------------------------------------------- reads

    /// Read `buf.len()` bytes at `offset`. Any alignment is accepted.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> EngineResult<()> {
        self.read_with(offset, buf, false)
    }

    /// Read and promote every missed block, ignoring the sequential cutoff
    /// and the n-hit policy: a prefetch (NBD CACHE, `cairn warm`).
    pub fn read_uncut(&self, offset: u64, buf: &mut [u8]) -> EngineResult<()> {
        self.read_with(offset, buf, true)
    }

    pub(crate) fn read_with(
        &self,
        offset: u64,
        buf: &mut [u8],
        prefetch: bool,
    ) -> EngineResult<()> {
        self.check_range(offset, buf.len() as u64)?;
        let c = &self.env.counters;
        Counters::add(&c.reads, 1);
        Counters::add(&c.read_bytes, buf.len() as u64);
        if buf.is_empty() {
            return Ok(());
        }
        let bs = self.env.bs as u64;
        let first = offset / bs;
        let last = (offset + buf.len() as u64 - 1) / bs;
        let count = (last - first + 1) as usize;
        // Whole blocks are staged here when the request is unaligned.
        let aligned = offset.is_multiple_of(bs) && (buf.len() as u64).is_multiple_of(bs);
        let mut staging = if aligned {
            Vec::new()
        } else {
            vec![0u8; count * self.env.bs]
        };
        let bypass = !prefetch
            && self.sequential.observe(
                offset,
                buf.len() as u64,
                self.env.config.sequential_cutoff_bytes,
            );
        let promote = self.env.config.promote_read_misses && self.mode().caches_reads() && !bypass;
        {
            let blocks: &mut [u8] = if aligned { buf } else { &mut staging };
            // Reads take the same path in every state; only promotion (a
            // cache write) stops once the cache is degraded. A promotion
            // that hits a cache write failure re-runs the read after the
            // switch.
            self.with_degrade(|_| self.read_blocks(first, blocks, promote, bypass, prefetch))?;
        }
        if !aligned {
            let skip = (offset - first * bs) as usize;
            buf.copy_from_slice(&staging[skip..skip + buf.len()]);
        }
        Ok(())
    }

    /// Read whole blocks starting at block `first` into `out`.
    pub(crate) fn read_blocks(
        &self,
        first: u64,
        out: &mut [u8],
        promote: bool,
        bypass: bool,
        prefetch: bool,
    ) -> EngineResult<()> {
        let bs = self.env.bs;
        let count = out.len() / bs;
        let c = &self.env.counters;
        let mut plans = Vec::with_capacity(count);
        let mutations_before;
        {
            let mut inner = self.lock_index()?;
            mutations_before = inner.mutations;
            for (i, block) in out.chunks_mut(bs).enumerate() {
                plans.push(inner.plan_read(&self.env, first + i as u64, block)?);
            }
        }
        // Cache hits, read outside the lock and verified below.
        let mut reqs: Vec<(u64, &mut [u8])> = Vec::new();
        let mut hit_index = Vec::new();
        let mut miss_runs: Vec<(usize, usize)> = Vec::new();
        {
            let mut blocks: Vec<&mut [u8]> = out.chunks_mut(bs).collect();
            let mut i = 0;
            let mut rest: Vec<Option<&mut [u8]>> = blocks.drain(..).map(Some).collect();
            while i < count {
                match plans[i] {
                    Plan::Done => i += 1,
                    Plan::Cache { slot, .. } => {
                        let b = rest[i].take().expect("block taken once");
                        reqs.push((self.env.layout.slot_offset_bytes(slot as u64), b));
                        hit_index.push(i);
                        i += 1;
                    }
                    Plan::Miss { .. } => {
                        let start = i;
                        while i < count && matches!(plans[i], Plan::Miss { .. }) {
                            i += 1;
                        }
                        miss_runs.push((start, i));
                    }
                }
            }
            if !reqs.is_empty() {
                if let Err(e) = self.env.read_cache_hits(&mut reqs) {
                    Counters::add(&c.cache_read_errors, 1);
                    tracing::warn!("cache read failed, retrying block by block: {e}");
                    // Mark every hit for individual handling below.
                    for (_, b) in reqs.iter_mut() {
                        b.fill(0);
                    }
                }
            }
        }
        // Misses: one origin read per contiguous run.
        for &(start, end) in &miss_runs {
            self.env
                .read_origin(first + start as u64, &mut out[start * bs..end * bs])?;
            Counters::add(&c.read_misses, (end - start) as u64);
            // Check data after reading it: every block against its tag.
            for i in start..end {
                let Plan::Miss { tag } = plans[i] else {
                    unreachable!("miss runs hold misses only")
                };
                let lba = first + i as u64;
                let block = &mut out[i * bs..(i + 1) * bs];
                self.verify_origin_read(lba, tag, block)?;
            }
        }
        // Verify hits.
        for &i in &hit_index {
            let Plan::Cache { slot, crc } = plans[i] else {
                unreachable!()
            };
            let lba = first + i as u64;
            let block = &mut out[i * bs..(i + 1) * bs];
            if block_checksum(lba, block) == crc {
                Counters::add(&c.read_hits, 1);
                continue;
            }
            self.read_block_slow(lba, slot, crc, block)?;
        }
        // Promote misses as clean copies.
        if bypass {
            let missed: usize = miss_runs.iter().map(|&(s, e)| e - s).sum();
            Counters::add(&c.bypassed, missed as u64);
        }
        if promote && !miss_runs.is_empty() {
            let mut inner = self.lock_index()?;
            if inner.mutations == mutations_before {
                for &(start, end) in &miss_runs {
                    for i in start..end {
                        let lba = first + i as u64;
                        if inner.map.get(lba, &inner.slots).is_some() {
                            continue;
                        }
                        if !prefetch
                            && !self
                                .hit_filter
                                .miss(lba, self.env.config.promote_after_misses)
                        {
                            Counters::add(&c.promotions_skipped, 1);
                            continue;
                        }
                        if !inner.promote(&self.env, lba, &out[i * bs..(i + 1) * bs])? {
                            break;
                        }
                        Counters::add(&c.promotions, 1);
                    }
                }
            }
        }
        Ok(())
    }

    /// A cache hit that failed its checksum (or whose read failed): find out
    /// whether the mapping moved under us, or the copy is really bad.
    pub(crate) fn read_block_slow(
        &self,
        lba: u64,
        slot: u32,
        crc: u32,
        block: &mut [u8],
    ) -> EngineResult<()> {
        let c = &self.env.counters;
        let mut inner = self.lock_index()?;
        // Re-read under the lock: nothing can move now.
        match inner.plan_read(&self.env, lba, block)? {
            Plan::Done => Ok(()),
            Plan::Miss { tag } => {
                drop(inner);
                self.env.read_origin(lba, block)?;
                self.verify_origin_read(lba, tag, block)
            }
            Plan::Cache {
                slot: now_slot,
                crc: now_crc,
            } => {
                let read_ok = match self
                    .env
                    .cache
                    .read_at(self.env.layout.slot_offset_bytes(now_slot as u64), block)
                {
                    Ok(()) => true,
                    Err(e) => {
                        Counters::add(&c.cache_read_errors, 1);
                        tracing::warn!("cache read of block {lba} failed: {e}");
                        false
                    }
                };
                if read_ok && block_checksum(lba, block) == now_crc {
                    Counters::add(&c.read_hits, 1);
                    if (now_slot, now_crc) == (slot, crc) {
                        // The mapping did not move, yet the first read was
                        // bad and the device's copy is good: a failed
                        // batched read, or a stale page-cache page (see
                        // `Device::drop_cached_pages`). Drop the page so
                        // the next hit does not come here again.
                        Counters::add(&c.hit_rereads_ok, 1);
                        drop(inner);
                        if self.env.config.page_cache_reads {
                            let at = self.env.layout.slot_offset_bytes(slot as u64);
                            self.env.cache.drop_cached_pages(at, self.env.bs as u64);
                        }
                    }
                    return Ok(());
                }
                if read_ok {
                    Counters::add(&c.checksum_mismatches, 1);
                }
                if inner.slot_is_dirty(now_slot) {
                    tracing::error!(
                        lba,
                        slot = now_slot,
                        "dirty cache block failed its checksum"
                    );
                    inner.mark_corrupt(now_slot);
                    return Err(EngineError::DirtyBlockCorrupt { lba });
                }
                // Clean: the origin has the data. Serve it and repair.
                tracing::warn!(
                    lba,
                    slot = now_slot,
                    "clean cache block bad; serving from origin and repairing"
                );
                self.env.read_origin(lba, block)?;
                // The lock is held: the tag cannot move under this check.
                let tag = inner.tags.as_ref().map(|t| t.get(lba));
                crate::integrity::check_origin_data(&self.env, lba, block, tag)?;
                inner.retire_slot(now_slot);
                if inner.promote(&self.env, lba, block)? {
                    Counters::add(&c.repairs, 1);
                }
                Ok(())
            }
        }
    }
}

impl Inner {
    pub(crate) fn plan_read(
        &mut self,
        env: &Env,
        lba: u64,
        block: &mut [u8],
    ) -> EngineResult<Plan> {
        let bs = env.bs;
        if let Some(slot) = self.map.get(lba, &self.slots) {
            let st = self.slots.state(slot);
            self.slots.set_state(slot, st | state::REFERENCED);
            if let Some(data) = self.block_in_memory(slot, bs) {
                block.copy_from_slice(data);
                assert_eq!(
                    block_checksum(lba, block),
                    self.slots.crc(slot),
                    "open record data"
                );
                Counters::add(&env.counters.read_hits, 1);
                return Ok(Plan::Done);
            }
            if self.slots.state(slot) & state::CORRUPT != 0 {
                return Err(EngineError::DirtyBlockCorrupt { lba });
            }
            return Ok(Plan::Cache {
                slot,
                crc: self.slots.crc(slot),
            });
        }
        if self.lost.contains(&lba) {
            return Err(EngineError::DirtyBlockCorrupt { lba });
        }
        if self.ranges.covering(lba).is_some() {
            block.fill(0);
            Counters::add(&env.counters.read_zero_hits, 1);
            return Ok(Plan::Done);
        }
        let tag = self.tags.as_ref().map(|t| t.get(lba));
        if tag == Some(cairn_format::TAG_DISCARDED) {
            // Discarded with integrity on: zeroes, whatever the origin holds.
            block.fill(0);
            Counters::add(&env.counters.read_zero_hits, 1);
            return Ok(Plan::Done);
        }
        Ok(Plan::Miss { tag })
    }

    /// Insert a clean copy (read fill or repair). Returns false if there was
    /// no room without evicting dirty data (then nothing is inserted).
    pub(crate) fn promote(&mut self, env: &Env, lba: u64, block: &[u8]) -> EngineResult<bool> {
        if self.degraded || self.degrade_pending.is_some() {
            // The cache device is not written any more.
            return Ok(false);
        }
        if !matches!(self.ensure_space(env, 1)?, Space::Ready) {
            return Ok(false);
        }
        self.append_data(env, lba, block, true)?;
        Ok(true)
    }
}
