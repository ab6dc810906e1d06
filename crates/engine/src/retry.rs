//! Retrying a failed cache write, when retrying it can make it durable, and
//! a failed cache read, which is always safe to retry.

use cairn_device::DeviceError;

use crate::env::Env;
use crate::retry_policy::RetryPolicy;

/// Run one cache write, retrying it up to `cache_write_attempts` times in
/// all with a doubling backoff when `retry_safe`. Every failed attempt is
/// counted in `cache_write_errors`, every retry in `cache_write_retries`.
///
/// A write with its barrier is retry-safe only if no record sealed without
/// a barrier waits for it: a failed fsync may drop the dirty pages of those
/// earlier writes, and a later barrier that succeeds would then vouch for
/// data that is not there (see `docs/design.md`).
pub(crate) fn retrying_cache_write<T>(
    env: &Env,
    what: &str,
    retry_safe: bool,
    op: impl FnMut() -> Result<T, DeviceError>,
) -> Result<T, DeviceError> {
    let policy = RetryPolicy {
        attempts: if retry_safe {
            env.config.cache_write_attempts.max(1)
        } else {
            1
        },
        backoff_us: env.config.cache_write_backoff_us,
    };
    let c = &env.counters;
    policy.run(&c.cache_write_errors, &c.cache_write_retries, what, op)
}

/// Run one cache read, retrying it up to `cache_read_attempts` times in all
/// with the write retries' backoff. Every failed attempt is counted in
/// `cache_read_errors`, every retry in `cache_read_retries`.
///
/// A read error is not corruption: the device did not say the data is
/// bad, only that it did not deliver it this time. A dirty block's copy is
/// the only one, so it is tried again before a request fails, and a read
/// that fails for good fails its request (EIO) without marking the block.
pub(crate) fn retrying_cache_read<T>(
    env: &Env,
    what: &str,
    op: impl FnMut() -> Result<T, DeviceError>,
) -> Result<T, DeviceError> {
    let policy = RetryPolicy {
        attempts: env.config.cache_read_attempts.max(1),
        backoff_us: env.config.cache_write_backoff_us,
    };
    let c = &env.counters;
    policy.run(&c.cache_read_errors, &c.cache_read_retries, what, op)
}

/// Read cache slot `slot` from the medium (never the page cache), retried
/// like [`retrying_cache_read`].
pub(crate) fn read_slot_retrying(
    env: &Env,
    slot: u32,
    block: &mut [u8],
) -> Result<(), DeviceError> {
    let at = env.slot_offset_bytes(slot);
    retrying_cache_read(env, "reading a cache block", || {
        env.cache.read_at(at, block)
    })
}
