//! Integrity tags for a volume added to a cache: an extent of the tag area
//! for its origin, written fresh before any table names it.
//!
//! The extent's pages are written (both copies, every tag unset, then a
//! barrier) without the engine lock, since nothing reads an extent no
//! table names and an origin of a few TiB has GiBs of pages. The caller
//! then claims the extent under the lock ([`claim`]), checking it is still
//! free: another add may have taken it meanwhile. A crash before the table
//! that names the volume is durable leaves the pages unnamed, and the next
//! add that takes them writes them again.

use cairn_format::{tag_pages_for, TagArea, TagExtent, VolumeTable};

use crate::error::{EngineError, EngineResult};
use crate::parts::Parts;
use crate::tags::write_fresh;
use crate::volume_tags::VolumeTags;

/// Place and write fresh tags for an origin of `blocks` blocks. The
/// returned tags carry no volume id yet (the caller picks it under the
/// lock, then [`claim`]s the extent).
pub(crate) fn fresh_tags(p: Parts<'_>, blocks: u64) -> EngineResult<VolumeTags> {
    let env = p.env;
    let needed = tag_pages_for(blocks);
    let (area, stamp) = {
        let st = p.state.normal(env)?;
        let Some(tags) = st.tags.as_ref() else {
            // Formatted without a tag area: no room at all.
            return Err(no_room(needed, None));
        };
        (
            area_of(p, &st.superblock.features, &st.volumes)?,
            tags.stamp(),
        )
    };
    let first_page = area
        .place(needed)
        .ok_or_else(|| no_room(needed, Some(&area)))?;
    let extent = TagExtent {
        volume_id: 0,
        first_page,
        pages: needed,
    };
    let volume = VolumeTags::new_unset(extent, blocks);
    write_fresh(
        env.cache.as_ref(),
        &env.layout,
        &volume,
        &[0, 1],
        stamp,
        &env.counters,
    )
    .map_err(|e| {
        env.health
            .cache_write_failed("writing integrity tag pages", e)
    })?;
    Ok(volume)
}

/// Is the extent of `tags` still free in `table`? Called under the engine
/// lock, right before the table that names it is made.
pub(crate) fn claim(
    p: Parts<'_>,
    features: u32,
    table: &VolumeTable,
    tags: &VolumeTags,
) -> EngineResult<()> {
    let area = area_of(p, &features, table)?;
    if area.fits(tags.first_page, tags.pages()) {
        return Ok(());
    }
    Err(no_room(tags.pages(), Some(&area)))
}

fn area_of(p: Parts<'_>, features: &u32, table: &VolumeTable) -> EngineResult<TagArea> {
    TagArea::of(*features, table, p.env.block_size_bytes as u32).map_err(|e| {
        EngineError::InvalidVolume {
            device: p.env.cache.name().to_string(),
            detail: format!("the integrity tag area does not fit the volume table: {e}"),
        }
    })
}

fn no_room(needed_pages: u64, area: Option<&TagArea>) -> EngineError {
    EngineError::NoTagRoom {
        needed_pages,
        free_pages: area.map_or(0, |a| a.free_pages()),
        area_pages: area.map_or(0, |a| a.pages()),
    }
}
