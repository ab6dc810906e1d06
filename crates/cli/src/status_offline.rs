//! The answers to the read-only admin requests (`status`, `volume list`)
//! when no daemon serves the cache: from the cache device alone, opened
//! read-only, through `Inspection::open`. No origin is opened (an
//! unreachable one is when an operator most needs `status`), nothing is
//! written to the cache, and what only a running daemon knows (counters
//! since its start, the origin's state, connections) is null, not made
//! up. See docs/design.md, "Offline status is read-only".

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use cairn_device::{open_local, DeviceError, OpenMode};
use cairn_engine::{Inspection, StoredSettings};
use serde_json::{json, Value};

use crate::admin::{socket_path, AdminReply, AdminRequest};
use crate::settings::EffectiveSettings;

/// The keys of `status --json` only a running daemon has: null offline.
const LIVE_ONLY_KEYS: [&str; 6] = [
    "origin_state",
    "origin_queue_in_flight",
    "read_hit_ratio",
    "flushes_per_barrier",
    "writeback_paused",
    "origin_queue_depth",
];

/// The reply to `request` from the cache device alone, if it is one of
/// those that only read (`None`: the request changes something, so it
/// needs the engine opened for real).
pub fn answer(cache: &Path, request: &AdminRequest) -> Result<Option<AdminReply>> {
    let read_only = match request {
        AdminRequest::Status | AdminRequest::VolumeList => true,
        AdminRequest::Flush
        | AdminRequest::Check
        | AdminRequest::CheckOrigin { .. }
        | AdminRequest::Mode { .. }
        | AdminRequest::Warm { .. }
        | AdminRequest::Set { .. }
        | AdminRequest::VolumeAdd { .. }
        | AdminRequest::VolumeSet { .. }
        | AdminRequest::VolumeRemove { .. } => false,
    };
    if !read_only {
        return Ok(None);
    }
    let inspection = inspect(cache)?;
    Ok(Some(match request {
        AdminRequest::Status => AdminReply::Status {
            status: status_json(&inspection),
        },
        _ => AdminReply::Volumes {
            volumes: volumes_json(&inspection),
        },
    }))
}

/// Open `cache` read-only (a shared lock, which a daemon's exclusive one
/// refuses) and recover its state into memory.
fn inspect(cache: &Path) -> Result<Inspection> {
    let name = cache.display().to_string();
    let device = match open_local(cache, OpenMode::ReadOnly) {
        Ok(device) => device,
        Err(DeviceError::Busy { .. }) => anyhow::bail!(
            "cache {name} is held by another process (a cairn daemon serving it?), but no daemon \
             answered at its admin socket {}: if it runs with another CAIRN_RUNTIME_DIR, ask with \
             that one set; the cache is not read while another process may be writing it",
            socket_path(cache).display()
        ),
        Err(e) => {
            let msg = e.to_string();
            if msg.starts_with(&name) {
                anyhow::bail!("cache {msg}")
            }
            anyhow::bail!("cache {name}: {msg}")
        }
    };
    Ok(Inspection::open(Arc::from(device))?)
}

/// `status --json` from the inspection: the same keys as a daemon's
/// (built by the same code), `served` false, `view` "offline", and the
/// keys only a daemon has set to null.
fn status_json(inspection: &Inspection) -> Value {
    let stats = inspection.stats();
    let settings =
        EffectiveSettings::resolve(&StoredSettings::default(), &inspection.stored_settings());
    let mut status = crate::status::status_json(
        &stats,
        &inspection.superblock(),
        &inspection.volume(),
        false,
        None,
        None,
        settings.to_json(),
    );
    if let Value::Object(m) = &mut status {
        m.insert("view".into(), json!("offline"));
        // The counters since the daemon started: there is none. The
        // lifetime totals (of the newest checkpoint) stay.
        for (name, _) in stats.counter_pairs() {
            m.insert(name.into(), Value::Null);
        }
        for key in LIVE_ONLY_KEYS {
            m.insert(key.into(), Value::Null);
        }
        m.insert("volumes".into(), volumes_json(inspection));
    }
    status
}

/// `volume list --json` from the inspection: each volume's origin state
/// is unknown (its origin was not opened).
fn volumes_json(inspection: &Inspection) -> Value {
    let mut volumes = crate::status::volumes_json(
        &inspection.volumes_status(),
        inspection.block_size_bytes(),
        None,
    );
    for volume in volumes.as_array_mut().into_iter().flatten() {
        if let Value::Object(m) = volume {
            m.insert("origin_state".into(), Value::Null);
        }
    }
    volumes
}

/// The human status of an offline view: what the cache device says, and
/// plainly that it is not served.
pub fn write_human(out: &mut impl std::io::Write, v: &Value) -> std::io::Result<()> {
    let get = |k: &str| v.get(k).map(|x| x.to_string()).unwrap_or_default();
    crate::status::write_head(
        out,
        v,
        ", not served (offline view: read from the cache device only; the origin was not opened)",
    )?;
    writeln!(
        out,
        "  log: {} of {} blocks in use; write-back position {} of {}",
        get("log_used_blocks"),
        get("cache_blocks"),
        get("writeback_offset"),
        get("head_offset")
    )?;
    writeln!(out, "  integrity: {}", crate::status::integrity_line(v))?;
    crate::status::print_settings(out, v)?;
    if let Some(lifetime) = v["lifetime"].as_object() {
        let count = |k: &str| lifetime.get(k).map(|x| x.to_string()).unwrap_or_default();
        writeln!(
            out,
            "  lifetime (every run): reads {}, writes {}, flushes {}, checksum mismatches {}",
            count("reads"),
            count("writes"),
            count("flushes"),
            count("checksum_mismatches")
        )?;
    }
    writeln!(
        out,
        "  counters since start, origin state and connections: only a running daemon has them"
    )?;
    Ok(())
}
