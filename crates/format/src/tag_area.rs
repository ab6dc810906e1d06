//! How the tag area is shared among the volumes that keep origin integrity
//! tags.
//!
//! Two shapes exist. A cache formatted without a reserve for later volumes
//! has, with `FEATURE_INTEGRITY`, a tag area sized for the first volume's
//! origin and nothing else: page `k` holds tags `k * TAGS_PER_PAGE ..` of
//! volume 0. A cache with `FEATURE_TAG_EXTENTS` has a tag area of
//! `tag_area_pages` pages (the volume table's header says how many) shared
//! out in extents: each volume with integrity owns the pages from its
//! entry's `tag_first_page`, as many as its origin needs, and no two
//! extents overlap. Adding a volume with integrity takes a free run of
//! pages; removing it gives them back.
//!
//! Both shapes come from device contents (the superblock's features and the
//! volume table), so every rule is checked and broken ones are errors.

use crate::{tag_pages_for, DecodeError, VolumeTable, FEATURE_INTEGRITY, FEATURE_TAG_EXTENTS};

/// The pages of the tag area one volume's tags live in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TagExtent {
    pub volume_id: u16,
    pub first_page: u64,
    pub pages: u64,
}

impl TagExtent {
    pub fn end_page(&self) -> u64 {
        self.first_page + self.pages
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagArea {
    /// Pages per copy.
    pages: u64,
    /// One per volume with integrity, sorted by first page, disjoint.
    extents: Vec<TagExtent>,
}

impl TagArea {
    /// The tag area of a cache, from its superblock's `features` and its
    /// volume table, checked.
    pub fn of(
        features: u32,
        table: &VolumeTable,
        block_size_bytes: u32,
    ) -> Result<TagArea, DecodeError> {
        let damage = |field: &'static str, value: u64| DecodeError::OutOfRange { field, value };
        let pages_of = |origin_size_bytes: u64| {
            tag_pages_for(origin_size_bytes / block_size_bytes.max(1) as u64)
        };
        let tagged = || table.volumes().iter().filter(|v| v.integrity);
        if features & FEATURE_TAG_EXTENTS == 0 {
            // Only the first volume can have tags, from page 0.
            if table.tag_area_pages != 0 {
                return Err(damage("volume_table_tag_area_pages", table.tag_area_pages));
            }
            let first_has_tags = features & FEATURE_INTEGRITY != 0;
            let mut extents = Vec::new();
            for v in tagged() {
                if v.id != 0 || !first_has_tags || v.tag_first_page != 0 {
                    return Err(damage("volume_integrity", v.id as u64));
                }
                extents.push(TagExtent {
                    volume_id: 0,
                    first_page: 0,
                    pages: pages_of(v.origin_size_bytes),
                });
            }
            if first_has_tags && extents.is_empty() {
                return Err(damage("volume_integrity", 0));
            }
            let pages = extents.first().map_or(0, |e| e.pages);
            return Ok(TagArea { pages, extents });
        }
        if features & FEATURE_INTEGRITY == 0 || table.tag_area_pages == 0 {
            return Err(damage("volume_table_tag_area_pages", table.tag_area_pages));
        }
        let mut extents: Vec<TagExtent> = tagged()
            .map(|v| TagExtent {
                volume_id: v.id,
                first_page: v.tag_first_page,
                pages: pages_of(v.origin_size_bytes),
            })
            .collect();
        extents.sort_by_key(|e| e.first_page);
        let mut end = 0u64;
        for e in &extents {
            let fits = e.first_page >= end
                && e.first_page
                    .checked_add(e.pages)
                    .is_some_and(|last| last <= table.tag_area_pages);
            if !fits {
                return Err(damage("volume_tag_first_page", e.first_page));
            }
            end = e.end_page();
        }
        Ok(TagArea {
            pages: table.tag_area_pages,
            extents,
        })
    }

    /// This area with `extra` extents taken too (pages being written for
    /// volumes not yet in the table). Each must be free.
    pub fn with_taken(&self, extra: &[TagExtent]) -> Option<TagArea> {
        let mut area = self.clone();
        for e in extra {
            if !area.fits(e.first_page, e.pages) {
                return None;
            }
            area.insert(*e);
        }
        Some(area)
    }

    /// Pages per copy.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    pub fn extents(&self) -> &[TagExtent] {
        &self.extents
    }

    /// Pages no volume holds.
    pub fn free_pages(&self) -> u64 {
        self.pages - self.extents.iter().map(|e| e.pages).sum::<u64>()
    }

    /// The first page of the lowest free run of at least `pages` pages.
    pub fn place(&self, pages: u64) -> Option<u64> {
        let mut start = 0u64;
        for e in &self.extents {
            if e.first_page - start >= pages {
                return Some(start);
            }
            start = e.end_page();
        }
        (self.pages - start >= pages).then_some(start)
    }

    /// Is the run of `pages` pages from `first_page` inside the area and
    /// free?
    pub fn fits(&self, first_page: u64, pages: u64) -> bool {
        let end = first_page.saturating_add(pages);
        end <= self.pages
            && self
                .extents
                .iter()
                .all(|e| end <= e.first_page || first_page >= e.end_page())
    }

    fn insert(&mut self, extent: TagExtent) {
        let at = self
            .extents
            .partition_point(|e| e.first_page < extent.first_page);
        self.extents.insert(at, extent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volume_entry::tests::sample;
    use crate::{VolumeEntry, TAGS_PER_PAGE};

    const BLOCK: u32 = 4096;

    /// Volume `id` with an origin covered by exactly `pages` tag pages.
    fn volume(id: u16, pages: u64, tag_first_page: Option<u64>) -> VolumeEntry {
        let mut v = sample(id, &format!("v{id}"));
        v.origin_size_bytes = pages * TAGS_PER_PAGE as u64 * BLOCK as u64;
        v.integrity = tag_first_page.is_some();
        v.tag_first_page = tag_first_page.unwrap_or(0);
        v
    }

    fn table(area: u64, volumes: Vec<VolumeEntry>) -> VolumeTable {
        VolumeTable::new_with_tag_area(1, [1; 16], area, volumes).expect("valid table")
    }

    const SHARED: u32 = FEATURE_INTEGRITY | FEATURE_TAG_EXTENTS;

    /// An area of `pages` pages with `extents` taken.
    fn area(pages: u64, extents: &[TagExtent]) -> TagArea {
        TagArea {
            pages,
            extents: Vec::new(),
        }
        .with_taken(extents)
        .expect("free extents")
    }

    fn extent_of(area: &TagArea, volume_id: u16) -> Option<TagExtent> {
        area.extents()
            .iter()
            .copied()
            .find(|e| e.volume_id == volume_id)
    }

    #[test]
    fn a_cache_without_extents_has_the_first_volumes_tags_only() {
        let t = table(0, vec![volume(0, 5, Some(0)), volume(1, 3, None)]);
        let area = TagArea::of(FEATURE_INTEGRITY, &t, BLOCK).expect("valid");
        assert_eq!(area.pages(), 5);
        assert_eq!(extent_of(&area, 0).map(|e| e.pages), Some(5));
        assert_eq!(area.place(1), None);
        // Without the feature bit, no tags at all.
        let plain = table(0, vec![volume(0, 5, None)]);
        assert_eq!(TagArea::of(0, &plain, BLOCK).map(|a| a.pages()), Ok(0));
        // The flag and the bit must agree, and only volume 0 may have tags.
        assert!(TagArea::of(0, &t, BLOCK).is_err());
        assert!(TagArea::of(FEATURE_INTEGRITY, &plain, BLOCK).is_err());
        let second = table(0, vec![volume(0, 5, Some(0)), volume(1, 3, Some(0))]);
        assert!(TagArea::of(FEATURE_INTEGRITY, &second, BLOCK).is_err());
        let area_field = table(9, vec![volume(0, 5, Some(0))]);
        assert!(TagArea::of(FEATURE_INTEGRITY, &area_field, BLOCK).is_err());
    }

    #[test]
    fn extents_must_lie_inside_the_area_and_apart() {
        let good = table(
            20,
            vec![
                volume(0, 4, None),
                volume(1, 3, Some(10)),
                volume(2, 5, Some(2)),
            ],
        );
        let area = TagArea::of(SHARED, &good, BLOCK).expect("valid");
        assert_eq!(area.free_pages(), 12);
        assert_eq!(extent_of(&area, 2).map(|e| e.first_page), Some(2));
        assert_eq!(area.place(2), Some(0));
        assert_eq!(area.place(3), Some(7));
        assert_eq!(area.place(4), Some(13));
        assert_eq!(area.place(7), Some(13));
        assert_eq!(area.place(8), None);
        assert!(area.fits(7, 3) && !area.fits(6, 3) && !area.fits(13, 8));
        let overlapping = table(20, vec![volume(1, 3, Some(10)), volume(2, 5, Some(8))]);
        assert!(TagArea::of(SHARED, &overlapping, BLOCK).is_err());
        let outside = table(20, vec![volume(1, 3, Some(18))]);
        assert!(TagArea::of(SHARED, &outside, BLOCK).is_err());
        let huge = table(20, vec![volume(1, 3, Some(u64::MAX - 1))]);
        assert!(TagArea::of(SHARED, &huge, BLOCK).is_err());
        // Extents need the integrity bit and a non-empty area.
        assert!(TagArea::of(FEATURE_TAG_EXTENTS, &good, BLOCK).is_err());
        let empty = table(0, vec![volume(0, 4, None)]);
        assert!(TagArea::of(SHARED, &empty, BLOCK).is_err());
    }

    #[test]
    fn an_area_built_in_memory_places_the_same_way() {
        let mut full = area(
            8,
            &[TagExtent {
                volume_id: 0,
                first_page: 0,
                pages: 3,
            }],
        );
        assert_eq!(full.place(5), Some(3));
        assert_eq!(full.place(6), None);
        full.insert(TagExtent {
            volume_id: 4,
            first_page: 3,
            pages: 5,
        });
        assert_eq!((full.free_pages(), full.place(1)), (0, None));
        let area = area(8, &[]);
        let taken = TagExtent {
            volume_id: 0,
            first_page: 2,
            pages: 3,
        };
        let busy = area.with_taken(&[taken]).expect("free");
        assert_eq!((busy.place(2), busy.place(3)), (Some(0), Some(5)));
        assert!(busy.with_taken(&[taken]).is_none(), "taken twice");
    }
}
