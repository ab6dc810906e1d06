//! Hostile device contents: superblocks, checkpoints, record headers and
//! tag pages written with the format's own encoders, so every checksum is
//! right, but with claims the engine never makes. Opening, write-back and
//! checkpoints must answer each with an error (or by not trusting it),
//! never with a panic or an overflow.

mod common;

use std::sync::Arc;

use cairn_device::{Device, SimDevice};
use cairn_engine::{Engine, EngineError, FormatOptions};
use cairn_format::{
    block_checksum, crc32c, CheckpointHeader, Layout, RangeKind, RecordEntry, RecordHeader,
    Superblock, TagPage, RECORD_FLAG_EPOCH_END, SUPERBLOCK_OFFSETS, TAGS_PER_PAGE, TAG_DISCARDED,
};
use common::{cache_bytes_small, open, pattern, BS};

const VOLUME_BLOCKS: u64 = 4096;

/// A freshly formatted (never opened) cache: the checkpoint in slot 0 has
/// head 0 and expects record 1, whose `prev_crc` is the format tag.
struct Formatted {
    cache: SimDevice,
    origin: SimDevice,
    sb: Superblock,
    layout: Layout,
    format_tag: u32,
}

fn formatted_with(volume_blocks: u64, integrity: bool) -> Formatted {
    let cache = SimDevice::new("cache", cache_bytes_small());
    let origin = SimDevice::new("origin", volume_blocks * BS);
    let sb = Engine::format(
        Arc::new(cache.clone()),
        Arc::new(origin.clone()),
        &FormatOptions {
            integrity,
            ..FormatOptions::default()
        },
    )
    .expect("format");
    let layout = Layout::compute_with_tags(
        sb.cache_size_bytes,
        sb.block_size_bytes,
        integrity.then_some(volume_blocks),
    )
    .unwrap();
    assert_eq!(layout.log_blocks, sb.log_blocks);
    let format_tag = crc32c(&sb.uuid);
    Formatted {
        cache,
        origin,
        sb,
        layout,
        format_tag,
    }
}

fn formatted() -> Formatted {
    formatted_with(VOLUME_BLOCKS, false)
}

impl Formatted {
    fn write(&self, at: u64, bytes: &[u8]) {
        self.cache.write_at(at, bytes).unwrap();
        self.cache.flush().unwrap();
    }

    /// Replace the superblock (both copies, valid checksums). Each
    /// volume's write-back position is raised to the cache's, as the engine
    /// keeps them (a volume behind the cache's position is refused at
    /// decode, before any of the checks these tests aim at).
    fn write_superblock(&self, sb: &Superblock) {
        let mut sb = sb.clone();
        sb.sequence = 10;
        if let cairn_format::SuperblockVolumes::V2 { positions, .. } = &mut sb.volumes {
            for p in positions {
                p.writeback_offset = p.writeback_offset.max(sb.writeback_offset);
            }
        }
        for at in SUPERBLOCK_OFFSETS {
            self.write(at, &sb.encode());
        }
    }

    /// Replace the first volume's entry in the table the superblock names
    /// (a valid checksum): what a bug or a forger could leave.
    fn change_volume(&self, change: impl FnOnce(&mut cairn_format::VolumeEntry)) {
        let table = Engine::read_volume_table(&self.cache).expect("the volume table");
        let mut volumes = table.volumes().to_vec();
        change(&mut volumes[0]);
        let table = table.with_volumes(volumes).expect("a valid table");
        let copy = cairn_format::VolumeTable::copy_for(table.sequence);
        self.write(cairn_format::VOLUME_TABLE_OFFSETS[copy], &table.encode());
    }

    /// The empty checkpoint format writes, for tests to change.
    fn empty_checkpoint(&self) -> CheckpointHeader {
        CheckpointHeader {
            sequence: self.sb.checkpoint_sequence,
            generation: self.sb.generation,
            head_offset: 0,
            next_record_sequence: 1,
            prev_crc: self.format_tag,
            tail_offset: 0,
            writeback_offset: 0,
            durable_sequence: 0,
            entry_count: 0,
            range_count: 0,
            payload_crc: crc32c(&[]),
            lost_count: 0,
        }
    }

    fn write_checkpoint(&self, header: &CheckpointHeader) {
        let slot = self.sb.active_checkpoint;
        self.write(self.layout.checkpoint_offset_bytes(slot), &header.encode());
    }

    /// A durable record at logical offset `at` with `entries` (its data
    /// blocks carry correct checksums); returns its header crc.
    fn write_record(
        &self,
        at: u64,
        sequence: u64,
        prev_crc: u32,
        entries: Vec<RecordEntry>,
        epoch_end: bool,
    ) -> u32 {
        let slot_count = self.layout.log_blocks;
        let mut data_blocks = Vec::new();
        let entries: Vec<RecordEntry> = entries
            .into_iter()
            .map(|e| match e {
                RecordEntry::Data { lba, clean, .. } => {
                    let block = pattern(lba + 1, BS as usize);
                    let crc = block_checksum(lba, &block);
                    data_blocks.push(block);
                    RecordEntry::Data { lba, crc, clean }
                }
                other => other,
            })
            .collect();
        let header = RecordHeader {
            sequence,
            log_offset: at,
            generation: self.sb.generation,
            durable_sequence: sequence,
            prev_crc,
            format_tag: self.format_tag,
            flags: if epoch_end { RECORD_FLAG_EPOCH_END } else { 0 },
            entries,
        };
        let (buf, crc) = header.encode(BS as u32);
        self.write(self.layout.slot_offset_bytes(at % slot_count), &buf);
        for (k, block) in data_blocks.iter().enumerate() {
            // Blocks past the end of the log area are not written (a
            // record that claims to run past the lap end).
            let slot = at % slot_count + 1 + k as u64;
            if slot < slot_count {
                self.write(self.layout.slot_offset_bytes(slot), block);
            }
        }
        crc
    }

    fn open(&self) -> Result<Engine, EngineError> {
        open(&self.cache, &self.origin)
    }
}

fn data_entries(first_lba: u64, count: u64) -> Vec<RecordEntry> {
    (first_lba..first_lba + count)
        .map(|lba| RecordEntry::Data {
            lba,
            crc: 0,
            clean: false,
        })
        .collect()
}

/// The detail of a LogDamaged error, or a panic naming what came instead.
fn log_damaged(result: Result<impl Sized, EngineError>, what: &str) -> String {
    match result {
        Err(EngineError::LogDamaged { detail, .. }) => detail,
        Err(other) => panic!("{what}: expected LogDamaged, got {other}"),
        Ok(_) => panic!("{what}: expected LogDamaged, got success"),
    }
}

fn checkpoint_damaged(result: Result<Engine, EngineError>, what: &str) -> String {
    match result {
        Err(EngineError::CheckpointDamaged { detail, .. }) => detail,
        Err(other) => panic!("{what}: expected CheckpointDamaged, got {other}"),
        Ok(_) => panic!("{what}: expected CheckpointDamaged, got success"),
    }
}

/// Open, and if that succeeds, run write-back and a checkpoint over what
/// was replayed: every one of them must fail cleanly (before the fix,
/// opening succeeded and write-back panicked).
fn open_then_writeback(f: &Formatted) -> Result<(), EngineError> {
    let engine = f.open()?;
    engine.drain()?;
    engine.checkpoint()?;
    Ok(())
}

#[test]
fn record_with_more_data_blocks_than_a_record_holds_is_damage() {
    // 100 data blocks: the header has room for them (252 entries at 4 KiB),
    // but a record holds at most 64 (256 KiB). Before the fix, replay took
    // it and write-back panicked sizing its buffer ("record buffer
    // overflow: 409600 > 262144").
    let f = formatted();
    let seed = f.format_tag;
    f.write_record(0, 1, seed, data_entries(0, 100), true);
    let detail = log_damaged(
        open_then_writeback(&f),
        "oversized record after the checkpoint",
    );
    assert!(
        detail.contains("100 data blocks, more than the 64"),
        "{detail}"
    );
}

#[test]
fn record_running_past_the_end_of_the_lap_is_damage() {
    // Records never wrap; one that starts 3 slots before the end of the
    // log and claims 10 data blocks would be read past the log area.
    let f = formatted();
    let slot_count = f.layout.log_blocks;
    let head = slot_count - 3;
    let mut checkpoint = f.empty_checkpoint();
    checkpoint.head_offset = head;
    checkpoint.tail_offset = head;
    checkpoint.writeback_offset = head;
    f.write_checkpoint(&checkpoint);
    f.write_record(head, 1, f.format_tag, data_entries(0, 10), true);
    let detail = log_damaged(open_then_writeback(&f), "record across the lap end");
    assert!(detail.contains("run past the end of the"), "{detail}");
}

#[test]
fn record_addressing_blocks_past_the_volume_is_damage() {
    let f = formatted();
    f.write_record(
        0,
        1,
        f.format_tag,
        vec![RecordEntry::Range {
            kind: RangeKind::Zero,
            lba: VOLUME_BLOCKS - 2,
            block_count: 5,
        }],
        true,
    );
    let detail = log_damaged(open_then_writeback(&f), "range past the volume");
    assert!(
        detail.contains("past the end of the 4096-block volume"),
        "{detail}"
    );
}

/// Records before the checkpoint's head are not replayed, only read by
/// write-back (from the persisted write-back position): their headers are
/// checked there too.
#[test]
fn oversized_record_before_the_checkpoint_head_fails_writeback_cleanly() {
    let f = formatted();
    let crc = f.write_record(0, 1, f.format_tag, data_entries(0, 100), true);
    let mut checkpoint = f.empty_checkpoint();
    checkpoint.head_offset = 101;
    checkpoint.next_record_sequence = 2;
    checkpoint.prev_crc = crc;
    checkpoint.durable_sequence = 1;
    f.write_checkpoint(&checkpoint);
    // Opening is fine (nothing there is replayed); write-back refuses.
    let engine = f.open().expect("open");
    let detail = log_damaged(engine.drain(), "write-back of an oversized old record");
    assert!(detail.contains("100 data blocks"), "{detail}");
}

#[test]
fn record_running_past_its_write_back_group_fails_writeback_cleanly() {
    // The checkpoint's head (the end of write-back's group) falls inside
    // the record at the write-back position: before the fix, the assert
    // "write-back walked past its limit".
    let f = formatted();
    let crc = f.write_record(0, 1, f.format_tag, data_entries(0, 10), true);
    let mut checkpoint = f.empty_checkpoint();
    checkpoint.head_offset = 5;
    checkpoint.next_record_sequence = 2;
    checkpoint.prev_crc = crc;
    checkpoint.durable_sequence = 1;
    f.write_checkpoint(&checkpoint);
    let engine = f.open().expect("open");
    let detail = log_damaged(engine.drain(), "record past its group");
    assert!(
        detail.contains("past the end of its group at 5"),
        "{detail}"
    );
}

/// `count` disjoint one-block zero ranges, written as header-only records
/// of 250 ranges each.
fn write_zero_ranges(f: &Formatted, count: u64) {
    let ranges: Vec<RecordEntry> = (0..count)
        .map(|k| RecordEntry::Range {
            kind: RangeKind::Zero,
            lba: 2 * k,
            block_count: 1,
        })
        .collect();
    let mut prev = f.format_tag;
    for (i, chunk) in ranges.chunks(250).enumerate() {
        let last = (i + 1) * 250 >= ranges.len();
        prev = f.write_record(i as u64, i as u64 + 1, prev, chunk.to_vec(), last);
    }
}

#[test]
fn more_pending_ranges_than_a_checkpoint_holds_is_damage() {
    // 1100 disjoint zero ranges over five header-only records: the engine
    // never lets more than 1024 wait. Before the fix the next checkpoint
    // asserted on the count.
    let f = formatted();
    write_zero_ranges(&f, 1100);
    let engine = f.open();
    let detail = match engine {
        Ok(engine) => {
            // Only a checkpoint (not write-back first) shows the old bug.
            log_damaged(engine.checkpoint(), "checkpoint of too many ranges")
        }
        Err(e) => log_damaged(Err::<(), _>(e), "too many ranges"),
    };
    assert!(detail.contains("1100 zero/discard ranges"), "{detail}");
}

#[test]
fn exactly_as_many_pending_ranges_as_a_checkpoint_holds_is_not_damage() {
    // The positive side of the bound above: 1024 ranges are what the
    // engine may leave waiting, so they open, checkpoint and read back.
    let f = formatted();
    write_zero_ranges(&f, cairn_format::PENDING_RANGES_MAX as u64);
    let engine = f.open().expect("1024 pending ranges are a valid log");
    engine.checkpoint().expect("a checkpoint holds 1024 ranges");
    let mut block = vec![0xffu8; 4096];
    engine
        .read(2 * 1023 * 4096, &mut block)
        .expect("read a zeroed block");
    assert!(
        block.iter().all(|&b| b == 0),
        "the last range reads as zeroes"
    );
}

#[test]
fn a_write_back_position_inside_a_record_is_damage() {
    // Two records, at 0 (4 data blocks: slots 0-4) and at 5 (2: 5-7), a
    // checkpoint whose head is past both, and a superblock whose
    // write-back position (persisted after that checkpoint) is 2: a data
    // block of the first record, where no record starts. Write-back would
    // start in the middle of a record; recovery must call it damage. The
    // same log with the position on the second record's header, or at the
    // head, opens.
    let setup = |writeback_offset: u64| {
        let f = formatted();
        let prev = f.write_record(0, 1, f.format_tag, data_entries(0, 4), true);
        f.write_record(5, 2, prev, data_entries(10, 2), true);
        let mut checkpoint = f.empty_checkpoint();
        checkpoint.head_offset = 8;
        checkpoint.next_record_sequence = 3;
        f.write_checkpoint(&checkpoint);
        let mut sb = f.sb.clone();
        sb.writeback_offset = writeback_offset;
        f.write_superblock(&sb);
        f
    };
    let detail = log_damaged(setup(2).open(), "write-back position inside a record");
    assert!(
        detail.contains("no record at the write-back position 2"),
        "{detail}"
    );
    setup(5)
        .open()
        .expect("a write-back position on a record's header is valid");
    // Everything written back: the position is the head, where no record
    // is yet, and that is valid too.
    setup(8)
        .open()
        .expect("a write-back position at the head is valid");
}

type CheckpointDamage = fn(&mut CheckpointHeader);
type SuperblockDamage = fn(&mut Superblock);

#[test]
fn checkpoint_counts_and_positions_out_of_range_are_refused() {
    let cases: [(&str, CheckpointDamage, &str); 5] = [
        (
            "entry count whose payload size overflows",
            |c| c.entry_count = u64::MAX / 8,
            "counts or offsets out of range",
        ),
        (
            "lost count larger than the slot",
            |c| c.lost_count = u32::MAX,
            "does not fit the",
        ),
        (
            "next record sequence 0",
            |c| c.next_record_sequence = 0,
            "next record sequence 0",
        ),
        (
            "head offset near u64::MAX",
            |c| {
                c.head_offset = u64::MAX - 10;
                c.tail_offset = c.head_offset;
                c.writeback_offset = c.head_offset;
            },
            "head offset 18446744073709551605",
        ),
        (
            "next record sequence near u64::MAX",
            |c| c.next_record_sequence = u64::MAX,
            "log position out of range",
        ),
    ];
    for (what, damage, needle) in cases {
        let f = formatted();
        let mut checkpoint = f.empty_checkpoint();
        damage(&mut checkpoint);
        f.write_checkpoint(&checkpoint);
        let detail = checkpoint_damaged(f.open(), what);
        assert!(detail.contains(needle), "{what}: {detail}");
    }
}

#[test]
fn superblock_counters_out_of_range_are_refused() {
    let fields: [(&str, SuperblockDamage); 3] = [
        ("generation", |sb| sb.generation = u64::MAX),
        ("checkpoint_sequence", |sb| {
            sb.checkpoint_sequence = u64::MAX
        }),
        ("writeback_offset", |sb| sb.writeback_offset = 1 << 63),
    ];
    for (field, damage) in fields {
        let f = formatted();
        let mut sb = f.sb.clone();
        damage(&mut sb);
        f.write_superblock(&sb);
        match f.open() {
            Err(EngineError::SuperblockInvalid { detail, .. }) => {
                assert!(detail.starts_with(field), "{field}: {detail}");
            }
            Err(other) => panic!("{field}: expected SuperblockInvalid, got {other}"),
            Ok(_) => panic!("{field}: expected SuperblockInvalid, got success"),
        }
    }
    // A superblock sequence near the top is refused the same way.
    let f = formatted();
    let mut sb = f.sb.clone();
    sb.sequence = u64::MAX - 1;
    for at in SUPERBLOCK_OFFSETS {
        f.write(at, &sb.encode());
    }
    assert!(matches!(
        f.open(),
        Err(EngineError::SuperblockInvalid { .. })
    ));
}

#[test]
fn large_records_claimed_over_a_log_too_small_for_them_are_refused() {
    // format gives the smallest caches 256 KiB records; a superblock that
    // claims 1 MiB records over such a log would let write-back and
    // eviction wait for room that never comes.
    let f = formatted();
    assert_eq!(f.sb.features & cairn_format::FEATURE_LARGE_RECORDS, 0);
    assert!(!f.layout.holds_large_records());
    let mut sb = f.sb.clone();
    sb.features |= cairn_format::FEATURE_LARGE_RECORDS;
    f.write_superblock(&sb);
    match f.open() {
        Err(EngineError::SuperblockInvalid { detail, .. }) => {
            assert!(detail.contains("too small for them"), "{detail}");
        }
        Err(other) => panic!("expected SuperblockInvalid, got {other}"),
        Ok(_) => panic!("expected SuperblockInvalid, got success"),
    }
}

#[test]
fn superblock_with_an_unaligned_origin_size_is_refused() {
    // format never accepts an origin that is not a whole number of blocks;
    // a superblock that records one (and an origin of that size) is
    // refused at open the same way.
    let f = formatted();
    let odd_bytes = VOLUME_BLOCKS * BS + 512;
    f.change_volume(|v| v.origin_size_bytes = odd_bytes);
    let origin = SimDevice::new("origin", odd_bytes);
    match open(&f.cache, &origin) {
        Err(EngineError::OriginSizeUnaligned { size_bytes, .. }) => {
            assert_eq!(size_bytes, odd_bytes)
        }
        Err(other) => panic!("expected OriginSizeUnaligned, got {other}"),
        Ok(_) => panic!("expected OriginSizeUnaligned, got success"),
    }
}

#[test]
fn tag_page_with_a_sequence_near_the_top_is_not_trusted() {
    // Copy 1 of tag page 0 claims sequence u64::MAX (the next sequence
    // would overflow) and says every block of the page was discarded. It
    // is ignored: copy 0 (all unset, from format) stands, so origin data
    // is served (unverified) instead of zeroes.
    let f = formatted_with(VOLUME_BLOCKS, true);
    let hostile = TagPage {
        page_index: 0,
        sequence: u64::MAX,
        format_tag: f.format_tag,
        tags: vec![TAG_DISCARDED; TAGS_PER_PAGE],
    };
    let mut buf = vec![0u8; cairn_format::TAG_PAGE_BYTES];
    hostile.encode_into(&mut buf);
    f.write(f.layout.tag_page_offset_bytes(0, 1), &buf);
    let data = pattern(77, BS as usize);
    f.origin.write_at(5 * BS, &data).unwrap();
    f.origin.flush().unwrap();
    let engine = f.open().expect("open");
    let mut read = vec![0u8; BS as usize];
    engine.read(5 * BS, &mut read).unwrap();
    assert!(
        read == data,
        "block 5 read the hostile page's DISCARDED tag"
    );
    // The table keeps working: a write, write-back (tags follow) and a
    // clean close and reopen.
    engine
        .write(5 * BS, &pattern(78, BS as usize), true)
        .unwrap();
    engine.drain().unwrap();
    engine.close().unwrap();
    drop(engine);
    let engine = f.open().expect("reopen");
    engine.read(5 * BS, &mut read).unwrap();
    assert!(read == pattern(78, BS as usize));
}

#[test]
fn origin_identity_longer_than_the_superblock_holds_is_cut_not_a_panic() {
    // The identity is "sim:x" and 300 two-byte characters: byte 512 falls
    // inside one, where `String::truncate` used to panic (format, and open
    // with --force-origin). A path or URI is the user's choice.
    let name = format!("x{}", "é".repeat(300));
    let cache = SimDevice::new("cache", cache_bytes_small());
    let origin = SimDevice::new(&name, VOLUME_BLOCKS * BS);
    Engine::format(
        Arc::new(cache.clone()),
        Arc::new(origin.clone()),
        &FormatOptions::default(),
    )
    .expect("format");
    let volume = Engine::read_volume_table(&cache)
        .expect("the volume table")
        .volumes()[0]
        .clone();
    assert_eq!(volume.origin_identity.len(), 511);
    assert!(format!("sim:{name}").starts_with(&volume.origin_identity));
    // The same origin opens again without forcing (the stored identity is
    // compared as stored), and writes and a clean close work.
    let engine = open(&cache, &origin).expect("reopen with the same origin");
    engine.write(0, &pattern(5, BS as usize), true).unwrap();
    engine.close().unwrap();
    drop(engine);
    // Another origin is still refused.
    let other = SimDevice::new("other", VOLUME_BLOCKS * BS);
    assert!(matches!(
        open(&cache, &other),
        Err(EngineError::WrongOrigin { .. })
    ));
}
