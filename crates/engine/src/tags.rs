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
//!
//! Tags are kept per volume ([`VolumeTags`]), each in its extent of the tag
//! area (`cairn_format::TagArea`); a block is named by its key, and a key
//! of a volume without tags has none.

use cairn_device::{Device, DeviceError};
use cairn_format::TAG_PAGE_BYTES;
use cairn_format::{
    block_checksum, key_lba, key_volume, Layout, RangeKind, TagArea, TagExtent, TagPage,
};

use crate::stats::Counters;
use crate::volume_tags::VolumeTags;

/// Tag pages are read and written in batches of at most this many bytes.
const TAG_IO_CHUNK_BYTES: usize = 1 << 20;
const PAGES_PER_CHUNK: u64 = (TAG_IO_CHUNK_BYTES / TAG_PAGE_BYTES) as u64;
/// Tag page copies with a sequence at or above this are not trusted.
const TAG_SEQUENCE_LIMIT: u64 = crate::superblocks::LOG_COUNTER_LIMIT;

pub(crate) struct TagTable {
    /// The volumes with tags, by id.
    volumes: Vec<VolumeTags>,
    /// Extents being written for volumes still being added: no table
    /// names them yet, but no other add may place its pages there.
    reserved: Vec<TagExtent>,
    /// Given to the next volume taken on (`VolumeTags::serial`).
    next_serial: u64,
    /// Stamped on the next batch of page writes; higher wins at load.
    next_sequence: u64,
    format_tag: u32,
}

impl TagTable {
    /// A table with no volume yet.
    pub fn empty(format_tag: u32) -> TagTable {
        TagTable {
            volumes: Vec::new(),
            reserved: Vec::new(),
            next_serial: 1,
            next_sequence: 1,
            format_tag,
        }
    }

    pub fn volumes(&self) -> &[VolumeTags] {
        &self.volumes
    }

    pub fn volume(&self, id: u16) -> Option<&VolumeTags> {
        self.volumes.iter().find(|v| v.volume_id == id)
    }

    pub fn volume_mut(&mut self, id: u16) -> Option<&mut VolumeTags> {
        self.volumes.iter_mut().find(|v| v.volume_id == id)
    }

    pub fn dirty_pages(&self) -> u64 {
        self.volumes.iter().map(|v| v.dirty_pages()).sum()
    }

    pub fn memory_bytes(&self) -> usize {
        self.volumes.iter().map(|v| v.memory_bytes()).sum()
    }

    /// The tag of the block named by `key`, if its volume keeps tags.
    pub fn tag_of(&self, key: u64) -> Option<u32> {
        let v = self.volume(key_volume(key))?;
        let lba = key_lba(key);
        (lba < v.blocks()).then(|| v.get(lba))
    }

    /// Set the tag of a block whose volume keeps tags.
    pub fn set_key(&mut self, key: u64, tag: u32) {
        let v = self
            .volume_mut(key_volume(key))
            .expect("the block's volume keeps tags");
        v.set(key_lba(key), tag);
    }

    /// Write-back put these ranges, then these blocks (with their verified
    /// checksums), on the origin and flushed it: their tags follow, in that
    /// order. Blocks of volumes without tags are passed over.
    pub fn record_origin_writes(
        &mut self,
        ranges: &[(RangeKind, u64, u64)],
        blocks: &[(u64, u32)],
    ) {
        // A range never crosses volumes.
        for &(kind, key, count) in ranges {
            let Some(v) = self.volume_mut(key_volume(key)) else {
                continue;
            };
            let tag = match kind {
                RangeKind::Zero => cairn_format::TAG_ZERO,
                RangeKind::Discard => cairn_format::TAG_DISCARDED,
            };
            v.set_range(key_lba(key), count, tag);
        }
        for &(key, crc) in blocks {
            if let Some(v) = self.volume_mut(key_volume(key)) {
                v.set(key_lba(key), cairn_format::fold_tag(crc));
            }
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
        for (key, crc) in copies {
            let Some(tag) = self.tag_of(key) else {
                continue;
            };
            let expected = cairn_format::fold_tag(crc);
            let agrees = tag == expected
                || (tag == cairn_format::TAG_ZERO && block_checksum(key, &zeroes) == crc);
            if !agrees {
                self.set_key(key, expected);
                healed += 1;
            }
        }
        healed
    }

    /// Take on a volume whose tags are all unset, writing every page of its
    /// extent to each of `copies` first, then a barrier (format).
    pub fn add_fresh(
        &mut self,
        cache: &dyn Device,
        layout: &Layout,
        volume: VolumeTags,
        copies: &[u8],
        counters: &Counters,
    ) -> Result<(), DeviceError> {
        let stamp = self.stamp();
        write_fresh(cache, layout, &volume, copies, stamp, counters)?;
        self.insert_fresh(volume, copies[0]);
        Ok(())
    }

    /// What pages written now must carry: this table's next sequence and
    /// format tag.
    pub fn stamp(&self) -> TagStamp {
        TagStamp {
            sequence: self.next_sequence,
            format_tag: self.format_tag,
        }
    }

    /// Extents reserved by adds still writing them.
    pub fn reserved(&self) -> &[TagExtent] {
        &self.reserved
    }

    pub fn reserve(&mut self, extent: TagExtent) {
        assert!(self
            .reserved
            .iter()
            .all(|r| r.first_page != extent.first_page));
        self.reserved.push(extent);
    }

    pub fn unreserve(&mut self, first_page: u64) {
        self.reserved.retain(|r| r.first_page != first_page);
    }

    /// Take on a volume whose extent [`write_fresh`] wrote, newest in
    /// `copy`.
    pub fn insert_fresh(&mut self, mut volume: VolumeTags, copy: u8) {
        assert!(self.volume(volume.volume_id).is_none());
        volume.all_written_to(copy);
        volume.serial = self.next_serial;
        self.next_serial += 1;
        self.next_sequence += 1;
        let at = self
            .volumes
            .partition_point(|v| v.volume_id < volume.volume_id);
        self.volumes.insert(at, volume);
    }

    /// Forget a removed volume's tags (its pages are left as they are: an
    /// extent is written whole before it is used again).
    pub fn remove_volume(&mut self, id: u16) {
        self.volumes.retain(|v| v.volume_id != id);
    }

    fn encode_page(&self, volume: &VolumeTags, page: u64, out: &mut [u8]) {
        encode_page(self.stamp(), volume, page, out);
    }

    /// Load the tags of every volume the area gives an extent, picking the
    /// newest valid copy of each page. `blocks_of` and `recalc_of` give a
    /// volume's size in blocks and its recalculation position. Returns the
    /// table and, per volume, the first page whose both copies were
    /// unreadable, with how many were (their tags are unset and they are
    /// queued for rewriting; the caller moves that volume's recalculation
    /// position back so they are recomputed).
    pub fn load(
        cache: &dyn Device,
        layout: &Layout,
        area: &TagArea,
        format_tag: u32,
        blocks_of: impl Fn(u16) -> u64,
        recalc_of: impl Fn(u16) -> u64,
    ) -> Result<(TagTable, Vec<LostPages>), DeviceError> {
        let mut table = TagTable::empty(format_tag);
        let mut lost = Vec::new();
        let mut max_sequence = 0u64;
        for &extent in area.extents() {
            let blocks = blocks_of(extent.volume_id);
            let mut volume = VolumeTags::new_unset(extent, blocks);
            volume.recalc_pos = recalc_of(extent.volume_id).min(blocks);
            volume.serial = table.next_serial;
            table.next_serial += 1;
            let best = load_extent(cache, layout, &mut volume, format_tag, &mut max_sequence)?;
            let missing: Vec<u64> = (0..volume.pages())
                .filter(|&page| best[page as usize].is_none())
                .collect();
            for &page in &missing {
                volume.lose_page(page);
            }
            if let Some(&first_page) = missing.first() {
                lost.push(LostPages {
                    volume_id: extent.volume_id,
                    first_page,
                    count: missing.len() as u64,
                });
            }
            table.volumes.push(volume);
        }
        table.volumes.sort_by_key(|v| v.volume_id);
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
        if self.dirty_pages() == 0 {
            return Ok(());
        }
        let mut bufs: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut pending_bytes = 0usize;
        let mut written_total = 0u64;
        let dirty: Vec<Vec<u64>> = self.volumes.iter().map(|v| v.dirty_list()).collect();
        for (volume, pages) in self.volumes.iter().zip(&dirty) {
            for &page in pages {
                assert!(page < volume.pages());
                let global = volume.first_page + page;
                let at = layout.tag_page_offset_bytes(global, volume.target_copy(page));
                let mut out = vec![0u8; TAG_PAGE_BYTES];
                self.encode_page(volume, page, &mut out);
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
                written_total += 1;
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
        Counters::add(&counters.tag_pages_written, written_total);
        for (volume, pages) in self.volumes.iter_mut().zip(&dirty) {
            volume.written(pages);
        }
        self.next_sequence += 1;
        Ok(())
    }
}

/// The sequence and format tag a batch of page writes carries.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TagStamp {
    sequence: u64,
    format_tag: u32,
}

fn encode_page(stamp: TagStamp, volume: &VolumeTags, page: u64, out: &mut [u8]) {
    TagPage {
        page_index: volume.first_page + page,
        sequence: stamp.sequence,
        format_tag: stamp.format_tag,
        tags: volume.page_tags(page),
    }
    .encode_into(out);
}

/// Write every page of a fresh volume's extent (its tags, all unset) to
/// each of `copies`, then a barrier. Format writes copy 0 only: pages of an
/// earlier format carry another format tag and never count. A volume
/// added later writes both, since its extent may hold pages of a removed
/// volume with this format's tag. Needs no lock: nothing reads an extent
/// no table names.
pub(crate) fn write_fresh(
    cache: &dyn Device,
    layout: &Layout,
    volume: &VolumeTags,
    copies: &[u8],
    stamp: TagStamp,
    counters: &Counters,
) -> Result<(), DeviceError> {
    assert!(!copies.is_empty() && copies.iter().all(|&c| c < 2));
    let pages = volume.pages();
    let mut buf = vec![0u8; TAG_IO_CHUNK_BYTES];
    for &copy in copies {
        let mut page = 0u64;
        // Bounded: each round writes up to a chunk of the extent.
        while page < pages {
            let count = PAGES_PER_CHUNK.min(pages - page);
            for k in 0..count {
                let at = k as usize * TAG_PAGE_BYTES;
                encode_page(stamp, volume, page + k, &mut buf[at..at + TAG_PAGE_BYTES]);
            }
            let len = count as usize * TAG_PAGE_BYTES;
            let global = volume.first_page + page;
            cache.write_at(layout.tag_page_offset_bytes(global, copy), &buf[..len])?;
            Counters::add(&counters.tag_pages_written, count);
            Counters::add(&counters.cache_bytes_written, len as u64);
            page += count;
        }
    }
    cache.flush()?;
    Counters::add(&counters.cache_barriers, 1);
    Ok(())
}

/// Tag pages of one volume with no valid copy at open.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LostPages {
    pub volume_id: u16,
    /// The first such page of the volume's extent.
    pub first_page: u64,
    pub count: u64,
}

/// Read both copies of a volume's extent into `volume`, keeping the newest
/// valid copy of each page. Returns, per page of the extent, the sequence
/// and copy chosen (`None`: neither copy was valid).
fn load_extent(
    cache: &dyn Device,
    layout: &Layout,
    volume: &mut VolumeTags,
    format_tag: u32,
    max_sequence: &mut u64,
) -> Result<Vec<Option<(u64, u8)>>, DeviceError> {
    let pages = volume.pages();
    let mut best: Vec<Option<(u64, u8)>> = vec![None; pages as usize];
    let mut buf = vec![0u8; TAG_IO_CHUNK_BYTES];
    for copy in 0..2u8 {
        let mut page = 0u64;
        // Bounded: each round reads up to a chunk of the extent.
        while page < pages {
            let count = PAGES_PER_CHUNK.min(pages - page);
            let len = count as usize * TAG_PAGE_BYTES;
            let global = volume.first_page + page;
            cache.read_at(layout.tag_page_offset_bytes(global, copy), &mut buf[..len])?;
            for k in 0..count {
                let at = k as usize * TAG_PAGE_BYTES;
                let Ok(decoded) = TagPage::decode(&buf[at..at + TAG_PAGE_BYTES]) else {
                    continue;
                };
                // A sequence near the top of the range is damage (pages
                // count up from 1 by one per batch): such a copy is not
                // trusted, so the next sequence cannot overflow.
                if decoded.page_index != global + k
                    || decoded.format_tag != format_tag
                    || decoded.sequence >= TAG_SEQUENCE_LIMIT
                {
                    continue;
                }
                let index = page + k;
                let slot = &mut best[index as usize];
                if slot.is_none_or(|(seq, _)| decoded.sequence > seq) {
                    *slot = Some((decoded.sequence, copy));
                    *max_sequence = (*max_sequence).max(decoded.sequence);
                    volume.load_page(index, copy, &decoded.tags);
                }
            }
            page += count;
        }
    }
    Ok(best)
}

fn write_batch(cache: &dyn Device, bufs: &[(u64, Vec<u8>)]) -> Result<(), DeviceError> {
    let writes: Vec<(u64, &[u8])> = bufs.iter().map(|(at, b)| (*at, b.as_slice())).collect();
    cache.write_many(&writes)?;
    Ok(())
}
