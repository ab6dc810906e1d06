//! One volume as `status` and `volume list` show it: its table entry and
//! its blocks in the cache.

use cairn_format::VolumeEntry;

use crate::parts::Parts;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeStatus {
    pub entry: VolumeEntry,
    pub dirty_blocks: u64,
    pub clean_blocks: u64,
    /// Log offset before which every block of this volume is on its
    /// origin (its own write-back position; the cache's is the least).
    pub writeback_offset: u64,
    /// The last error of this volume's origin while write-back to it keeps
    /// failing (the other volumes' write-back goes on meanwhile).
    pub origin_error: Option<String>,
    /// Its origin fenced this process: it takes no writes until a restart.
    pub origin_fenced: bool,
    /// The share of the log this volume's dirty data may hold while other
    /// volumes use the cache: its own setting or the default, in percent.
    pub dirty_share_pct: u8,
    /// The most dirty blocks it may hold now (`None`: no limit, as no
    /// other volume holds anything in the cache).
    pub dirty_limit_blocks: Option<u64>,
    /// With integrity: tags are computed (or set by write-back) for every
    /// origin block below this one (`None`: the volume keeps no tags).
    pub recalc_position_blocks: Option<u64>,
}

/// Every volume with its blocks in the cache, in table order.
pub(crate) fn statuses(p: Parts<'_>) -> Vec<VolumeStatus> {
    let st = p.state.unchecked();
    st.volumes
        .volumes()
        .iter()
        .map(|entry| {
            let blocks = st.index.volume_blocks(entry.id);
            VolumeStatus {
                entry: entry.clone(),
                dirty_blocks: blocks.dirty,
                clean_blocks: blocks.clean,
                writeback_offset: st
                    .log
                    .volume_writeback_position(entry.id)
                    .unwrap_or_else(|| st.log.writeback_position()),
                origin_error: p.writeback.volume_origin_error(entry.id).or_else(|| {
                    p.env
                        .origins
                        .get(entry.id)
                        .and_then(|o| o.device().known_problem())
                }),
                origin_fenced: p.env.health.origin_fenced(entry.id),
                dirty_share_pct: entry.dirty_share_pct.unwrap_or_else(|| {
                    crate::write::default_dirty_share_pct(st.volumes.volumes().len())
                }),
                dirty_limit_blocks: crate::write::dirty_limit_blocks(
                    &st,
                    entry.id,
                    p.writeback.volume_origin_failing(entry.id),
                ),
                recalc_position_blocks: st
                    .tags
                    .as_ref()
                    .and_then(|t| t.volume(entry.id))
                    .map(|v| v.recalc_pos.min(v.blocks())),
            }
        })
        .collect()
}
