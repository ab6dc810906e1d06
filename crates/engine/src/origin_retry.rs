//! Which origin errors are worth asking again at once.

use cairn_device::DeviceError;

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
