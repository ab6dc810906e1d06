//! `cairn flush`: write back every dirty block.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};

use super::Progress;
use crate::admin::{AdminReply, AdminRequest};

pub fn run(cache: &Path) -> Result<ExitCode> {
    let mut drained = None;
    {
        let pb = Progress::new("write-back");
        super::run_request(cache, &AdminRequest::Flush, |reply| match reply {
            AdminReply::Progress { done, total } => pb.set(done, total),
            AdminReply::Drained {
                blocks_written,
                unrecoverable_blocks,
            } => drained = Some((blocks_written, unrecoverable_blocks)),
            _ => {}
        })?;
    }
    let (written, unrecoverable) = drained.context("the daemon answered without a result")?;
    if unrecoverable > 0 {
        say!(
            "write-back incomplete: {written} blocks written, but {unrecoverable} dirty blocks failed their checksum on the cache and can never reach the origin; they read as EIO until rewritten. Run `cairn check --cache {}` to list them",
            cache.display()
        )?;
        return Ok(ExitCode::from(1));
    }
    say!("write-back complete: {written} blocks written to the origin, 0 dirty")?;
    Ok(ExitCode::SUCCESS)
}
