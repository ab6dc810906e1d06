//! Retrying a failed cache write, when retrying it can make it durable.

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
    policy.run(&env.counters, what, op)
}
