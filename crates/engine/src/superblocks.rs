//! The two alternating superblock copies: reading the newest valid one,
//! and writing the next copy durably.

use cairn_device::{Device, DeviceError};
use cairn_format::{DecodeError, Superblock, SUPERBLOCK_OFFSETS};

use crate::env::Env;
use crate::error::{EngineError, EngineResult};
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
        Err(_) if unformatted => Err(EngineError::NotFormatted {
            device: cache.name().to_string(),
        }),
        Err((copy_a, copy_b)) => Err(EngineError::SuperblockDamaged {
            device: cache.name().to_string(),
            copy_a,
            copy_b,
        }),
    }
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
    let buf = next.encode();
    let at = SUPERBLOCK_OFFSETS[Superblock::copy_index(next.sequence)];
    retrying_cache_write(env, "writing the superblock", retry_safe, || {
        env.cache.write_vectored_and_flush(at, &[&buf])
    })?;
    superblock.sequence = next.sequence;
    Counters::add(&env.counters.cache_bytes_written, buf.len() as u64);
    Counters::add(&env.counters.cache_barriers, 1);
    Counters::add(&env.counters.superblock_writes, 1);
    Ok(())
}
