//! `cairn mode`: switch the cache mode, draining first where needed.

use std::path::Path;

use anyhow::Result;

use super::Progress;
use crate::admin::{AdminReply, AdminRequest};
use crate::args::Mode;

pub fn run(cache: &Path, mode: Mode) -> Result<()> {
    let target = mode.engine();
    let mut written = 0u64;
    {
        let pb = Progress::new("draining");
        let request = AdminRequest::Mode { mode: target };
        super::run_request(cache, &request, |reply| match reply {
            AdminReply::Progress { done, total } => pb.set(done, total),
            AdminReply::Drained { blocks_written, .. } => written = blocks_written,
            _ => {}
        })?;
    }
    say!(
        "mode is now {} ({written} dirty blocks written back first)",
        target.name()
    )?;
    Ok(())
}
