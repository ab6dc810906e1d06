//! Epoch groups: the records from the write-back position up to and
//! including the next record sealed by a flush. Write-back reads one from
//! the log, copies its final state to the origin (verified, sorted and
//! merged by address, then one origin flush) and commits it.

mod applied;
mod group_record;

pub(crate) use applied::Applied;
pub(crate) use group_record::GroupRecord;

use std::collections::BTreeMap;

use cairn_format::{block_checksum, key_lba, key_volume, RangeKind, RecordEntry};

use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::log::read_record_header;
use crate::retry::retrying_cache_read;
use crate::state::State;
use crate::stats::Counters;
use crate::volume_set::VolumeSet;

/// Runs of a group for one origin: each an offset and the buffers that go
/// back to back from it.
type OriginRuns<'a> = [(u64, &'a [&'a [u8]])];

/// Largest write-back write to the origin: consecutive blocks are merged
/// up to this.
const RUN_BYTES_MAX: usize = 1 << 20;

/// A pooled buffer of `len` bytes to be read into in place. Its bytes are
/// whatever the buffer held: the caller overwrites all of them.
fn data_for_read(env: &Env, len: usize) -> cairn_device::PooledBuf {
    let mut data = env.record_bufs.lend_full();
    data.set_len(len);
    data
}

/// A group record whose data is copied from memory (degraded mode's
/// records that may never have reached the cache).
pub(crate) fn record_from_memory(
    env: &Env,
    at: u64,
    header: cairn_format::RecordHeader,
    data: &[u8],
) -> GroupRecord {
    let mut copy = env.record_bufs.lend(data.len());
    copy.extend_from_slice(data);
    GroupRecord {
        at,
        header,
        data: copy,
    }
}

/// Read the records from `start` to the next epoch end, or until `limit`
/// (exclusive) if no epoch end comes first, with all their data. Returns
/// them and where the next record starts.
pub(crate) fn read(
    env: &Env,
    start: u64,
    limit: u64,
    slot_count: u64,
) -> EngineResult<(Vec<GroupRecord>, u64)> {
    let (records, position) = read_headers(env, start, limit, slot_count, VolumeSet::all())?;
    let wanted: Vec<(usize, usize, usize)> = records
        .iter()
        .enumerate()
        .filter(|(_, r)| r.header.data_count() > 0)
        .map(|(ri, r)| (ri, 0, r.header.data_count()))
        .collect();
    let records = fill(env, records, &wanted, slot_count)?;
    Ok((records, position))
}

/// [`read`] for write-back of the `served` volumes: only the blocks it
/// copies to their origins (the last version of each of their blocks in the
/// group) are read; superseded versions, clean copies and other volumes'
/// blocks are not. The other blocks' bytes are unspecified and
/// never used.
pub(crate) fn read_for_writeback(
    env: &Env,
    start: u64,
    limit: u64,
    slot_count: u64,
    served: VolumeSet,
) -> EngineResult<(Vec<GroupRecord>, u64)> {
    let (records, position) = read_headers(env, start, limit, slot_count, served)?;
    let fin = final_choice(env, &records, served);
    let wanted = block_runs(fin.blocks.values().map(|&(ri, k, _)| (ri, k)).collect());
    let read_blocks: usize = wanted.iter().map(|(_, first, end)| end - first).sum();
    let total_blocks: usize = records.iter().map(|r| r.header.data_count()).sum();
    assert!(read_blocks <= total_blocks);
    Counters::add(
        &env.counters.writeback_reads_skipped,
        (total_blocks - read_blocks) as u64,
    );
    let records = fill(env, records, &wanted, slot_count)?;
    Ok((records, position))
}

/// `(record, block)` pairs as runs `(record, first, end)` of adjacent
/// blocks of one record, in log order: one read each.
fn block_runs(mut chosen: Vec<(usize, usize)>) -> Vec<(usize, usize, usize)> {
    chosen.sort_unstable();
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    for (ri, k) in chosen {
        match runs.last_mut() {
            Some((r, _, end)) if *r == ri && *end == k => *end = k + 1,
            _ => runs.push((ri, k, k + 1)),
        }
    }
    runs
}

/// The headers of the records from `start` (see [`read`]), each with a data
/// buffer of its size, not read yet; the entries of the `checked` volumes
/// are checked (see `check_shape`).
fn read_headers(
    env: &Env,
    start: u64,
    limit: u64,
    slot_count: u64,
    checked: VolumeSet,
) -> EngineResult<(Vec<GroupRecord>, u64)> {
    let block_bytes = env.block_size_bytes;
    let mut records = Vec::new();
    let mut position = start;
    for _ in 0..slot_count {
        let (at, header) =
            read_record_header(env, position, slot_count, checked)?.ok_or_else(|| {
                EngineError::LogDamaged {
                    device: env.cache.name().to_string(),
                    detail: format!("no valid record at write-back position {position}"),
                }
            })?;
        // `read_record_header` checked the shape: the data fits a record
        // buffer and the record does not wrap.
        let end = at + header.length_blocks();
        if end > limit {
            // Records before the newest checkpoint's head were not replayed:
            // one that runs past the last durable epoch end is damage.
            return Err(EngineError::LogDamaged {
                device: env.cache.name().to_string(),
                detail: format!(
                    "record {} at log offset {at} ends at {end}, past the end of its group at {limit}",
                    header.sequence
                ),
            });
        }
        let data = data_for_read(env, header.data_count() * block_bytes);
        position = end;
        let epoch_end = header.epoch_end();
        records.push(GroupRecord { at, header, data });
        if epoch_end || position >= limit {
            break;
        }
    }
    Ok((records, position))
}

/// Read data blocks `[first, end)` of record `ri`, for each `(ri, first,
/// end)` of `wanted` (in log order, not overlapping), all at once. A
/// record's data blocks follow its header on the device without wrapping.
fn fill(
    env: &Env,
    mut records: Vec<GroupRecord>,
    wanted: &[(usize, usize, usize)],
    slot_count: u64,
) -> EngineResult<Vec<GroupRecord>> {
    if wanted.is_empty() {
        return Ok(records);
    }
    let block_bytes = env.block_size_bytes;
    let starts: Vec<u64> = records.iter().map(|r| r.at).collect();
    // Each record's buffer, minus the pieces already handed out, and the
    // first block that remainder holds.
    let mut rest: Vec<(usize, &mut [u8])> =
        records.iter_mut().map(|r| (0, &mut r.data[..])).collect();
    let mut requests: Vec<(u64, &mut [u8])> = Vec::with_capacity(wanted.len());
    for &(ri, first, end) in wanted {
        let (consumed, buf) = std::mem::take(&mut rest[ri]);
        assert!(
            first >= consumed && first < end,
            "pieces in order, not overlapping"
        );
        assert!(
            (end - consumed) * block_bytes <= buf.len(),
            "a piece inside its record"
        );
        let (_, tail) = buf.split_at_mut((first - consumed) * block_bytes);
        let (piece, after) = tail.split_at_mut((end - first) * block_bytes);
        rest[ri] = (end, after);
        let slot = ((starts[ri] + 1 + first as u64) % slot_count) as u32;
        requests.push((env.slot_offset_bytes(slot), piece));
    }
    if let Err(e) = env.cache.read_many(&mut requests) {
        // A read error is not corruption, and these blocks are dirty: read
        // the pieces one by one, each retried, before write-back gives up
        // on this round (it tries the group again later).
        Counters::add(&env.counters.cache_read_errors, 1);
        tracing::warn!("write-back's cache read failed, reading piece by piece: {e}");
        for (at, piece) in requests.iter_mut() {
            retrying_cache_read(env, "write-back reading a record", || {
                env.cache.read_at(*at, piece)
            })
            .map_err(EngineError::Cache)?;
        }
    }
    drop(requests);
    drop(rest);
    Ok(records)
}

/// Where each block of a group's final state comes from.
struct Final {
    /// lba → (record, data block, crc) of its last version.
    blocks: BTreeMap<u64, (usize, usize, u32)>,
    /// Zero/discard ranges, in log order.
    ranges: Vec<(RangeKind, u64, u64)>,
    /// (lba, logical offset) of final versions that failed their checksum.
    bad: Vec<(u64, u64)>,
}

/// The final state of the `served` volumes in the group, from its headers
/// alone: ranges in order, then the last version of each block (not
/// checked yet: see [`verify_final`]). Other volumes' entries are skipped.
fn final_choice(env: &Env, records: &[GroupRecord], served: VolumeSet) -> Final {
    let block_bytes = env.block_size_bytes;
    let mut fin = Final {
        blocks: BTreeMap::new(),
        ranges: Vec::new(),
        bad: Vec::new(),
    };
    for (ri, record) in records.iter().enumerate() {
        assert_eq!(record.data.len(), record.header.data_count() * block_bytes);
        let mut k = 0usize;
        for entry in &record.header.entries {
            match *entry {
                RecordEntry::Data { lba, crc, clean } => {
                    k += 1;
                    if !clean && served.contains(key_volume(lba)) {
                        fin.blocks.insert(lba, (ri, k - 1, crc));
                    }
                }
                RecordEntry::Range {
                    kind,
                    lba,
                    block_count,
                } => {
                    if !served.contains(key_volume(lba)) {
                        continue;
                    }
                    let end = lba + block_count as u64;
                    let inside: Vec<u64> = fin.blocks.range(lba..end).map(|(&l, _)| l).collect();
                    for l in inside {
                        fin.blocks.remove(&l);
                    }
                    fin.ranges.push((kind, lba, block_count as u64));
                }
            }
        }
    }
    fin
}

/// Check data before writing it to the origin: a final block that fails
/// its checksum is never copied (nor is an older version of it: the
/// block's newest acknowledged state is lost, and reads say so).
fn verify_final(env: &Env, records: &[GroupRecord], fin: &mut Final) {
    let block_bytes = env.block_size_bytes;
    let failed: Vec<(u64, u64)> = fin
        .blocks
        .iter()
        .filter_map(|(&lba, &(ri, k, crc))| {
            let record = &records[ri];
            let block = &record.data[k * block_bytes..(k + 1) * block_bytes];
            (block_checksum(lba, block) != crc).then_some((lba, record.at + 1 + k as u64))
        })
        .collect();
    for &(lba, _) in &failed {
        fin.blocks.remove(&lba);
    }
    fin.bad = failed;
}

/// Runs of consecutive keys of one volume, up to 1 MiB each, by their
/// first key, as slices of the records' buffers: blocks that also follow
/// each other in one record become one slice.
fn runs<'a>(env: &Env, records: &'a [GroupRecord], fin: &Final) -> Vec<(u64, Vec<&'a [u8]>)> {
    let block_bytes = env.block_size_bytes;
    let mut runs: Vec<(u64, usize, Vec<&'a [u8]>)> = Vec::new(); // (lba, blocks, slices)
    let mut last: Option<(usize, usize)> = None; // (record, block) of the previous block
    for (&lba, &(ri, k, _)) in &fin.blocks {
        let data: &'a [u8] = &records[ri].data;
        let block = &data[k * block_bytes..(k + 1) * block_bytes];
        // A run stays in one volume: the next volume's first key follows
        // the last key of a volume of the largest size.
        let extends = runs.last().is_some_and(|(start, blocks, _)| {
            *start + *blocks as u64 == lba
                && (*blocks + 1) * block_bytes <= RUN_BYTES_MAX
                && key_volume(*start) == key_volume(lba)
        });
        if !extends {
            runs.push((lba, 1, vec![block]));
        } else {
            let (_, blocks, slices) = runs.last_mut().expect("checked above");
            *blocks += 1;
            let same_record_next = last == Some((ri, k.wrapping_sub(1)));
            match slices.last_mut() {
                Some(slice) if same_record_next => {
                    let from = k * block_bytes - slice.len();
                    *slice = &data[from..(k + 1) * block_bytes];
                }
                _ => slices.push(block),
            }
        }
        last = Some((ri, k));
    }
    runs.into_iter()
        .map(|(key, _, slices)| (key, slices))
        .collect()
}

/// Copy one group to the origins of the `served` volumes: each volume's
/// final state (ranges in order, then the last valid version of each
/// block, sorted and merged by address) to that volume's origin, then one
/// flush of that origin. A volume whose origin fails does not stop the
/// others: it is listed in [`Applied::failed`] and keeps its position.
pub(crate) fn apply(env: &Env, records: &[GroupRecord], served: VolumeSet) -> Applied {
    let mut fin = final_choice(env, records, served);
    verify_final(env, records, &mut fin);
    let runs = runs(env, records, &fin);
    // Every volume the group has data for is written and flushed, also
    // one whose only block failed its checksum (then nothing is written,
    // and the flush is what a single origin always got).
    let touched: std::collections::BTreeSet<u16> = fin
        .ranges
        .iter()
        .map(|r| key_volume(r.1))
        .chain(fin.blocks.keys().map(|&key| key_volume(key)))
        .chain(fin.bad.iter().map(|&(key, _)| key_volume(key)))
        .collect();
    let mut failed = Vec::new();
    for id in touched {
        assert!(served.contains(id), "only served volumes are chosen");
        if let Err(e) = apply_volume(env, id, &fin, &runs) {
            failed.push((id, e));
        }
    }
    let mut done = served;
    for (id, _) in &failed {
        done.remove(*id);
    }
    let kept = |key: u64| done.contains(key_volume(key));
    let blocks: Vec<(u64, u32)> = fin
        .blocks
        .iter()
        .filter(|(&key, _)| kept(key))
        .map(|(&key, &(_, _, crc))| (key, crc))
        .collect();
    Applied {
        done,
        failed,
        blocks_written: blocks.len() as u64,
        ranges: fin.ranges.into_iter().filter(|r| kept(r.1)).collect(),
        blocks,
        bad: fin.bad.into_iter().filter(|&(key, _)| kept(key)).collect(),
    }
}

/// Volume `id`'s part of the group to its origin, then its flush.
fn apply_volume(env: &Env, id: u16, fin: &Final, runs: &[(u64, Vec<&[u8]>)]) -> EngineResult<()> {
    let block_bytes = env.block_size_bytes as u64;
    let origin_err = |e| {
        Counters::add(&env.counters.origin_write_errors, 1);
        EngineError::Origin(e)
    };
    let Some(volume) = env.origins.get(id) else {
        return Err(EngineError::NoSuchVolume { volume_id: id });
    };
    let origin = volume.device();
    for &(kind, key, count) in fin.ranges.iter().filter(|r| key_volume(r.1) == id) {
        let (at, len) = (key_lba(key) * block_bytes, count * block_bytes);
        // Zeroing or discarding a range again is harmless too.
        crate::origin_retry::write_retrying(
            env,
            "write-back zeroing or discarding on the origin",
            env.config.cache_write_backoff_us,
            || match kind {
                RangeKind::Zero => origin.write_zeroes(at, len),
                RangeKind::Discard => origin.discard(at, len),
            },
        )
        .map_err(EngineError::Origin)?;
    }
    let writes: Vec<(u64, &[&[u8]])> = runs
        .iter()
        .filter(|(key, _)| key_volume(*key) == id)
        .map(|(key, slices)| (key_lba(*key) * block_bytes, slices.as_slice()))
        .collect();
    write_runs(env, origin, &writes).map_err(EngineError::Origin)?;
    // A failed flush is not tried again by itself: after a failed fsync
    // the origin may have dropped the writes it covered, and a second one
    // that succeeds would vouch for them. The group fails, and its retry
    // writes everything again before it flushes.
    origin.flush().map_err(origin_err)
}

/// Write the runs of a group to `origin`, all at once (a backend may run
/// them concurrently). Runs are disjoint (each block's final version once)
/// and writing one again is harmless, so when a batch fails with an error
/// worth retrying its halves are written again, each as a batch: a rare
/// failure costs a few more batches, not the whole group, and the other
/// runs stay concurrent. A single run that keeps failing is tried again
/// by `origin_retry::write_again` and then fails the group. Every failed write call counts
/// in `origin_write_errors`; every re-issue in `origin_write_retries` (a
/// halving counts once, though it writes two batches again).
fn write_runs(
    env: &Env,
    origin: &dyn cairn_device::Device,
    writes: &OriginRuns<'_>,
) -> Result<(), cairn_device::DeviceError> {
    let c = &env.counters;
    // Batches still to write; a failed one comes back as two halves.
    let mut pending: Vec<&OriginRuns<'_>> = vec![writes];
    // Bounded: halving makes at most 2n - 1 batches of n runs (a lone
    // run's further attempts are `write_again`'s).
    let batches_max = 2 * writes.len().max(1);
    let mut batches = 0usize;
    while let Some(batch) = pending.pop() {
        batches += 1;
        assert!(
            batches <= batches_max,
            "write-back's origin retries are bounded"
        );
        let Err(e) = origin.write_many_vectored(batch) else {
            continue;
        };
        Counters::add(&c.origin_write_errors, 1);
        if !crate::origin_retry::retryable(&e) {
            return Err(e);
        }
        match batch {
            [(at, bufs)] => crate::origin_retry::write_again(
                env,
                e,
                "write-back writing to the origin",
                env.config.cache_write_backoff_us,
                || origin.write_vectored_at(*at, bufs),
            )?,
            [_, _, ..] => {
                let (first, second) = batch.split_at(batch.len() / 2);
                tracing::debug!(
                    runs = batch.len(),
                    "write-back batch failed, writing its halves again: {e}"
                );
                Counters::add(&c.origin_write_retries, 1);
                pending.push(second);
                pending.push(first);
            }
            // A backend that fails an empty batch: nothing to split.
            [] => return Err(e),
        }
    }
    Ok(())
}

/// The group `[start, end)` is on the origins of `applied.done`: their
/// dirty blocks in it become clean, their blocks that failed their checksum
/// are marked corrupt, their ranges are forgotten, tags follow, and their
/// write-back positions move to `end`. A volume removed meanwhile (no
/// cursor any more) is skipped.
pub(crate) fn commit(
    env: &Env,
    st: &mut State,
    start: u64,
    end: u64,
    records: &[GroupRecord],
    applied: &Applied,
) {
    assert!(end > start);
    let cursors = st.log.writeback_cursors();
    let done = applied.done.intersection(cursors.volumes());
    if done.is_empty() {
        return;
    }
    assert_eq!(
        cursors.at(start, done),
        done,
        "groups are committed in log order, volume by volume"
    );
    for record in records {
        let mut k = 0u64;
        for entry in &record.header.entries {
            let RecordEntry::Data { lba, .. } = *entry else {
                continue;
            };
            let logical = record.at + 1 + k;
            k += 1;
            if !done.contains(key_volume(lba)) {
                continue;
            }
            let slot = st.log.phys(logical);
            // Only if the slot still holds this record's block.
            if st.index.is_live(slot) && st.log.logical_of(slot) == logical {
                st.index.mark_written_back(slot);
            }
        }
    }
    for &(lba, logical) in &applied.bad {
        let slot = st.log.phys(logical);
        Counters::add(&env.counters.writeback_skipped_corrupt, 1);
        if st.index.is_live(slot) && st.index.lba(slot) == lba && st.log.logical_of(slot) == logical
        {
            tracing::error!(
                lba,
                "dirty block failed its checksum during write-back; not copied to the origin"
            );
            Counters::add(&env.counters.checksum_mismatches, 1);
            // It stays corrupt (EIO) until evicted; then it is "lost".
            st.index.mark_corrupt(slot);
        }
    }
    // The group is on the origin and flushed: its tags may follow, in the
    // order the origin saw it (ranges, then data). The checksums were
    // verified, so nothing is recomputed.
    if let Some(tags) = st.tags.as_mut() {
        tags.record_origin_writes(&applied.ranges, &applied.blocks);
    }
    st.index.retire_ranges(done, start, end);
    st.log.written_back_to(done, end);
    let block_bytes = env.block_size_bytes as u64;
    Counters::add(&env.counters.writeback_blocks, applied.blocks_written);
    Counters::add(
        &env.counters.writeback_bytes,
        applied.blocks_written * block_bytes,
    );
    Counters::add(&env.counters.writeback_groups, 1);
}

#[cfg(test)]
mod tests {
    use super::block_runs;

    #[test]
    fn runs_join_adjacent_blocks_of_one_record_only() {
        // Record 0 ends at block 5 and record 1 starts at block 5: they do
        // not join, although the numbers touch.
        let chosen = vec![(1, 5), (0, 3), (0, 4), (1, 6), (1, 8), (2, 0)];
        assert_eq!(
            block_runs(chosen),
            vec![(0, 3, 5), (1, 5, 7), (1, 8, 9), (2, 0, 1)]
        );
        assert!(block_runs(Vec::new()).is_empty());
    }
}
