//! `cairn check`: verify every cached block's checksum, or with `--origin`
//! scrub the origin against its integrity tags.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};

use super::Progress;
use crate::admin::{AdminReply, AdminRequest};

/// An address as the replies give it: (block, byte offset). Only the
/// engine knows the block size, so the byte offset comes with it.
type Address = (u64, u64);
/// A volume's name, an origin block of it and its byte offset.
type VolumeAddress = (String, u64, u64);

pub fn run(cache: &Path) -> Result<ExitCode> {
    let mut bad: Vec<Address> = Vec::new();
    {
        let pb = Progress::new("checking");
        super::run_request(cache, &AdminRequest::Check, |reply| match reply {
            AdminReply::Progress { done, total } => pb.set(done, total),
            AdminReply::BadBlock { lba, offset_bytes } => bad.push((lba, offset_bytes)),
            _ => {}
        })?;
    }
    for (lba, offset) in &bad {
        say!("checksum mismatch: origin block {lba} (byte offset {offset})")?;
    }
    if bad.is_empty() {
        say!("check passed: every cached block matches its checksum")?;
        Ok(ExitCode::SUCCESS)
    } else {
        say!("check FAILED: {} bad blocks", bad.len())?;
        Ok(ExitCode::from(1))
    }
}

/// What a scrub found.
#[derive(Default)]
struct Scrub {
    mismatches: Vec<VolumeAddress>,
    repaired: Vec<VolumeAddress>,
    /// Checked, verified, not yet tagged, skipped (dirty).
    totals: Option<[u64; 4]>,
}

pub fn run_origin(cache: &Path, rate_bytes_per_s: u64, repair: bool) -> Result<ExitCode> {
    let mut scrub = Scrub::default();
    {
        let pb = Progress::new("scrubbing origin");
        let request = AdminRequest::CheckOrigin {
            rate_bytes_per_s,
            repair,
        };
        super::run_request(cache, &request, |reply| match reply {
            AdminReply::Progress { done, total } => pb.set(done, total),
            AdminReply::OriginMismatch {
                volume,
                lba,
                offset_bytes,
            } => scrub.mismatches.push((volume, lba, offset_bytes)),
            AdminReply::OriginRepaired {
                volume,
                lba,
                offset_bytes,
            } => scrub.repaired.push((volume, lba, offset_bytes)),
            AdminReply::Scrubbed {
                blocks_checked,
                blocks_verified,
                blocks_unverified,
                blocks_skipped,
            } => {
                scrub.totals = Some([
                    blocks_checked,
                    blocks_verified,
                    blocks_unverified,
                    blocks_skipped,
                ])
            }
            _ => {}
        })?;
    }
    report_scrub(&scrub)
}

fn report_scrub(scrub: &Scrub) -> Result<ExitCode> {
    let [checked, verified, unverified, skipped] = scrub
        .totals
        .context("the daemon answered without scrub totals")?;
    for (volume, lba, offset) in &scrub.repaired {
        say!("repaired: origin block {lba} (byte offset {offset}) of volume {volume:?} rewritten from its clean cached copy")?;
    }
    for (volume, lba, offset) in &scrub.mismatches {
        say!("origin mismatch: origin block {lba} (byte offset {offset}) of volume {volume:?} does not match its tag")?;
    }
    let bad = scrub.mismatches.len();
    say!(
        "origin scrub: {checked} blocks checked, {verified} verified, {unverified} not yet tagged (recalculation running), {skipped} skipped (dirty in the cache), {} repaired, {bad} bad",
        scrub.repaired.len(),
    )?;
    if bad == 0 {
        Ok(ExitCode::SUCCESS)
    } else {
        say!("check FAILED: {bad} origin blocks are corrupt and have no clean cached copy; restore them from a backup (they read as EIO)")?;
        Ok(ExitCode::from(1))
    }
}
