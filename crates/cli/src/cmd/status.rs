//! `cairn status`.

use std::path::Path;

use anyhow::{Context, Result};

use crate::admin::{AdminReply, AdminRequest};

pub fn run(cache: &Path, json: bool) -> Result<()> {
    let mut status = None;
    super::run_request(cache, &AdminRequest::Status, |reply| {
        if let AdminReply::Status { status: v } = reply {
            status = Some(v);
        }
    })?;
    let v = status.context("the daemon answered without a status")?;
    if json {
        say!("{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        crate::status::print_human(&v)?;
    }
    Ok(())
}
