//! Recovery: newest checkpoint + replay of the log after it.
//!
//! Replay follows the record chain (sequence, logical offset and the crc of
//! the previous header must all match). Where the chain ends, recovery looks
//! a bounded distance further for any record that proves the missing one
//! had been made durable; if one exists, the log is damaged and opening is
//! refused rather than silently serving older data.

use cairn_format::{
    block_checksum, CheckpointEntry, CheckpointHeader, PendingRange, Reader, RecordEntry,
    RecordHeader, Superblock, CHECKPOINT_HEADER_BYTES, RECORD_MAGIC,
};

use crate::engine::{Env, Inner};
use crate::error::{EngineError, EngineResult};
use crate::index::{remove_mapping, state, ForwardMap, SlotTable};
use crate::ranges::RangeMap;

/// Where a record that should start at `pos` actually starts: records never
/// wrap, so one that would start in the last slot of a lap starts the next.
pub(crate) fn place(pos: u64, n: u64) -> u64 {
    if pos % n + 2 > n {
        pos.div_ceil(n) * n
    } else {
        pos
    }
}

/// Read and decode the record header expected at `pos`. `None` if the block
/// there is not a valid header for that logical offset.
pub(crate) fn read_record_header(
    env: &Env,
    pos: u64,
    n: u64,
) -> EngineResult<Option<(u64, RecordHeader)>> {
    let at = place(pos, n);
    let mut buf = vec![0u8; env.bs];
    env.cache
        .read_at(env.layout.slot_offset_bytes(at % n), &mut buf)
        .map_err(EngineError::Cache)?;
    match RecordHeader::decode(&buf, env.bs as u32) {
        Ok((h, _)) if h.log_offset == at && h.format_tag == env.format_tag => Ok(Some((at, h))),
        _ => Ok(None),
    }
}

struct Replayed {
    at: u64,
    header: RecordHeader,
    /// Per data block: did it match its checksum?
    valid: Vec<bool>,
}

fn damaged(env: &Env, detail: String) -> EngineError {
    EngineError::CheckpointDamaged {
        device: env.cache.name().to_string(),
        detail,
    }
}

fn log_damaged(env: &Env, detail: String) -> EngineError {
    EngineError::LogDamaged {
        device: env.cache.name().to_string(),
        detail,
    }
}

pub(crate) fn recover(env: &Env, sb: Superblock) -> EngineResult<Inner> {
    let n = env.layout.log_blocks;
    let bs = env.bs;
    // ---- checkpoint
    let ckpt_at = env.layout.checkpoint_offset_bytes(sb.active_checkpoint);
    let mut hbuf = vec![0u8; CHECKPOINT_HEADER_BYTES];
    env.cache
        .read_at(ckpt_at, &mut hbuf)
        .map_err(EngineError::Cache)?;
    let ckpt = CheckpointHeader::decode(&hbuf).map_err(|e| damaged(env, format!("header: {e}")))?;
    if ckpt.sequence != sb.checkpoint_sequence {
        return Err(damaged(
            env,
            format!(
                "slot {} holds checkpoint {}, superblock expects {}",
                sb.active_checkpoint, ckpt.sequence, sb.checkpoint_sequence
            ),
        ));
    }
    let payload_len = CheckpointHeader::payload_bytes(ckpt.entry_count, ckpt.range_count);
    if ckpt.entry_count > n
        || ckpt.range_count as usize > cairn_format::PENDING_RANGES_MAX
        || CHECKPOINT_HEADER_BYTES as u64 + payload_len > env.layout.checkpoint_slot_bytes
        || ckpt.tail_offset > ckpt.head_offset
        || ckpt.writeback_offset > ckpt.head_offset
        || ckpt.tail_offset > ckpt.writeback_offset
    {
        return Err(damaged(env, "counts or offsets out of range".into()));
    }
    let mut payload = vec![0u8; payload_len as usize];
    if payload_len > 0 {
        env.cache
            .read_at(ckpt_at + CHECKPOINT_HEADER_BYTES as u64, &mut payload)
            .map_err(EngineError::Cache)?;
    }
    let crc = cairn_format::crc32c(&payload);
    if crc != ckpt.payload_crc {
        return Err(damaged(
            env,
            format!("payload checksum {crc:#x} != {:#x}", ckpt.payload_crc),
        ));
    }
    let mut slots = SlotTable::new(n as usize);
    let mut map = ForwardMap::new(n as usize);
    let mut ranges = RangeMap::default();
    {
        let mut r = Reader::new(&payload);
        for _ in 0..ckpt.entry_count {
            let e = CheckpointEntry::decode(&mut r).map_err(|e| damaged(env, e.to_string()))?;
            if e.slot as u64 >= n || e.lba >= env.volume_blocks || slots.is_live(e.slot) {
                return Err(damaged(env, format!("bad entry {e:?}")));
            }
            slots.set(
                e.slot,
                e.lba,
                e.crc,
                (e.state & state::PERSISTED) | state::LIVE,
            );
            if map.insert(e.lba, e.slot, &slots).is_some() {
                return Err(damaged(env, format!("block {} mapped twice", e.lba)));
            }
        }
        for _ in 0..ckpt.range_count {
            let p = PendingRange::decode(&mut r).map_err(|e| damaged(env, e.to_string()))?;
            if p.start_lba + p.block_count > env.volume_blocks {
                return Err(damaged(env, format!("bad range {p:?}")));
            }
            ranges.insert_pending(&p);
        }
    }

    // ---- replay
    let mut replayed: Vec<Replayed> = Vec::new();
    let mut pos = ckpt.head_offset;
    let mut expected_seq = ckpt.next_record_sequence;
    let mut expected_prev = ckpt.prev_crc;
    let replay_limit = ckpt.head_offset + n;
    for _ in 0..n {
        let at = place(pos, n);
        if at + 2 > replay_limit {
            break;
        }
        let mut buf = vec![0u8; bs];
        env.cache
            .read_at(env.layout.slot_offset_bytes(at % n), &mut buf)
            .map_err(EngineError::Cache)?;
        let Ok((header, hcrc)) = RecordHeader::decode(&buf, bs as u32) else {
            break;
        };
        if header.log_offset != at
            || header.format_tag != env.format_tag
            || header.sequence != expected_seq
            || header.prev_crc != expected_prev
            || header.generation > sb.generation
            || at + header.length_blocks() > replay_limit
        {
            break;
        }
        let data_count = header.data_count();
        for entry in &header.entries {
            let (lba, count) = match *entry {
                RecordEntry::Data { lba, .. } => (lba, 1),
                RecordEntry::Range {
                    lba, block_count, ..
                } => (lba, block_count as u64),
            };
            if lba + count > env.volume_blocks {
                return Err(log_damaged(
                    env,
                    format!(
                        "record {} addresses blocks past the end of the volume",
                        header.sequence
                    ),
                ));
            }
        }
        // Data is verified below, and only where it can be torn.
        let valid = vec![true; data_count];
        pos = at + header.length_blocks();
        expected_seq += 1;
        expected_prev = hcrc;
        replayed.push(Replayed { at, header, valid });
    }
    scan_for_lost_records(env, pos, expected_seq, replay_limit)?;

    // Records up to `durable` were covered by a completed barrier: a bad
    // block there is corruption (EIO), not a torn write (old value).
    let durable = replayed
        .iter()
        .map(|r| r.header.durable_sequence)
        .chain(std::iter::once(ckpt.next_record_sequence - 1))
        .chain(std::iter::once(ckpt.durable_sequence))
        .max()
        .unwrap_or(0);

    // Only records no barrier covered can be torn: verify their data now.
    // Durable records are not re-read (a whole log of them would make
    // recovery read the whole cache); every later read and write-back of
    // their blocks verifies checksums anyway.
    for rec in replayed.iter_mut().filter(|r| r.header.sequence > durable) {
        let data_count = rec.header.data_count();
        if data_count == 0 {
            continue;
        }
        let mut data = vec![0u8; data_count * bs];
        env.cache
            .read_at(env.layout.slot_offset_bytes((rec.at + 1) % n), &mut data)
            .map_err(EngineError::Cache)?;
        let mut k = 0;
        for entry in &rec.header.entries {
            if let RecordEntry::Data { lba, crc, .. } = *entry {
                rec.valid[k] = block_checksum(lba, &data[k * bs..(k + 1) * bs]) == crc;
                k += 1;
            }
        }
    }

    let mut lost = std::collections::BTreeSet::new();
    let mut wb_limit = ckpt.head_offset;
    let mut cursor = ckpt.head_offset;
    let mut generation_max = sb.generation.max(ckpt.generation);
    let drop_slot = |slots: &mut SlotTable, map: &mut ForwardMap, slot: u32| {
        if slots.is_live(slot) {
            let lba = slots.lba(slot);
            remove_mapping(map, slots, lba, slot);
        }
        slots.clear(slot);
    };
    for rec in &replayed {
        generation_max = generation_max.max(rec.header.generation);
        // Every slot this record (and any lap skip before it) reuses held
        // older data: forget it.
        for logical in cursor..rec.at + rec.header.length_blocks() {
            drop_slot(&mut slots, &mut map, (logical % n) as u32);
        }
        cursor = rec.at + rec.header.length_blocks();
        let mut k = 0usize;
        for entry in &rec.header.entries {
            match *entry {
                RecordEntry::Data { lba, crc, clean } => {
                    let slot = ((rec.at + 1 + k as u64) % n) as u32;
                    let ok = rec.valid[k];
                    k += 1;
                    let mut st = if clean {
                        state::LIVE | state::CLEAN_INSERT
                    } else {
                        state::LIVE
                    };
                    if !ok {
                        if rec.header.sequence > durable {
                            // Torn, never acknowledged as durable: the
                            // previous value stands.
                            continue;
                        }
                        tracing::error!(
                            lba,
                            seq = rec.header.sequence,
                            "acknowledged block failed its checksum at recovery"
                        );
                        if clean {
                            if let Some(old) = map.get(lba, &slots) {
                                drop_slot(&mut slots, &mut map, old);
                            }
                            continue;
                        }
                        st |= state::CORRUPT;
                    }
                    if let Some(old) = map.get(lba, &slots) {
                        drop_slot(&mut slots, &mut map, old);
                    }
                    lost.remove(&lba);
                    slots.set(slot, lba, crc, st);
                    map.insert(lba, slot, &slots);
                }
                RecordEntry::Range {
                    kind,
                    lba,
                    block_count,
                } => {
                    let end = lba + block_count as u64;
                    if block_count <= 65536 {
                        for l in lba..end {
                            if let Some(old) = map.get(l, &slots) {
                                drop_slot(&mut slots, &mut map, old);
                            }
                        }
                    } else {
                        for slot in 0..n as u32 {
                            let l = slots.lba(slot);
                            if slots.is_live(slot) && l >= lba && l < end {
                                drop_slot(&mut slots, &mut map, slot);
                            }
                        }
                    }
                    let gone: Vec<u64> = lost.range(lba..end).copied().collect();
                    for l in gone {
                        lost.remove(&l);
                    }
                    ranges.insert(lba, end, rec.at, kind);
                }
            }
        }
        if rec.header.epoch_end() {
            wb_limit = cursor;
        }
    }
    let head = cursor.max(ckpt.head_offset);
    let wb = ckpt.writeback_offset.max(sb.writeback_offset);
    if wb > wb_limit {
        return Err(log_damaged(
            env,
            format!("write-back reached offset {wb}, but the log only replays to {wb_limit}"),
        ));
    }
    if wb < ckpt.head_offset && wb != ckpt.writeback_offset {
        match read_record_header(env, wb, n)? {
            Some((at, _)) if at == place(wb, n) => {}
            _ => {
                return Err(log_damaged(
                    env,
                    format!("no record at the write-back position {wb}"),
                ))
            }
        }
    }
    if wb > ckpt.head_offset
        && !replayed
            .iter()
            .any(|r| r.at + r.header.length_blocks() == wb)
    {
        return Err(log_damaged(
            env,
            format!("write-back position {wb} is not a record boundary"),
        ));
    }
    let tail = ckpt.tail_offset.max(head.saturating_sub(n));
    if tail > wb {
        return Err(log_damaged(
            env,
            format!("the log wrapped over dirty data (tail {tail} > write-back {wb})"),
        ));
    }
    let sb_generation = generation_max;
    let mut inner = Inner {
        sb,
        slots,
        map,
        n,
        tail,
        wb,
        wb_persisted: wb,
        wb_limit,
        head,
        ckpt_head: ckpt.head_offset,
        next_seq: expected_seq,
        prev_crc: expected_prev,
        durable_seq: durable,
        unsynced_blocks: 0,
        epoch_open: head > wb_limit,
        open: None,
        sealed: std::collections::VecDeque::new(),
        ranges,
        dirty_blocks: 0,
        clean_blocks: 0,
        corrupt_blocks: 0,
        lost,
        mutations: 0,
        failed: None,
        tags: None,
        degrade_pending: None,
        degraded: false,
    };
    inner.sb.generation = sb_generation;
    // Gauges, and the invariant that every live slot lies in [tail, head).
    for slot in 0..n as u32 {
        if !inner.slots.is_live(slot) {
            continue;
        }
        let logical = inner.logical_of(slot);
        if logical >= head {
            return Err(log_damaged(
                env,
                format!("live slot {slot} lies outside the log"),
            ));
        }
        if inner.slots.state(slot) & state::CORRUPT != 0 {
            inner.corrupt_blocks += 1;
        }
        if inner.slot_is_dirty(slot) {
            inner.dirty_blocks += 1;
        } else {
            inner.clean_blocks += 1;
        }
    }
    tracing::info!(
        records = replayed.len(),
        dirty_blocks = inner.dirty_blocks,
        clean_blocks = inner.clean_blocks,
        "cache recovered"
    );
    Ok(inner)
}

/// After the chain ends at `pos`, look for a record that claims the missing
/// sequence was durable. Such a record can only be a bounded distance
/// ahead: the engine never lets more than `unsynced_blocks_max` blocks wait
/// for a barrier.
fn scan_for_lost_records(env: &Env, pos: u64, expected_seq: u64, limit: u64) -> EngineResult<()> {
    let n = env.layout.log_blocks;
    let bs = env.bs;
    let window = env.config.unsynced_blocks_max + 4 * (env.record_data_max + 1);
    let end = (pos + window).min(limit);
    const CHUNK_BLOCKS: u64 = 256;
    let mut at = pos;
    let mut buf = vec![0u8; CHUNK_BLOCKS as usize * bs];
    while at < end {
        // Read up to the end of the lap or the window, whichever is first.
        let count = CHUNK_BLOCKS.min(end - at).min(n - at % n);
        let chunk = &mut buf[..count as usize * bs];
        env.cache
            .read_at(env.layout.slot_offset_bytes(at % n), chunk)
            .map_err(EngineError::Cache)?;
        for k in 0..count {
            let block = &chunk[k as usize * bs..(k as usize + 1) * bs];
            if block[..8] != RECORD_MAGIC.to_le_bytes() {
                continue;
            }
            if let Ok((h, _)) = RecordHeader::decode(block, bs as u32) {
                if h.log_offset == at + k
                    && h.format_tag == env.format_tag
                    && h.durable_sequence >= expected_seq
                {
                    return Err(log_damaged(
                        env,
                        format!(
                            "record {expected_seq} near log offset {pos} is unreadable, but record {} at offset {} shows it had been made durable",
                            h.sequence,
                            at + k
                        ),
                    ));
                }
            }
        }
        at += count;
    }
    Ok(())
}
