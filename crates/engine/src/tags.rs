//! Origin integrity tags in memory, and their persistence.
//!
//! Every tag lives in RAM (4 bytes per origin block), so no write and no
//! read ever reads a tag from a device: tags are read once, at open. Pages
//! changed in memory are marked dirty and written, each into the copy that
//! does not hold its newest version, before every superblock write — so a
//! superblock that advances the write-back or recalculation position never
//! points past tags that are not yet durable. Write-back sets tags only
//! after the origin was flushed, so a tag on the device never describes
//! data the origin may not have; blocks whose write-back is redone after a
//! crash are dirty again and exempt until the redo sets their tag again.

use cairn_device::{Device, DeviceError};
use cairn_format::{
    block_checksum, Layout, RangeKind, TagPage, TAGS_PER_PAGE, TAG_PAGE_BYTES, TAG_UNSET,
};

use crate::stats::Counters;

/// Tag pages are read and written in batches of at most this many bytes.
const TAG_IO_CHUNK_BYTES: usize = 1 << 20;
const PAGES_PER_CHUNK: u64 = (TAG_IO_CHUNK_BYTES / TAG_PAGE_BYTES) as u64;
/// Tag page copies with a sequence at or above this are not trusted.
const TAG_SEQUENCE_LIMIT: u64 = crate::superblocks::LOG_COUNTER_LIMIT;

pub(crate) struct TagTable {
    tags: Vec<u32>,
    /// Per page: the copy (0 or 1) that holds its newest valid version.
    current_copy: Vec<u8>,
    /// Bitmap of pages changed in memory since they were last written.
    dirty: Vec<u64>,
    dirty_pages: u64,
    /// Stamped on the next batch of page writes; higher wins at load.
    next_sequence: u64,
    format_tag: u32,
    /// Tags below this block were computed by recalculation (or set by
    /// write-back); at and above it, unset tags are still expected.
    pub recalc_pos: u64,
}

impl TagTable {
    /// A table of unset tags for a fresh format.
    pub fn new_unset(origin_blocks: u64, pages: u64, format_tag: u32) -> TagTable {
        assert_eq!(pages, cairn_format::tag_pages_for(origin_blocks));
        TagTable {
            tags: vec![TAG_UNSET; origin_blocks as usize],
            current_copy: vec![1; pages as usize],
            dirty: vec![0; (pages as usize).div_ceil(64)],
            dirty_pages: 0,
            next_sequence: 1,
            format_tag,
            recalc_pos: 0,
        }
    }

    pub fn origin_blocks(&self) -> u64 {
        self.tags.len() as u64
    }

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

    /// The tag of the block named by `key`, if the table covers it: tags
    /// are kept for the first volume only (its keys are its addresses), so
    /// any other volume's block has none.
    pub fn tag_of(&self, key: u64) -> Option<u32> {
        (key < self.origin_blocks()).then(|| self.get(key))
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
        assert!(end <= self.origin_blocks());
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

    /// Write-back put these ranges, then these blocks (with their verified
    /// checksums), on the origin and flushed it: their tags follow, in that
    /// order.
    pub fn record_origin_writes(
        &mut self,
        ranges: &[(RangeKind, u64, u64)],
        blocks: &[(u64, u32)],
    ) {
        // Tags cover the first volume only; a range never crosses volumes.
        let covered = self.origin_blocks();
        for &(kind, lba, count) in ranges.iter().filter(|r| r.1 < covered) {
            let tag = match kind {
                RangeKind::Zero => cairn_format::TAG_ZERO,
                RangeKind::Discard => cairn_format::TAG_DISCARDED,
            };
            self.set_range(lba, count, tag);
        }
        for &(lba, crc) in blocks.iter().filter(|b| b.0 < covered) {
            self.set(lba, cairn_format::fold_tag(crc));
        }
    }

    /// After recovery: a clean copy inserted from an origin read holds what
    /// the origin held then, and the origin has not changed since (a later
    /// write would have replaced the copy in the index). Its tag may still
    /// be the pre-crash one if the write-back that produced that origin
    /// data had not persisted its tags: that write-back is redone later,
    /// but until then the tag must already describe the origin. So the tag
    /// is set from the copy's checksum. Nothing is trusted that was not
    /// verified: the copy's crc came from a verified origin read. Returns
    /// the tags changed.
    pub fn heal_from_clean_copies(
        &mut self,
        copies: impl Iterator<Item = (u64, u32)>,
        block_size_bytes: usize,
    ) -> u64 {
        let zeroes = vec![0u8; block_size_bytes];
        let mut healed = 0u64;
        let covered = self.origin_blocks();
        for (lba, crc) in copies.filter(|c| c.0 < covered) {
            let expected = cairn_format::fold_tag(crc);
            let tag = self.get(lba);
            let agrees = tag == expected
                || (tag == cairn_format::TAG_ZERO && block_checksum(lba, &zeroes) == crc);
            if !agrees {
                self.set(lba, expected);
                healed += 1;
            }
        }
        healed
    }

    fn mark_dirty(&mut self, page: u64) {
        let (word, bit) = ((page / 64) as usize, page % 64);
        if self.dirty[word] & (1 << bit) == 0 {
            self.dirty[word] |= 1 << bit;
            self.dirty_pages += 1;
        }
    }

    fn page_tags(&self, page: u64) -> Vec<u32> {
        let start = (page * TAGS_PER_PAGE as u64) as usize;
        let end = (start + TAGS_PER_PAGE).min(self.tags.len());
        let mut tags = self.tags[start..end].to_vec();
        // The last page is padded with unset tags.
        tags.resize(TAGS_PER_PAGE, TAG_UNSET);
        tags
    }

    /// Write every page to copy 0 (format). Copy 1 may hold anything: pages
    /// of an earlier format carry another format tag and never count.
    pub fn write_all(
        &mut self,
        cache: &dyn Device,
        layout: &Layout,
        counters: &Counters,
    ) -> Result<(), DeviceError> {
        let pages = self.pages();
        let mut buf = vec![0u8; TAG_IO_CHUNK_BYTES];
        let mut page = 0u64;
        while page < pages {
            let count = PAGES_PER_CHUNK.min(pages - page);
            for k in 0..count {
                let at = k as usize * TAG_PAGE_BYTES;
                self.encode_page(page + k, &mut buf[at..at + TAG_PAGE_BYTES]);
            }
            let len = count as usize * TAG_PAGE_BYTES;
            cache.write_at(layout.tag_page_offset_bytes(page, 0), &buf[..len])?;
            Counters::add(&counters.tag_pages_written, count);
            Counters::add(&counters.cache_bytes_written, len as u64);
            page += count;
        }
        cache.flush()?;
        self.current_copy.fill(0);
        self.dirty.fill(0);
        self.dirty_pages = 0;
        self.next_sequence += 1;
        Ok(())
    }

    fn encode_page(&self, page: u64, out: &mut [u8]) {
        TagPage {
            page_index: page,
            sequence: self.next_sequence,
            format_tag: self.format_tag,
            tags: self.page_tags(page),
        }
        .encode_into(out);
    }

    /// Load every page, picking the newest valid copy of each. Returns the
    /// table and the pages whose both copies were unreadable (their tags are
    /// unset and they are queued for rewriting; the caller moves the
    /// recalculation position back so they are recomputed).
    pub fn load(
        cache: &dyn Device,
        layout: &Layout,
        origin_blocks: u64,
        format_tag: u32,
        recalc_pos: u64,
    ) -> Result<(TagTable, Vec<u64>), DeviceError> {
        let pages = layout.tag_pages;
        let mut table = TagTable::new_unset(origin_blocks, pages, format_tag);
        table.recalc_pos = recalc_pos.min(origin_blocks);
        let mut best: Vec<Option<(u64, u8)>> = vec![None; pages as usize];
        let mut buf = vec![0u8; TAG_IO_CHUNK_BYTES];
        let mut max_sequence = 0u64;
        for copy in 0..2u8 {
            let mut page = 0u64;
            while page < pages {
                let count = PAGES_PER_CHUNK.min(pages - page);
                let len = count as usize * TAG_PAGE_BYTES;
                cache.read_at(layout.tag_page_offset_bytes(page, copy), &mut buf[..len])?;
                for k in 0..count {
                    let at = k as usize * TAG_PAGE_BYTES;
                    let Ok(decoded) = TagPage::decode(&buf[at..at + TAG_PAGE_BYTES]) else {
                        continue;
                    };
                    let index = page + k;
                    // A sequence near the top of the range is damage (pages
                    // count up from 1 by one per batch): such a copy is not
                    // trusted, so the next sequence cannot overflow.
                    if decoded.page_index != index
                        || decoded.format_tag != format_tag
                        || decoded.sequence >= TAG_SEQUENCE_LIMIT
                    {
                        continue;
                    }
                    let slot = &mut best[index as usize];
                    if slot.is_none_or(|(seq, _)| decoded.sequence > seq) {
                        *slot = Some((decoded.sequence, copy));
                        max_sequence = max_sequence.max(decoded.sequence);
                        let start = (index * TAGS_PER_PAGE as u64) as usize;
                        let end = (start + TAGS_PER_PAGE).min(origin_blocks as usize);
                        table.tags[start..end].copy_from_slice(&decoded.tags[..end - start]);
                    }
                }
                page += count;
            }
        }
        let mut lost = Vec::new();
        for (index, choice) in best.iter().enumerate() {
            match choice {
                Some((_, copy)) => table.current_copy[index] = *copy,
                None => {
                    lost.push(index as u64);
                    table.current_copy[index] = 0;
                    table.mark_dirty(index as u64);
                }
            }
        }
        table.next_sequence = max_sequence + 1;
        Ok((table, lost))
    }

    /// Write every dirty page into its other copy, then one barrier. On
    /// success the pages are clean and their current copy flipped.
    pub fn persist(
        &mut self,
        cache: &dyn Device,
        layout: &Layout,
        counters: &Counters,
    ) -> Result<(), DeviceError> {
        if self.dirty_pages == 0 {
            return Ok(());
        }
        let mut written: Vec<u64> = Vec::with_capacity(self.dirty_pages as usize);
        let mut bufs: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut pending_bytes = 0usize;
        let pages = self.pages();
        for word in 0..self.dirty.len() {
            let mut bits = self.dirty[word];
            while bits != 0 {
                let bit = bits.trailing_zeros() as u64;
                bits &= bits - 1;
                let page = word as u64 * 64 + bit;
                assert!(page < pages);
                let target = 1 - self.current_copy[page as usize];
                let at = layout.tag_page_offset_bytes(page, target);
                let mut out = vec![0u8; TAG_PAGE_BYTES];
                self.encode_page(page, &mut out);
                // Neighbouring pages going to the same copy merge into one I/O.
                match bufs.last_mut() {
                    Some((start, buf))
                        if *start + buf.len() as u64 == at && buf.len() < TAG_IO_CHUNK_BYTES =>
                    {
                        buf.extend_from_slice(&out)
                    }
                    _ => bufs.push((at, out)),
                }
                pending_bytes += TAG_PAGE_BYTES;
                written.push(page);
                if pending_bytes >= TAG_IO_CHUNK_BYTES {
                    write_batch(cache, &bufs)?;
                    Counters::add(&counters.cache_bytes_written, pending_bytes as u64);
                    bufs.clear();
                    pending_bytes = 0;
                }
            }
        }
        if !bufs.is_empty() {
            write_batch(cache, &bufs)?;
            Counters::add(&counters.cache_bytes_written, pending_bytes as u64);
        }
        cache.flush()?;
        Counters::add(&counters.cache_barriers, 1);
        Counters::add(&counters.tag_pages_written, written.len() as u64);
        assert_eq!(written.len() as u64, self.dirty_pages);
        for page in written {
            let copy = &mut self.current_copy[page as usize];
            *copy = 1 - *copy;
        }
        self.dirty.fill(0);
        self.dirty_pages = 0;
        self.next_sequence += 1;
        Ok(())
    }
}

fn write_batch(cache: &dyn Device, bufs: &[(u64, Vec<u8>)]) -> Result<(), DeviceError> {
    let writes: Vec<(u64, &[u8])> = bufs.iter().map(|(at, b)| (*at, b.as_slice())).collect();
    cache.write_many(&writes)?;
    Ok(())
}
