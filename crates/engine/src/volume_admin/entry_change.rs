//! Changing volume table entries: finding a volume by name, the next table
//! with one entry changed, and the dirty share, which `volume add` and
//! `volume set` both check.

use cairn_format::{VolumeEntry, VolumeTable};

use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::parts::Parts;

/// Volume `name`'s entry in `table`.
pub(crate) fn entry_of(table: &VolumeTable, name: &str) -> EngineResult<VolumeEntry> {
    table
        .by_name(name)
        .cloned()
        .ok_or_else(|| EngineError::VolumeNotFound { name: name.into() })
}

/// Volume `name`'s id in `table`.
pub(crate) fn id_of(table: &VolumeTable, name: &str) -> EngineResult<u16> {
    entry_of(table, name).map(|v| v.id)
}

/// `volumes` as the table after `table` (same sequence, cache and tag
/// area).
pub(crate) fn next_table(
    env: &Env,
    table: &VolumeTable,
    volumes: Vec<VolumeEntry>,
) -> EngineResult<VolumeTable> {
    table
        .with_volumes(volumes)
        .map_err(|e| EngineError::InvalidVolume {
            device: env.cache.name().to_string(),
            detail: e.to_string(),
        })
}

/// `table` with volume `id` changed by `change`, as the next table.
pub(crate) fn changed(
    env: &Env,
    table: &VolumeTable,
    id: u16,
    change: impl FnOnce(&mut VolumeEntry),
) -> EngineResult<VolumeTable> {
    let mut volumes = table.volumes().to_vec();
    let Some(entry) = volumes.iter_mut().find(|v| v.id == id) else {
        return Err(EngineError::NoSuchVolume { volume_id: id });
    };
    change(entry);
    next_table(env, table, volumes)
}

/// A dirty share a volume may have: 1 to 100 percent of the log, or none
/// (the default).
pub(crate) fn check_dirty_share(env: &Env, pct: Option<u8>) -> EngineResult<()> {
    match pct {
        Some(pct) if !(1..=100).contains(&pct) => Err(EngineError::InvalidVolume {
            device: env.cache.name().to_string(),
            detail: format!(
                "a dirty share of {pct}% is out of range: give 1 to 100 percent of the log"
            ),
        }),
        _ => Ok(()),
    }
}

/// Set volume `name`'s dirty share (`None`: the default), in a new table.
pub(crate) fn set_dirty_share(p: Parts<'_>, name: &str, pct: Option<u8>) -> EngineResult<()> {
    check_dirty_share(p.env, pct)?;
    let mut st = p.state.normal(p.env)?;
    let id = id_of(&st.volumes, name)?;
    let table = changed(p.env, &st.volumes, id, |v| v.dirty_share_pct = pct)?;
    st.write_volume_table(p.env, table)
}
