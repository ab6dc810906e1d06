//! One volume's origin integrity tags in memory: a tag per origin block,
//! the pages of its extent of the tag area, which copy of each page is the
//! newest, and which pages changed since they were written.

use cairn_format::{TagExtent, TAGS_PER_PAGE, TAG_UNSET};

pub(crate) struct VolumeTags {
    pub volume_id: u16,
    /// Told apart from an earlier volume with the same id (and maybe the
    /// same extent): set by the table when it takes the volume on, so a
    /// step that read the origin without the lock can see the volume it
    /// read for was removed meanwhile.
    pub serial: u64,
    /// The extent's first page in the tag area.
    pub first_page: u64,
    tags: Vec<u32>,
    /// Per page of the extent: the copy (0 or 1) with its newest version.
    current_copy: Vec<u8>,
    /// Bitmap of the extent's pages changed since they were last written.
    dirty: Vec<u64>,
    dirty_pages: u64,
    /// Tags below this block were computed by recalculation (or set by
    /// write-back); at and above it, unset tags are still expected.
    pub recalc_pos: u64,
}

impl VolumeTags {
    /// Unset tags for `blocks` origin blocks, in `extent` (which must be
    /// exactly as large as they need).
    pub fn new_unset(extent: TagExtent, blocks: u64) -> VolumeTags {
        assert_eq!(extent.pages, cairn_format::tag_pages_for(blocks));
        let pages = extent.pages as usize;
        VolumeTags {
            volume_id: extent.volume_id,
            serial: 0,
            first_page: extent.first_page,
            tags: vec![TAG_UNSET; blocks as usize],
            current_copy: vec![1; pages],
            dirty: vec![0; pages.div_ceil(64)],
            dirty_pages: 0,
            recalc_pos: 0,
        }
    }

    pub fn blocks(&self) -> u64 {
        self.tags.len() as u64
    }

    /// Pages of the extent.
    pub fn pages(&self) -> u64 {
        self.current_copy.len() as u64
    }

    pub fn dirty_pages(&self) -> u64 {
        self.dirty_pages
    }

    pub fn memory_bytes(&self) -> usize {
        self.tags.len() * 4 + self.current_copy.len() + self.dirty.len() * 8
    }

    pub fn get(&self, lba: u64) -> u32 {
        self.tags[lba as usize]
    }

    pub fn set(&mut self, lba: u64, tag: u32) {
        let cell = &mut self.tags[lba as usize];
        if *cell != tag {
            *cell = tag;
            self.mark_dirty(lba / TAGS_PER_PAGE as u64);
        }
    }

    /// Set `count` tags from `lba` to one value (zero or discard ranges).
    pub fn set_range(&mut self, lba: u64, count: u64, tag: u32) {
        let end = lba + count;
        assert!(end <= self.blocks());
        let mut at = lba;
        // Page by page, so only pages that change are marked.
        while at < end {
            let page = at / TAGS_PER_PAGE as u64;
            let page_end = ((page + 1) * TAGS_PER_PAGE as u64).min(end);
            let cells = &mut self.tags[at as usize..page_end as usize];
            if cells.iter().any(|&t| t != tag) {
                cells.fill(tag);
                self.mark_dirty(page);
            }
            at = page_end;
        }
    }

    /// Page `page` of the extent as it read from the device: its tags.
    pub fn load_page(&mut self, page: u64, copy: u8, tags: &[u32]) {
        let start = (page * TAGS_PER_PAGE as u64) as usize;
        let end = (start + TAGS_PER_PAGE).min(self.tags.len());
        self.tags[start..end].copy_from_slice(&tags[..end - start]);
        self.current_copy[page as usize] = copy;
    }

    /// A page with no valid copy: its tags stay unset and it is written at
    /// the next persist.
    pub fn lose_page(&mut self, page: u64) {
        self.current_copy[page as usize] = 0;
        self.mark_dirty(page);
    }

    /// The tags of page `page` of the extent, the last one padded with unset
    /// tags.
    pub fn page_tags(&self, page: u64) -> Vec<u32> {
        let start = (page * TAGS_PER_PAGE as u64) as usize;
        let end = (start + TAGS_PER_PAGE).min(self.tags.len());
        let mut tags = self.tags[start..end].to_vec();
        tags.resize(TAGS_PER_PAGE, TAG_UNSET);
        tags
    }

    /// The copy a rewrite of `page` goes to: the one not holding its newest
    /// version.
    pub fn target_copy(&self, page: u64) -> u8 {
        1 - self.current_copy[page as usize]
    }

    /// The extent's dirty pages, in order.
    pub fn dirty_list(&self) -> Vec<u64> {
        let mut pages = Vec::with_capacity(self.dirty_pages as usize);
        for (word, &bits) in self.dirty.iter().enumerate() {
            let mut bits = bits;
            while bits != 0 {
                let bit = bits.trailing_zeros() as u64;
                bits &= bits - 1;
                pages.push(word as u64 * 64 + bit);
            }
        }
        assert_eq!(pages.len() as u64, self.dirty_pages);
        pages
    }

    /// `pages` reached their other copy: that copy is now the newest.
    pub fn written(&mut self, pages: &[u64]) {
        for &page in pages {
            let copy = &mut self.current_copy[page as usize];
            *copy = 1 - *copy;
        }
        self.dirty.fill(0);
        self.dirty_pages = 0;
    }

    /// Every page reached copy `copy` (a fresh extent).
    pub fn all_written_to(&mut self, copy: u8) {
        self.current_copy.fill(copy);
        self.dirty.fill(0);
        self.dirty_pages = 0;
    }

    fn mark_dirty(&mut self, page: u64) {
        let (word, bit) = ((page / 64) as usize, page % 64);
        if self.dirty[word] & (1 << bit) == 0 {
            self.dirty[word] |= 1 << bit;
            self.dirty_pages += 1;
        }
    }
}
