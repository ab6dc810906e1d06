//! Scrubbing the origin against its integrity tags, with repair from
//! clean cached copies.

use std::time::{Duration, Instant};

use cairn_format::{block_checksum, block_key, key_volume, tag_matches, TAG_DISCARDED, TAG_UNSET};

use super::INTEGRITY_STEP_BYTES;
use crate::error::EngineResult;
use crate::origin_check::report_mismatch;
use crate::parts::Parts;
use crate::stats::Counters;

#[derive(Debug, Clone, Default)]
pub struct ScrubOptions {
    /// Rewrite a mismatching origin block from a clean cached copy.
    pub repair: bool,
    /// Origin bytes read per second at most; `None` = as fast as it goes.
    pub rate_bytes_per_s: Option<u64>,
}

/// What a scrub found. Every checked block lands in exactly one of
/// verified, unverified, discarded, skipped, repaired and mismatches
/// ([`ScrubReport::blocks_accounted`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScrubReport {
    pub blocks_checked: u64,
    pub blocks_verified: u64,
    /// Blocks with no tag yet (above the recalculation position).
    pub blocks_unverified: u64,
    /// Discarded blocks: they read as zeroes without asking the origin,
    /// whose copy is unspecified after a discard, so it is not judged.
    pub blocks_discarded: u64,
    /// Dirty, pending or lost blocks: the cache holds their truth and the
    /// origin copy is about to be replaced, so it is not judged.
    pub blocks_skipped: u64,
    /// Blocks (their keys: `cairn_format::key_volume` and `key_lba` give
    /// the volume and the address) that failed and could not be repaired.
    pub mismatches: Vec<u64>,
    /// Blocks (keys) rewritten from a verified clean cached copy.
    pub repaired: Vec<u64>,
    /// Of `mismatches`, those with a clean cached copy that was not tried
    /// because repair was off, or given up after a repair failed (the
    /// copy's own checksum is not read here).
    pub mismatches_cached: Vec<u64>,
}

impl ScrubReport {
    /// The checked blocks counted in some category; equals `blocks_checked`.
    pub fn blocks_accounted(&self) -> u64 {
        self.blocks_verified
            + self.blocks_unverified
            + self.blocks_discarded
            + self.blocks_skipped
            + self.repaired.len() as u64
            + self.mismatches.len() as u64
    }
}

/// Verify every origin block of every volume with tags against its tag,
/// with an optional rate limit.
/// Mismatching blocks with a clean, verified cached copy are rewritten from
/// it when `opts.repair`, until one rewrite fails for good (the rest are
/// then reported as mismatches). Safe while serving.
pub(crate) fn scrub_origin(
    p: Parts<'_>,
    opts: &ScrubOptions,
    progress: &mut impl FnMut(u64, u64),
) -> EngineResult<ScrubReport> {
    let env = p.env;
    let mut report = ScrubReport::default();
    if !env.integrity {
        return Ok(report);
    }
    let block_bytes = env.block_size_bytes as u64;
    // The volumes as they are now; one added meanwhile waits for the next
    // scrub, one removed meanwhile ends its part early.
    let volumes: Vec<(u16, u64, u64)> = {
        let st = p.state.normal(env)?;
        let tags = st.tags.as_ref().map_or(&[][..], |t| t.volumes());
        tags.iter()
            .map(|v| (v.volume_id, v.blocks(), v.serial))
            .collect()
    };
    let total: u64 = volumes.iter().map(|v| v.1).sum();
    let step = (INTEGRITY_STEP_BYTES / block_bytes).max(1);
    let started = Instant::now();
    let mut buf = vec![0u8; (step * block_bytes) as usize];
    let mut done = 0u64;
    // Cleared after a repair fails for good: the origin does not take
    // writes there, and each further attempt would hold write-back's lock
    // for its retries. The rest are reported as mismatches.
    let mut repair = opts.repair;
    for (id, blocks, serial) in volumes {
        let mut position = 0u64;
        // Bounded: each round covers `step` blocks.
        while position < blocks {
            let count = step.min(blocks - position);
            let chunk = &mut buf[..(count * block_bytes) as usize];
            {
                let _serial = p.writeback.lock();
                crate::origin_retry::read_origin(env, block_key(id, position), chunk)?;
                // Each block is judged only while the volume read for is
                // still served (a removal waits for this lock, so this is
                // defence in depth). If gone, its part ends.
                let mut gone = false;
                for (k, block) in chunk.chunks(block_bytes as usize).enumerate() {
                    let key = block_key(id, position + k as u64);
                    if !scrub_block(p, (key, serial), block, &mut repair, &mut report)? {
                        gone = true;
                        break;
                    }
                }
                if gone {
                    break;
                }
            }
            Counters::add(&env.counters.scrub_blocks, count);
            position += count;
            done += count;
            progress(done, total);
            if let Some(rate) = opts.rate_bytes_per_s.filter(|&r| r > 0) {
                // Sleep until the bytes read so far fit the rate.
                let due = Duration::from_secs_f64((done * block_bytes) as f64 / rate as f64);
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    std::thread::sleep(wait);
                }
            }
        }
    }
    debug_assert_eq!(report.blocks_accounted(), report.blocks_checked);
    Ok(report)
}

/// Judge one origin block (its key, and the serial of the volume it was
/// read for) during a scrub; the write-back lock is held. `false`: that
/// volume is no longer served, nothing was judged.
fn scrub_block(
    p: Parts<'_>,
    (lba, serial): (u64, u64),
    block: &[u8],
    repair: &mut bool,
    report: &mut ScrubReport,
) -> EngineResult<bool> {
    let env = p.env;
    let tag = {
        let st = p.state.normal(env)?;
        let volume = st.tags.as_ref().and_then(|t| t.volume(key_volume(lba)));
        if volume.is_none_or(|v| v.serial != serial) {
            return Ok(false);
        }
        report.blocks_checked += 1;
        let pending = st.index.range_covering(lba).is_some() || st.index.is_lost(lba);
        let dirty = st.index.lookup(lba).is_some_and(|s| st.index.is_dirty(s));
        if pending || dirty {
            report.blocks_skipped += 1;
            return Ok(true);
        }
        st.tags
            .as_ref()
            .and_then(|t| t.tag_of(lba))
            .unwrap_or(TAG_UNSET)
    };
    match tag_matches(tag, lba, block) {
        None => {
            // TAG_UNSET is the only other tag that cannot tell.
            if tag == TAG_DISCARDED {
                report.blocks_discarded += 1;
            } else {
                report.blocks_unverified += 1;
            }
            return Ok(true);
        }
        Some(true) => {
            report.blocks_verified += 1;
            return Ok(true);
        }
        Some(false) => {}
    }
    report_mismatch(env, lba);
    if !*repair {
        // Only whether a copy is there (an index lookup), so the report
        // can say which blocks a repair could fix; the copy is not read.
        if has_clean_cached_copy(p, lba)? {
            report.mismatches_cached.push(lba);
        }
        report.mismatches.push(lba);
        return Ok(true);
    }
    let copy = clean_cached_copy(p, lba)?;
    // Only a verified copy that also matches the tag may overwrite the
    // origin.
    if let Some(copy) = copy.filter(|c| tag_matches(tag, lba, c) == Some(true)) {
        let block_bytes = env.block_size_bytes as u64;
        let (volume, address) = env.origins.of_key(lba)?;
        let origin = volume.device();
        // The write and the flush that vouches for it, repeated together,
        // at once: write-back waits for the lock this scrub holds.
        let repaired = crate::origin_retry::write_retrying(env, "an origin repair", 0, || {
            origin.write_at(address * block_bytes, &copy)?;
            origin.flush()
        });
        match repaired {
            Ok(()) => {
                Counters::add(&env.counters.origin_repairs, 1);
                tracing::warn!(
                    volume_id = volume.id,
                    lba = address,
                    offset_bytes = address * block_bytes,
                    "origin block repaired from its clean cached copy"
                );
                report.repaired.push(lba);
                return Ok(true);
            }
            Err(e) => {
                tracing::error!(
                    lba,
                    "origin repair failed, no more repairs in this scrub: {e}"
                );
                *repair = false;
            }
        }
    }
    report.mismatches.push(lba);
    Ok(true)
}

/// Does the cache hold a clean copy of `lba` that is not known corrupt?
/// Not read, so not checked against its checksum.
fn has_clean_cached_copy(p: Parts<'_>, lba: u64) -> EngineResult<bool> {
    let st = p.state.normal(p.env)?;
    Ok(st
        .index
        .lookup(lba)
        .is_some_and(|slot| !st.index.is_dirty(slot) && !st.index.is_corrupt(slot)))
}

/// The clean cached copy of `lba`, checked against its checksum after
/// reading it; `None` if the block is not cached clean or the copy is bad.
/// Taken only when a scrub found the origin copy bad.
fn clean_cached_copy(p: Parts<'_>, lba: u64) -> EngineResult<Option<Vec<u8>>> {
    let env = p.env;
    let block_bytes = env.block_size_bytes;
    let (slot, crc) = {
        let st = p.state.normal(env)?;
        let Some(slot) = st.index.lookup(lba) else {
            return Ok(None);
        };
        if st.index.is_dirty(slot) {
            return Ok(None);
        }
        // A copy still in memory is not on the device yet.
        if let Some(data) = st.log.block_in_memory(slot, block_bytes) {
            return Ok(Some(data.to_vec()));
        }
        (slot, st.index.crc(slot))
    };
    let mut copy = vec![0u8; block_bytes];
    let read = env.read_slot(slot, &mut copy);
    Ok((read.is_ok() && block_checksum(lba, &copy) == crc).then_some(copy))
}
