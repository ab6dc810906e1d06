//! Whole-volume integrity: verifying origin reads against their tags,
//! recalculating tags over data that predates the format, and scrubbing
//! the origin (with repair from clean cached copies).
//!
//! Every path that changes the origin holds `writeback_lock` (write-back,
//! origin repair) and every path here that reads the origin to set or judge
//! a tag holds it too, so a tag and the origin block it describes are never
//! seen half updated.

use std::time::{Duration, Instant};

use cairn_format::{block_checksum, origin_tag, tag_matches, TAG_UNSET};

use crate::engine::*;
use crate::error::{EngineError, EngineResult};
use crate::stats::Counters;

/// Blocks read from the origin per recalculation or scrub step.
pub const INTEGRITY_STEP_BYTES: u64 = 1 << 20;
/// Recalculation persists its position at least this often (in blocks
/// covered), so a restart redoes little.
const RECALC_PERSIST_EVERY_BYTES: u64 = 64 << 20;
/// A mismatch that may have raced a write-back is re-read at most this
/// many times before it is reported.
const RECHECK_ROUNDS_MAX: usize = 4;

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

#[derive(Debug, Clone, Default)]
pub struct ScrubOptions {
    /// Rewrite a mismatching origin block from a clean cached copy.
    pub repair: bool,
    /// Origin bytes read per second at most; `None` = as fast as it goes.
    pub rate_bytes_per_s: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScrubReport {
    pub blocks_checked: u64,
    pub blocks_verified: u64,
    /// Blocks with no tag yet (above the recalculation position).
    pub blocks_unverified: u64,
    /// Dirty, pending or lost blocks: the cache holds their truth and the
    /// origin copy is about to be replaced, so it is not judged.
    pub blocks_skipped: u64,
    /// Origin addresses (in blocks) that failed and could not be repaired.
    pub mismatches: Vec<u64>,
    /// Origin addresses rewritten from a verified clean cached copy.
    pub repaired: Vec<u64>,
}

/// Judge one origin block against its tag; counts the outcome. `Err` on a
/// mismatch, which the caller reports (or rechecks first).
pub(crate) fn check_origin_data(
    env: &Env,
    lba: u64,
    block: &[u8],
    tag: Option<u32>,
) -> EngineResult<()> {
    match judge(env, lba, block, tag) {
        Ok(()) => Ok(()),
        Err(e) => {
            report_mismatch(env, lba);
            Err(e)
        }
    }
}

fn judge(env: &Env, lba: u64, block: &[u8], tag: Option<u32>) -> EngineResult<()> {
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
            lba,
            offset_bytes: lba * env.bs as u64,
        }),
    }
}

fn report_mismatch(env: &Env, lba: u64) {
    Counters::add(&env.counters.origin_mismatches, 1);
    tracing::error!(
        lba,
        offset_bytes = lba * env.bs as u64,
        "origin block does not match its integrity tag; returning EIO"
    );
}

impl Engine {
    /// Check a block just read from the origin against the tag its read was
    /// planned with. The read may have raced a write-back that moved the
    /// tag (or cached the block): on a mismatch the block is planned again,
    /// and only a mismatch against an unchanged tag is reported (EIO).
    pub(crate) fn verify_origin_read(
        &self,
        lba: u64,
        planned: Option<u32>,
        block: &mut [u8],
    ) -> EngineResult<()> {
        if judge(&self.env, lba, block, planned).is_ok() {
            return Ok(());
        }
        let mut tag = planned;
        for _ in 0..RECHECK_ROUNDS_MAX {
            let plan = {
                let mut inner = self.lock_index()?;
                inner.plan_read(&self.env, lba, block)?
            };
            match plan {
                Plan::Done => return Ok(()),
                Plan::Cache { slot, crc } => return self.read_block_slow(lba, slot, crc, block),
                Plan::Miss { tag: now } if now == tag => break,
                Plan::Miss { tag: now } => {
                    self.env.read_origin(lba, block)?;
                    if judge(&self.env, lba, block, now).is_ok() {
                        return Ok(());
                    }
                    tag = now;
                }
            }
        }
        check_origin_data(&self.env, lba, block, tag)
    }

    /// Is origin integrity on for this cache?
    pub fn integrity(&self) -> bool {
        self.env.integrity
    }

    /// One step of background recalculation: compute the tags of the next
    /// origin blocks that have none, from what the origin holds now. Tags
    /// already set (by write-back) are left alone. The position is persisted
    /// every so often and at the end, so a restart resumes near here.
    pub fn recalc_step(&self) -> EngineResult<RecalcProgress> {
        let total = self.env.volume_blocks;
        self.with_degrade(|degraded| {
            if degraded {
                // A degraded cache keeps no tags: nothing to recalculate.
                return Ok(RecalcProgress {
                    position_blocks: total,
                    total_blocks: total,
                    blocks_tagged: 0,
                });
            }
            self.recalc_step_cached()
        })
    }

    fn recalc_step_cached(&self) -> EngineResult<RecalcProgress> {
        let bs = self.env.bs as u64;
        let total = self.env.volume_blocks;
        if !self.env.integrity {
            return Ok(RecalcProgress {
                position_blocks: total,
                total_blocks: total,
                blocks_tagged: 0,
            });
        }
        let _serial = self
            .writeback_lock
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let pos = {
            let inner = self.lock()?;
            inner.tags.as_ref().map_or(total, |t| t.recalc_pos)
        };
        if pos >= total {
            return Ok(RecalcProgress {
                position_blocks: total,
                total_blocks: total,
                blocks_tagged: 0,
            });
        }
        let count = (INTEGRITY_STEP_BYTES / bs).max(1).min(total - pos);
        let mut buf = vec![0u8; (count * bs) as usize];
        // The origin cannot change under this read: every origin writer
        // holds the write-back lock we hold.
        self.env.read_origin(pos, &mut buf)?;
        let mut inner = self.lock()?;
        let tags = inner.tags.as_mut().expect("integrity on");
        assert_eq!(tags.recalc_pos, pos, "recalculation is serialized");
        let mut tagged = 0;
        for k in 0..count {
            let lba = pos + k;
            if tags.get(lba) == TAG_UNSET {
                let block = &buf[(k * bs) as usize..((k + 1) * bs) as usize];
                tags.set(lba, origin_tag(lba, block));
                tagged += 1;
            }
        }
        let before = tags.recalc_pos;
        tags.recalc_pos = pos + count;
        let after = tags.recalc_pos;
        Counters::add(&self.env.counters.recalc_blocks, count);
        let persist_every = (RECALC_PERSIST_EVERY_BYTES / bs).max(1);
        if after >= total || after / persist_every != before / persist_every {
            inner.write_superblock(&self.env)?;
            if after >= total {
                tracing::info!("integrity recalculation complete: every origin block has a tag");
            }
        }
        Ok(RecalcProgress {
            position_blocks: after,
            total_blocks: total,
            blocks_tagged: tagged,
        })
    }

    /// Recalculate until every origin block has a tag (tests, offline use).
    pub fn recalc_all(&self, mut progress: impl FnMut(&RecalcProgress)) -> EngineResult<()> {
        let steps_max = self.env.volume_blocks + 1;
        for _ in 0..steps_max {
            let p = self.recalc_step()?;
            progress(&p);
            if p.done() {
                return Ok(());
            }
        }
        Err(EngineError::Failed("recalculation did not finish".into()))
    }

    /// Verify every origin block against its tag, with an optional rate
    /// limit. Mismatching blocks with a clean, verified cached copy are
    /// rewritten from it when `opts.repair`. Safe while serving.
    pub fn scrub_origin(
        &self,
        opts: &ScrubOptions,
        mut progress: impl FnMut(u64, u64),
    ) -> EngineResult<ScrubReport> {
        self.with_degrade(|degraded| {
            if degraded && self.env.integrity {
                return Err(EngineError::CacheDegraded {
                    device: self.env.cache.name().to_string(),
                    action: "checking the origin against integrity tags".into(),
                });
            }
            self.scrub_origin_cached(opts, &mut progress)
        })
    }

    fn scrub_origin_cached(
        &self,
        opts: &ScrubOptions,
        progress: &mut impl FnMut(u64, u64),
    ) -> EngineResult<ScrubReport> {
        let mut report = ScrubReport::default();
        if !self.env.integrity {
            return Ok(report);
        }
        let bs = self.env.bs as u64;
        let total = self.env.volume_blocks;
        let step = (INTEGRITY_STEP_BYTES / bs).max(1);
        let started = Instant::now();
        let mut buf = vec![0u8; (step * bs) as usize];
        let mut pos = 0u64;
        // Bounded: each round covers `step` blocks.
        while pos < total {
            let count = step.min(total - pos);
            let chunk = &mut buf[..(count * bs) as usize];
            {
                let _serial = self
                    .writeback_lock
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                self.env.read_origin(pos, chunk)?;
                for k in 0..count {
                    let lba = pos + k;
                    let block = &chunk[(k * bs) as usize..((k + 1) * bs) as usize];
                    self.scrub_block(lba, block, opts, &mut report)?;
                }
            }
            Counters::add(&self.env.counters.scrub_blocks, count);
            pos += count;
            progress(pos, total);
            if let Some(rate) = opts.rate_bytes_per_s.filter(|&r| r > 0) {
                // Sleep until the bytes read so far fit the rate.
                let due = Duration::from_secs_f64((pos * bs) as f64 / rate as f64);
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    std::thread::sleep(wait);
                }
            }
        }
        Ok(report)
    }

    /// Judge one origin block during a scrub; the write-back lock is held.
    fn scrub_block(
        &self,
        lba: u64,
        block: &[u8],
        opts: &ScrubOptions,
        report: &mut ScrubReport,
    ) -> EngineResult<()> {
        let bs = self.env.bs as u64;
        report.blocks_checked += 1;
        let tag = {
            let inner = self.lock()?;
            let pending = inner.ranges.covering(lba).is_some() || inner.lost.contains(&lba);
            let dirty = inner
                .map
                .get(lba, &inner.slots)
                .is_some_and(|s| inner.slot_is_dirty(s));
            if pending || dirty {
                report.blocks_skipped += 1;
                return Ok(());
            }
            inner.tags.as_ref().map_or(TAG_UNSET, |t| t.get(lba))
        };
        match tag_matches(tag, lba, block) {
            None => {
                if tag == TAG_UNSET {
                    report.blocks_unverified += 1;
                }
                return Ok(());
            }
            Some(true) => {
                report.blocks_verified += 1;
                return Ok(());
            }
            Some(false) => {}
        }
        report_mismatch(&self.env, lba);
        let copy = if opts.repair {
            self.clean_cached_copy(lba)?
        } else {
            None
        };
        // Only a verified copy that also matches the tag may overwrite the
        // origin.
        if let Some(copy) = copy.filter(|c| tag_matches(tag, lba, c) == Some(true)) {
            let origin = self.env.origin.as_ref();
            match origin
                .write_at(lba * bs, &copy)
                .and_then(|()| origin.flush())
            {
                Ok(()) => {
                    Counters::add(&self.env.counters.origin_repairs, 1);
                    tracing::warn!(
                        lba,
                        offset_bytes = lba * bs,
                        "origin block repaired from its clean cached copy"
                    );
                    report.repaired.push(lba);
                    return Ok(());
                }
                Err(e) => {
                    Counters::add(&self.env.counters.origin_write_errors, 1);
                    tracing::error!(lba, "origin repair failed: {e}");
                }
            }
        }
        report.mismatches.push(lba);
        Ok(())
    }

    /// The clean cached copy of `lba`, checked against its checksum after
    /// reading it; `None` if the block is not cached clean or the copy is
    /// bad. Taken only when a scrub found the origin copy bad.
    fn clean_cached_copy(&self, lba: u64) -> EngineResult<Option<Vec<u8>>> {
        let bs = self.env.bs;
        let (slot, crc) = {
            let inner = self.lock()?;
            let Some(slot) = inner.map.get(lba, &inner.slots) else {
                return Ok(None);
            };
            if inner.slot_is_dirty(slot) {
                return Ok(None);
            }
            // A copy still in the open record is not on the device yet.
            if let Some(k) = inner.open_slot_index(slot) {
                let open = inner.open.as_ref().expect("open record");
                return Ok(Some(open.data[k * bs..(k + 1) * bs].to_vec()));
            }
            (slot, inner.slots.crc(slot))
        };
        let mut copy = vec![0u8; bs];
        let read = self
            .env
            .cache
            .read_at(self.env.layout.slot_offset_bytes(slot as u64), &mut copy);
        Ok((read.is_ok() && block_checksum(lba, &copy) == crc).then_some(copy))
    }
}
