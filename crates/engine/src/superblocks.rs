//! The two alternating superblock copies: reading the newest valid one,
//! and writing the next copy durably; and the volume table each superblock
//! of format 2 names.

use cairn_device::{Device, DeviceError};
use cairn_format::{
    DecodeError, ExistingContents, OriginV1, Superblock, SuperblockVolumes, VolumeEntry,
    VolumeState, VolumeTable, VolumeTableExpected, SUPERBLOCK_OFFSETS, VOLUME_TABLE_COPY_BYTES,
    VOLUME_TABLE_OFFSETS,
};

use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::log::WritebackCursors;
use crate::retry::retrying_cache_write;
use crate::stats::Counters;

/// Counters read from the device (superblock and checkpoint sequences,
/// the generation, logical log offsets) only ever grow by small steps from
/// zero; one at or above this is damage, refused before arithmetic on it
/// could overflow.
pub(crate) const LOG_COUNTER_LIMIT: u64 = 1 << 62;

/// Bytes read per superblock copy.
const SUPERBLOCK_READ_BYTES: usize = 4096;

/// Read and validate the newest superblock of a cache device.
pub(crate) fn read_newest(cache: &dyn Device) -> EngineResult<Superblock> {
    let mut results = Vec::with_capacity(2);
    for &offset in &SUPERBLOCK_OFFSETS {
        if cache.size_bytes() < offset + SUPERBLOCK_READ_BYTES as u64 {
            return Err(EngineError::NotFormatted {
                device: cache.name().to_string(),
            });
        }
        let mut buf = vec![0u8; SUPERBLOCK_READ_BYTES];
        cache
            .read_at(offset, &mut buf)
            .map_err(EngineError::Cache)?;
        results.push(Superblock::decode(&buf));
    }
    let copy_b = results.pop().expect("two copies");
    let copy_a = results.pop().expect("two copies");
    let no_magic =
        |r: &Result<Superblock, DecodeError>| matches!(r, Err(DecodeError::BadMagic { .. }));
    let unformatted = no_magic(&copy_a) && no_magic(&copy_b);
    match Superblock::newest(copy_a, copy_b) {
        Ok(superblock) => Ok(superblock),
        Err(_) if unformatted => match existing_contents(cache)? {
            Some(ExistingContents::CairnCache) => Err(EngineError::SuperblocksMissing {
                device: cache.name().to_string(),
            }),
            _ => Err(EngineError::NotFormatted {
                device: cache.name().to_string(),
            }),
        },
        Err((copy_a, copy_b)) => Err(EngineError::SuperblockDamaged {
            device: cache.name().to_string(),
            copy_a,
            copy_b,
        }),
    }
}

/// What the start of `cache` shows it holds, if anything known (see
/// `cairn_format::existing_contents`).
pub(crate) fn existing_contents(cache: &dyn Device) -> EngineResult<Option<ExistingContents>> {
    // Whole 4 KiB pages, which any device reads (O_DIRECT included).
    let probe_bytes = cairn_format::SIGNATURE_PROBE_BYTES.min(cache.size_bytes() as usize) & !4095;
    let mut head = vec![0u8; probe_bytes];
    cache.read_at(0, &mut head).map_err(EngineError::Cache)?;
    Ok(cairn_format::existing_contents(&head))
}

/// Write both copies (format): no superblock of an earlier format survives.
pub(crate) fn write_both(
    cache: &dyn Device,
    superblock: &mut Superblock,
) -> Result<(), DeviceError> {
    for sequence in [1u64, 2] {
        superblock.sequence = sequence;
        let at = SUPERBLOCK_OFFSETS[Superblock::copy_index(sequence)];
        cache.write_at(at, &superblock.encode())?;
    }
    cache.flush()
}

/// The volumes `superblock` serves: the volume table it names (format 2),
/// or, for format 1, its one origin as a table of sequence 0 that exists
/// only in memory.
pub(crate) fn read_table(cache: &dyn Device, superblock: &Superblock) -> EngineResult<VolumeTable> {
    let table_sequence = match &superblock.volumes {
        SuperblockVolumes::V1(origin) => return table_of_v1(cache, superblock, origin, 0),
        SuperblockVolumes::V2 { table_sequence, .. } => *table_sequence,
    };
    let damaged = |detail: String| EngineError::SuperblockInvalid {
        device: cache.name().to_string(),
        detail,
    };
    let at = VOLUME_TABLE_OFFSETS[VolumeTable::copy_for(table_sequence)];
    let mut buf = vec![0u8; VOLUME_TABLE_COPY_BYTES];
    cache.read_at(at, &mut buf).map_err(EngineError::Cache)?;
    let expected = VolumeTableExpected {
        uuid: superblock.uuid,
        sequence: table_sequence,
    };
    let table = VolumeTable::decode(&buf, expected)
        .map_err(|e| damaged(format!("volume table {table_sequence} at byte {at}: {e}")))?;
    // Every volume has its positions in the superblock, and no position
    // names a volume the table does not have.
    let positions = superblock.volume_table().map_or(&[][..], |(_, p)| p);
    let matched = positions.len() == table.volumes().len()
        && positions.iter().all(|p| table.by_id(p.id).is_some());
    if !matched {
        return Err(damaged(format!(
            "the superblock has positions for {} volumes, the volume table {} lists {}",
            positions.len(),
            table_sequence,
            table.volumes().len()
        )));
    }
    Ok(table)
}

/// Format 1's origin as volume 0 of a table of `sequence`: the name `""`
/// (what clients ask for when they name no export), its mode, integrity
/// and settings.
pub(crate) fn table_of_v1(
    cache: &dyn Device,
    superblock: &Superblock,
    origin: &OriginV1,
    sequence: u64,
) -> EngineResult<VolumeTable> {
    let volume = VolumeEntry {
        id: 0,
        state: VolumeState::Active,
        name: String::new(),
        origin_identity: origin.origin_identity.clone(),
        origin_size_bytes: origin.origin_size_bytes,
        mode: origin.mode,
        integrity: superblock.features & cairn_format::FEATURE_INTEGRITY != 0,
        dirty_share_pct: None,
        settings: origin.settings,
        tag_first_page: 0,
    };
    VolumeTable::new(sequence, superblock.uuid, vec![volume]).map_err(|e| {
        EngineError::SuperblockInvalid {
            device: cache.name().to_string(),
            detail: format!("its origin does not make a volume: {e}"),
        }
    })
}

/// Write `table` into its copy, durably: before any superblock names it.
/// The other copy, which the current superblock may name, is not touched.
pub(crate) fn write_table(cache: &dyn Device, table: &VolumeTable) -> Result<(), DeviceError> {
    let at = VOLUME_TABLE_OFFSETS[VolumeTable::copy_for(table.sequence)];
    cache.write_vectored_and_flush(at, &[&table.encode()])
}

/// Raise every volume's write-back position to the cache's: a volume is
/// never behind the least of them (which `writeback_offset` is).
pub(crate) fn lift_positions(superblock: &mut Superblock) {
    let floor = superblock.writeback_offset;
    if let SuperblockVolumes::V2 { positions, .. } = &mut superblock.volumes {
        for p in positions {
            p.writeback_offset = p.writeback_offset.max(floor);
        }
    }
}

/// Record each volume's write-back position and their least (the cache's
/// write-back position) in the superblock. A position in the superblock
/// with no cursor (a volume being added) keeps its value.
pub(crate) fn set_writeback_positions(superblock: &mut Superblock, cursors: &WritebackCursors) {
    let least = cursors.least();
    assert!(
        least >= superblock.writeback_offset,
        "the write-back position never moves back"
    );
    superblock.writeback_offset = least;
    if let SuperblockVolumes::V2 { positions, .. } = &mut superblock.volumes {
        for p in positions.iter_mut() {
            if let Some(at) = cursors.get(p.id) {
                assert!(at >= p.writeback_offset, "volume {} moved back", p.id);
                p.writeback_offset = at;
            }
        }
    }
}

/// Where integrity recalculation of volume `id` stands.
pub(crate) fn recalc_position(superblock: &Superblock, id: u16) -> u64 {
    match &superblock.volumes {
        SuperblockVolumes::V1(origin) if id == 0 => origin.recalc_position_blocks,
        SuperblockVolumes::V1(_) => 0,
        SuperblockVolumes::V2 { positions, .. } => positions
            .iter()
            .find(|p| p.id == id)
            .map_or(0, |p| p.recalc_position_blocks),
    }
}

/// Record that every integrity tag of volume `id` is computed below
/// `blocks`.
pub(crate) fn set_recalc_position(superblock: &mut Superblock, id: u16, blocks: u64) {
    match &mut superblock.volumes {
        SuperblockVolumes::V1(origin) if id == 0 => origin.recalc_position_blocks = blocks,
        SuperblockVolumes::V1(_) => {}
        SuperblockVolumes::V2 { positions, .. } => {
            for p in positions.iter_mut().filter(|p| p.id == id) {
                p.recalc_position_blocks = blocks;
            }
        }
    }
}

/// Write the next superblock copy durably. The sequence only moves on once
/// the copy is durable, so a retry (or the degraded superblock after a
/// failure) rewrites the same copy, and the other copy, the last good one,
/// is never the one at risk.
pub(crate) fn write_next(
    env: &Env,
    superblock: &mut Superblock,
    retry_safe: bool,
) -> Result<(), DeviceError> {
    assert!(
        !env.health.is_degraded(),
        "degraded mode never writes the superblock again"
    );
    let mut next = superblock.clone();
    next.sequence += 1;
    lift_positions(&mut next);
    let buf = next.encode();
    let at = SUPERBLOCK_OFFSETS[Superblock::copy_index(next.sequence)];
    env.syncs.watch(|| {
        retrying_cache_write(env, "writing the superblock", retry_safe, || {
            env.cache.write_vectored_and_flush(at, &[&buf])
        })
    })?;
    *superblock = next;
    Counters::add(&env.counters.cache_bytes_written, buf.len() as u64);
    Counters::add(&env.counters.cache_barriers, 1);
    Counters::add(&env.counters.superblock_writes, 1);
    Ok(())
}
