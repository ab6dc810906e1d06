//! Integrity tags for a volume added to a cache: an extent of the tag area
//! for its origin, written fresh before any table names it.
//!
//! The extent is placed and reserved under the engine lock (so two adds at
//! once never pick the same pages), then its pages are written (both
//! copies, every tag unset, then a barrier) without the lock, since
//! nothing reads an extent no table names and an origin of a few TiB has
//! GiBs of pages. The caller then writes the table that names it, under
//! the lock, and releases the reservation. A crash before that table is
//! durable leaves the pages unnamed, and the next add that takes them
//! writes them again.

use cairn_format::{tag_pages_for, TagArea, TagExtent, VolumeTable};

use crate::error::{EngineError, EngineResult};
use crate::parts::Parts;
use crate::state::State;
use crate::tags::write_fresh;
use crate::volume_tags::VolumeTags;

/// An extent reserved for an add in progress; released when dropped.
pub(crate) struct Reserved<'a> {
    p: Parts<'a>,
    first_page: u64,
    armed: bool,
}

impl Reserved<'_> {
    /// Release the reservation with the engine lock already held (the
    /// table naming the extent was written, or the add failed).
    pub(crate) fn release(mut self, st: &mut State) {
        if let Some(tags) = st.tags.as_mut() {
            tags.unreserve(self.first_page);
        }
        self.armed = false;
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Some(tags) = self.p.state.unchecked().tags.as_mut() {
                tags.unreserve(self.first_page);
            }
        }
    }
}

/// Place, reserve and write fresh tags for an origin of `blocks` blocks.
/// The returned tags carry no volume id yet (the caller picks it under the
/// lock, writes the table and releases the reservation).
pub(crate) fn fresh_tags(p: Parts<'_>, blocks: u64) -> EngineResult<(VolumeTags, Reserved<'_>)> {
    let env = p.env;
    let needed = tag_pages_for(blocks);
    let (extent, stamp) = {
        let mut st = p.state.normal(env)?;
        let st = &mut *st;
        let Some(tags) = st.tags.as_mut() else {
            // Formatted without a tag area: no room at all.
            return Err(no_room(needed, None));
        };
        let area = area_of(p, st.superblock.features, &st.volumes)?;
        let busy = area
            .with_taken(tags.reserved())
            .ok_or_else(|| no_room(needed, Some(&area)))?;
        let first_page = busy
            .place(needed)
            .ok_or_else(|| no_room(needed, Some(&busy)))?;
        let extent = TagExtent {
            volume_id: 0,
            first_page,
            pages: needed,
        };
        tags.reserve(extent);
        (extent, tags.stamp())
    };
    let reserved = Reserved {
        p,
        first_page: extent.first_page,
        armed: true,
    };
    let volume = VolumeTags::new_unset(extent, blocks);
    // Without the engine lock, beside barriers: watched like their syncs.
    env.syncs
        .watch(|| {
            write_fresh(
                env.cache.as_ref(),
                &env.layout,
                &volume,
                &[0, 1],
                stamp,
                &env.counters,
            )
        })
        .map_err(|e| {
            env.health
                .cache_write_failed("writing integrity tag pages", e)
        })?;
    Ok((volume, reserved))
}

/// Is the extent of `tags` free in `table`? Called under the engine lock,
/// right before the table that names it is made (the reservation kept
/// other adds off it; this checks what the table says).
pub(crate) fn claim(
    p: Parts<'_>,
    features: u32,
    table: &VolumeTable,
    tags: &VolumeTags,
) -> EngineResult<()> {
    let area = area_of(p, features, table)?;
    if area.fits(tags.first_page, tags.pages()) {
        return Ok(());
    }
    Err(no_room(tags.pages(), Some(&area)))
}

fn area_of(p: Parts<'_>, features: u32, table: &VolumeTable) -> EngineResult<TagArea> {
    TagArea::of(features, table, p.env.block_size_bytes as u32).map_err(|e| {
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
