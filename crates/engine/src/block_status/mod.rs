//! Block status that tells the truth: what cairn knows of each block (a
//! cached copy, dirty or clean, is data; a zero or discard it still tracks
//! reads as zeroes), and for the rest the origin's own allocation.
//!
//! Only what is certain is reported as zeroes: a hole claimed over data
//! would make `nbdcopy` or `qemu-img convert` skip it. A block not in the
//! index and not in a tracked range has its newest data on the origin
//! (write-back evicts only blocks whose group the origin has durably), so
//! the origin's answer for it is the volume's. Block status is a snapshot:
//! a write racing it may or may not be seen, as the NBD protocol allows.

mod state;

pub use state::{BlockState, BlockStatusRun};

use cairn_format::{block_key, RangeKind, TAG_DISCARDED};
use cairn_io::Reactor;

use crate::env::Env;
use crate::error::EngineResult;
use crate::state_lock::StateLock;

/// Blocks looked at per call at most (the engine lock is held over them);
/// the answer may cover less than asked, and the client asks again.
const STATUS_BLOCKS_MAX: u64 = 1 << 16;

/// What the index says of a block, before the origin is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Known {
    Volume(BlockState),
    /// Not cached, not tracked: the origin's allocation decides.
    Origin,
}

/// The runs of `[offset, offset + length)` (clipped to the volume), from
/// `offset`, covering at least one byte of it. `length` is non-zero and
/// `offset` inside the volume. A task waits for an origin that answers
/// over the network as a task (the question runs on an offload thread).
pub(crate) async fn block_status(
    env: &Env,
    state: &StateLock,
    offset: u64,
    length: u64,
) -> EngineResult<Vec<BlockStatusRun>> {
    let block_bytes = env.block_size_bytes as u64;
    // The end of the volume `offset` lies in, in the key space.
    let (volume, _) = env.origins.of_key(offset / block_bytes)?;
    let volume_bytes = (block_key(volume.id, 0) + volume.blocks) * block_bytes;
    // The entry point checked the range against the volume then; a volume
    // removed and added again smaller since is an error, not a panic.
    if length == 0 || offset >= volume_bytes {
        return Err(crate::error::EngineError::OutOfRange {
            offset,
            length_bytes: length,
            size_bytes: volume.blocks * block_bytes,
        });
    }
    let first = offset / block_bytes;
    let end = (offset + length)
        .min(volume_bytes)
        .div_ceil(block_bytes)
        .min(first + STATUS_BLOCKS_MAX);
    let known = known_runs(env, state, first, end)?;
    let mut runs: Vec<BlockStatusRun> = Vec::new();
    let mut at = first;
    for (run_end, known) in known {
        let states = match known {
            Known::Volume(s) => vec![((run_end - at) * block_bytes, s)],
            Known::Origin => origin_runs(env, at * block_bytes, (run_end - at) * block_bytes).await,
        };
        for (length_bytes, state) in states {
            push(&mut runs, length_bytes, state);
        }
        at = run_end;
    }
    // The first run starts at `offset`, not at its block's start.
    let skip = offset - first * block_bytes;
    let head = runs.first_mut().expect("at least one block was looked at");
    assert!(head.length_bytes > skip);
    head.length_bytes -= skip;
    Ok(runs)
}

/// Under the engine lock, the runs of `[first, end)` by what the index and
/// the tags say, as (end block, what).
fn known_runs(
    env: &Env,
    state: &StateLock,
    first: u64,
    end: u64,
) -> EngineResult<Vec<(u64, Known)>> {
    let st = state.running(env)?;
    let mut runs: Vec<(u64, Known)> = Vec::new();
    for lba in first..end {
        let known = if st.index.lookup(lba).is_some() || st.index.is_lost(lba) {
            // Cached (dirty or clean), or lost (reads as EIO): data.
            Known::Volume(BlockState::Data)
        } else {
            match st.index.range_covering(lba) {
                Some(RangeKind::Zero) => Known::Volume(BlockState::Zero),
                Some(RangeKind::Discard) => Known::Volume(BlockState::Hole),
                None if st.tags.as_ref().and_then(|t| t.tag_of(lba)) == Some(TAG_DISCARDED) => {
                    Known::Volume(BlockState::Hole)
                }
                None => Known::Origin,
            }
        };
        match runs.last_mut() {
            Some((run_end, k)) if *k == known => *run_end = lba + 1,
            _ => runs.push((lba + 1, known)),
        }
    }
    Ok(runs)
}

/// The origin's allocation of a byte range, without the engine lock. An
/// origin that cannot say, or fails to, reports data.
async fn origin_runs(env: &Env, offset: u64, length: u64) -> Vec<(u64, BlockState)> {
    let asked = match env.origin_of_offset(offset) {
        Ok((volume, at))
            if volume.device().allocation_may_wait() && Reactor::current().is_some() =>
        {
            // Off the event loop: the question is a round trip to a server.
            let asked = cairn_io::offload(move || {
                volume
                    .device()
                    .allocation(at, length)
                    .map_err(|e| e.to_string())
            });
            asked
                .await
                .unwrap_or_else(|_| Err("the allocation query panicked".to_string()))
        }
        Ok((volume, at)) => volume
            .device()
            .allocation(at, length)
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match asked {
        Ok(runs) => runs
            .into_iter()
            .map(|r| {
                let state = if r.allocated {
                    BlockState::Data
                } else {
                    BlockState::Hole
                };
                (r.length_bytes, state)
            })
            .collect(),
        Err(e) => {
            tracing::debug!("origin allocation of {offset}+{length} unknown: {e}");
            vec![(length, BlockState::Data)]
        }
    }
}

fn push(runs: &mut Vec<BlockStatusRun>, length_bytes: u64, state: BlockState) {
    if length_bytes == 0 {
        return;
    }
    match runs.last_mut() {
        Some(last) if last.state == state => last.length_bytes += length_bytes,
        _ => runs.push(BlockStatusRun {
            length_bytes,
            state,
        }),
    }
}
