//! Step 5 of recovery: check the positions against each other and build
//! the engine's state.

use cairn_format::{key_volume, CheckpointHeader, Superblock, PENDING_RANGES_MAX};

use super::log_damaged;
use super::rebuild::Rebuilt;
use super::replay::Chain;
use crate::env::Env;
use crate::error::EngineResult;
use crate::index::Index;
use crate::log::{read_record_header, record_start, Log, LogPositions, WritebackCursors};
use crate::volume_set::VolumeSet;

pub(crate) fn finish(
    env: &Env,
    mut superblock: Superblock,
    checkpoint: &CheckpointHeader,
    mut index: Index,
    chain: &Chain,
    rebuilt: &Rebuilt,
    durable: u64,
) -> EngineResult<(Superblock, Log, Index)> {
    let slot_count = env.layout.log_blocks;
    let head = rebuilt.head;
    let cursors = volume_positions(env, &superblock, checkpoint)?;
    for (_, at) in cursors.iter() {
        check_writeback_position(env, checkpoint, chain, rebuilt, at)?;
    }
    let writeback = cursors.least();
    let tail = checkpoint.tail_offset.max(head.saturating_sub(slot_count));
    if tail > writeback {
        return Err(log_damaged(
            env,
            format!("the log wrapped over dirty data (tail {tail} > write-back {writeback})"),
        ));
    }
    superblock.generation = superblock.generation.max(rebuilt.generation_max);
    let log = Log::new(
        slot_count,
        superblock.generation,
        LogPositions {
            tail,
            writeback: cursors.clone(),
            writeback_limit: rebuilt.writeback_limit,
            head,
            checkpoint_head: checkpoint.head_offset,
            next_sequence: chain.next_sequence,
            prev_crc: chain.prev_crc,
            durable_sequence: durable,
        },
    );
    // Ranges of records before the write-back position are on the origin
    // already: the superblock may have persisted that position after the
    // checkpoint that still lists them. Kept, one would read as zeroes
    // over a later write that was written back and evicted since.
    index.retire_ranges_before(|volume| cursors.get(volume));
    // The engine never lets more ranges wait than a checkpoint can hold
    // (writers run write-back first); more after replay is damage, and
    // would not fit the next checkpoint.
    if index.range_count() > PENDING_RANGES_MAX {
        return Err(log_damaged(
            env,
            format!(
                "replay leaves {} zero/discard ranges pending, more than the {PENDING_RANGES_MAX} a checkpoint holds",
                index.range_count()
            ),
        ));
    }
    // Every live slot lies in [tail, head); it is dirty if it lies after
    // its volume's write-back position (and was not inserted clean).
    index
        .finish_replay(
            |slot| log.logical_of(slot) < head,
            |slot, key| {
                let at = cursors.get(key_volume(key)).unwrap_or(writeback);
                log.logical_of(slot) >= at
            },
        )
        .map_err(|detail| log_damaged(env, detail))?;
    Ok((superblock, log, index))
}

/// Each volume's write-back position: the superblock's, never behind the
/// cache's (the least of them, which the superblock and the checkpoint
/// also record). A format 1 superblock has the one volume.
fn volume_positions(
    env: &Env,
    superblock: &Superblock,
    checkpoint: &CheckpointHeader,
) -> EngineResult<WritebackCursors> {
    let floor = checkpoint.writeback_offset.max(superblock.writeback_offset);
    let volumes: Vec<(u16, u64)> = match superblock.volume_table() {
        Some((_, positions)) => positions
            .iter()
            .map(|p| (p.id, p.writeback_offset.max(floor)))
            .collect(),
        None => vec![(0, floor)],
    };
    if volumes.is_empty() {
        return Err(log_damaged(
            env,
            "the superblock has no volume's write-back position".into(),
        ));
    }
    Ok(WritebackCursors::new(&volumes))
}

/// A persisted write-back position must be a record boundary the log
/// still replays to.
fn check_writeback_position(
    env: &Env,
    checkpoint: &CheckpointHeader,
    chain: &Chain,
    rebuilt: &Rebuilt,
    writeback: u64,
) -> EngineResult<()> {
    let slot_count = env.layout.log_blocks;
    if writeback > rebuilt.writeback_limit {
        return Err(log_damaged(
            env,
            format!(
                "write-back reached offset {writeback}, but the log only replays to {}",
                rebuilt.writeback_limit
            ),
        ));
    }
    if writeback < checkpoint.head_offset && writeback != checkpoint.writeback_offset {
        // Only where a record starts matters here, not what it holds.
        match read_record_header(env, writeback, slot_count, VolumeSet::EMPTY)? {
            Some((at, _)) if at == record_start(writeback, slot_count) => {}
            _ => {
                return Err(log_damaged(
                    env,
                    format!("no record at the write-back position {writeback}"),
                ))
            }
        }
    }
    if writeback > checkpoint.head_offset
        && !chain
            .records
            .iter()
            .any(|r| r.at + r.header.length_blocks() == writeback)
    {
        return Err(log_damaged(
            env,
            format!("write-back position {writeback} is not a record boundary"),
        ));
    }
    Ok(())
}
