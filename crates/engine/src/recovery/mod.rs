//! Recovery: the newest checkpoint, then replay of the log after it.
//!
//! 1. [`checkpoint_load`]: the active checkpoint's header and payload give
//!    the index as of its head;
//! 2. [`replay`]: the record chain after it (sequence, logical offset and
//!    the crc of the previous header must all match). Where the chain
//!    ends, a bounded scan further looks for any record that proves the
//!    missing one had been made durable; if one exists, the log is damaged
//!    and opening is refused rather than silently serving older data;
//! 3. [`classify`]: which records a completed barrier covered (a bad block
//!    there is corruption, EIO) and which may be torn (verified now; a bad
//!    block there keeps its previous value);
//! 4. [`rebuild`]: the replayed records applied to the index in order;
//! 5. [`finish`]: the positions checked against each other, the log's
//!    state and the gauges.

mod checkpoint_load;
mod classify;
mod finish;
mod rebuild;
mod replay;

use cairn_format::{Superblock, VolumeTable};

use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::state::State;

/// Recover the engine's state from the cache device.
pub(crate) fn recover(
    env: &Env,
    superblock: Superblock,
    volumes: VolumeTable,
) -> EngineResult<State> {
    let (checkpoint, mut index) = checkpoint_load::load(env, &superblock)?;
    let mut chain = replay::replay_chain(env, &superblock, &checkpoint)?;
    let durable = classify::durable_sequence(&chain.records, &checkpoint);
    classify::verify_unsynced(env, &mut chain.records, durable)?;
    let rebuilt = rebuild::apply(env, &mut index, &chain.records, durable, &checkpoint);
    let (superblock, log, index) = finish::finish(
        env,
        superblock,
        &checkpoint,
        index,
        &chain,
        &rebuilt,
        durable,
    )?;
    let state = State {
        superblock,
        volumes,
        log,
        index,
        tags: None,
    };
    tracing::info!(
        records = chain.records.len(),
        dirty_blocks = state.index.dirty_blocks(),
        clean_blocks = state.index.clean_blocks(),
        "cache recovered"
    );
    Ok(state)
}

/// The active checkpoint failed `detail`'s check: the error names it (its
/// slot, sequence and byte range on the cache device).
fn checkpoint_damaged(env: &Env, superblock: &Superblock, detail: String) -> EngineError {
    let slot = superblock.active_checkpoint;
    let at = env.layout.checkpoint_offset_bytes(slot);
    let end = at + env.layout.checkpoint_slot_bytes;
    EngineError::CheckpointDamaged {
        device: env.cache.name().to_string(),
        detail: format!(
            "the newest checkpoint (number {} in slot {slot}, bytes {at}..{end} of the device): {detail}",
            superblock.checkpoint_sequence
        ),
    }
}

/// The cache device failed the read of `length_bytes` at `offset_bytes`
/// of the active checkpoint: the error names the checkpoint, its slot and
/// the bytes (not a damaged checkpoint: nothing was read to check).
fn checkpoint_unreadable(
    env: &Env,
    superblock: &Superblock,
    offset_bytes: u64,
    length_bytes: u64,
    source: cairn_device::DeviceError,
) -> EngineError {
    EngineError::CheckpointUnreadable {
        device: env.cache.name().to_string(),
        checkpoint_sequence: superblock.checkpoint_sequence,
        slot: superblock.active_checkpoint,
        offset_bytes,
        length_bytes,
        source,
    }
}

fn log_damaged(env: &Env, detail: String) -> EngineError {
    EngineError::LogDamaged {
        device: env.cache.name().to_string(),
        detail,
    }
}
