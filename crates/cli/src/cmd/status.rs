//! `cairn status`.

use std::path::Path;

use anyhow::{Context, Result};

use crate::admin::{AdminReply, AdminRequest};

pub fn run(cache: &Path, json: bool, volume: Option<&str>) -> Result<()> {
    let mut status = None;
    super::run_request(cache, &AdminRequest::Status, |reply| {
        if let AdminReply::Status { status: v } = reply {
            status = Some(v);
        }
    })?;
    let v = status.context("the daemon answered without a status")?;
    if let Some(name) = volume {
        return print_volume(&v, name, json);
    }
    if json {
        say!("{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        print_human(&v)?;
    }
    Ok(())
}

/// The human status: a daemon's, or the offline view of the cache alone.
fn print_human(status: &serde_json::Value) -> std::io::Result<()> {
    if status["view"] == "offline" {
        return crate::status_offline::write_human(&mut std::io::stdout().lock(), status);
    }
    crate::status::print_human(status)
}

/// `status --volume NAME`: that volume's figures, then the cache totals
/// (JSON: the volume's object with the whole status under `cache`).
fn print_volume(status: &serde_json::Value, name: &str, json: bool) -> Result<()> {
    let volume = status["volumes"]
        .as_array()
        .and_then(|list| list.iter().find(|v| v["name"] == name))
        .with_context(|| {
            format!(
                "no volume is named {name:?}; `cairn volume list --cache CACHE` shows the volumes"
            )
        })?;
    if json {
        let mut out = volume.clone();
        out["cache"] = status.clone();
        say!("{}", serde_json::to_string_pretty(&out)?)?;
        return Ok(());
    }
    for key in [
        "name",
        "id",
        "origin",
        "size_bytes",
        "mode",
        "state",
        "dirty_blocks",
        "clean_blocks",
        "cached_bytes",
        "connections",
    ] {
        if let Some(value) = volume.get(key) {
            say!("volume {key}: {value}")?;
        }
    }
    Ok(print_human(status)?)
}
