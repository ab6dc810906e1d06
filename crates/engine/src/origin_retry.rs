//! Which origin errors are worth asking again at once, and the loops that
//! ask again, so a flaky origin is judged the same way on every path:
//! blocking reads (`read_origin`), writes and units of writes with their
//! flush (`write_retrying`, `write_again`). A client's read miss
//! (`read::start_read`, asynchronous) loops on its own over `read_again`;
//! write-back's batches (`group`) are halved before a lone run goes to
//! `write_again`. A flush alone is never asked again.

use cairn_device::DeviceError;

use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::stats::Counters;

/// Whether an origin read or write that failed with `e` is worth trying
/// again at once: an error the origin reported for that request (EIO from
/// a busy or flaky server or disk), not a lost connection or a timeout
/// (the NBD client has already waited out its reconnect window, and
/// asking again would multiply it before the origin is reported failing),
/// and not a request that can never succeed (out of range, unsupported,
/// claimed). The simulated device's injected faults stand for EIO.
pub(crate) fn retryable(e: &DeviceError) -> bool {
    match e {
        DeviceError::Injected { .. } => true,
        DeviceError::Io { source, .. } => matches!(
            source.raw_os_error(),
            Some(libc::EIO | libc::EAGAIN | libc::EINTR | libc::EBUSY | libc::ENOMEM)
        ),
        _ => false,
    }
}

/// An origin write that failed with `e` (already counted in
/// `origin_write_errors`), tried again while its error is worth it
/// (checked on every failure: a lost connection or a timeout ends the
/// retries at once), `origin_write_attempts` times in all counting the
/// failed one, each retry after `backoff_us` (doubled each time; 0: at
/// once). Write-back waits the cache's retry backoff; a caller that holds
/// a lock others wait on (a degraded write, a scrub's repair) passes 0, so
/// a failing origin costs them round trips, not sleeps.
///
/// `op` must be safe to repeat whole: a write or a range op, or writes
/// *with* the flush that vouches for them. Never a flush alone: after a
/// failed flush the origin may have dropped the writes it covered, and a
/// second flush that succeeds would vouch for them.
pub(crate) fn write_again(
    env: &Env,
    mut e: DeviceError,
    what: &str,
    mut backoff_us: u64,
    mut op: impl FnMut() -> Result<(), DeviceError>,
) -> Result<(), DeviceError> {
    let c = &env.counters;
    let attempts = env.config.origin_write_attempts.max(1);
    // Bounded: at most `attempts - 1` more writes.
    for attempt in 2..=attempts {
        if !retryable(&e) {
            return Err(e);
        }
        tracing::warn!("{what} failed, trying it again ({attempt} of {attempts}): {e}");
        if backoff_us > 0 {
            std::thread::sleep(std::time::Duration::from_micros(backoff_us));
            backoff_us = backoff_us.saturating_mul(2);
        }
        Counters::add(&c.origin_write_retries, 1);
        match op() {
            Ok(()) => return Ok(()),
            Err(again) => {
                Counters::add(&c.origin_write_errors, 1);
                e = again;
            }
        }
    }
    Err(e)
}

/// An origin write made with [`write_again`]'s judgement from the first
/// attempt on: every failure counts in `origin_write_errors`.
pub(crate) fn write_retrying(
    env: &Env,
    what: &str,
    backoff_us: u64,
    mut op: impl FnMut() -> Result<(), DeviceError>,
) -> Result<(), DeviceError> {
    match op() {
        Ok(()) => Ok(()),
        Err(e) => {
            Counters::add(&env.counters.origin_write_errors, 1);
            write_again(env, e, what, backoff_us, op)
        }
    }
}

/// Read whole origin blocks from the block named by `key` (blocking),
/// asking again while it fails with an error worth it, counting every
/// failure.
pub(crate) fn read_origin(env: &Env, key: u64, buf: &mut [u8]) -> EngineResult<()> {
    let (volume, lba) = env.origins.of_key(key)?;
    let at = lba * env.block_size_bytes as u64;
    let device = volume.device();
    read_retrying(env, "origin read", || device.read_at(at, buf)).map_err(|e| {
        Counters::add(&env.counters.origin_read_errors, 1);
        EngineError::Origin(e)
    })
}

/// Whether an origin read that failed with `e` after `reads_done` reads
/// is asked again: at once while its error is worth it, up to
/// `origin_read_attempts` reads in all (a read changes nothing, so no
/// backoff: a client or a scrub waits). A `true` counts the failure in
/// `origin_read_errors` and the retry in `origin_read_retries`; the caller
/// counts the last failure, as for a single read.
pub(crate) fn read_again(env: &Env, reads_done: u32, e: &DeviceError, what: &str) -> bool {
    let attempts = env.config.origin_read_attempts.max(1);
    if reads_done >= attempts || !retryable(e) {
        return false;
    }
    tracing::debug!(
        "{what} failed, asking again ({} of {attempts}): {e}",
        reads_done + 1
    );
    Counters::add(&env.counters.origin_read_errors, 1);
    Counters::add(&env.counters.origin_read_retries, 1);
    true
}

/// A blocking origin read, asked again while [`read_again`] says so.
fn read_retrying(
    env: &Env,
    what: &str,
    mut op: impl FnMut() -> Result<(), DeviceError>,
) -> Result<(), DeviceError> {
    let mut result = op();
    let mut reads = 1;
    // Bounded: `read_again` stops at `origin_read_attempts` reads.
    while let Err(e) = &result {
        if !read_again(env, reads, e, what) {
            break;
        }
        reads += 1;
        result = op();
    }
    result
}

#[cfg(test)]
mod tests {
    use super::retryable;
    use cairn_device::DeviceError;
    use std::io;

    fn io_error(source: io::Error) -> DeviceError {
        DeviceError::Io {
            device: "origin".into(),
            offset: 0,
            len: 4096,
            source,
        }
    }

    #[test]
    fn errors_the_origin_reported_are_retried_lost_connections_are_not() {
        assert!(retryable(&io_error(io::Error::from_raw_os_error(
            libc::EIO
        ))));
        assert!(retryable(&io_error(io::Error::from_raw_os_error(
            libc::EAGAIN
        ))));
        assert!(!retryable(&io_error(io::Error::from_raw_os_error(
            libc::ENOSPC
        ))));
        assert!(!retryable(&io_error(io::Error::from_raw_os_error(
            libc::EROFS
        ))));
        // librbd's EBLOCKLISTED (what the simulated fence answers too):
        // fenced for good.
        assert!(!retryable(&io_error(io::Error::from_raw_os_error(
            libc::ESHUTDOWN
        ))));
        assert!(!retryable(&io_error(io::Error::new(
            io::ErrorKind::TimedOut,
            "no reply"
        ))));
        assert!(!retryable(&io_error(io::Error::new(
            io::ErrorKind::NotConnected,
            "reconnecting"
        ))));
        assert!(!retryable(&DeviceError::OutOfRange {
            device: "origin".into(),
            op: "write",
            offset: 0,
            len: 1,
            size_bytes: 0,
        }));
    }
}
