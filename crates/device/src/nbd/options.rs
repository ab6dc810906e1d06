//! Tuning for the NBD client.

/// Tuning for [`super::NbdDevice`]. Every field is a bound, so nothing
/// waits forever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NbdOptions {
    /// A request with no reply after this long fails (and the connection is
    /// torn down and re-established).
    pub request_timeout_ms: u64,
    /// Bound on connecting plus the handshake.
    pub connect_timeout_ms: u64,
    /// After the connection drops, requests wait this long for a reconnect
    /// before failing; later requests fail at once until the server is back.
    pub reconnect_wait_ms: u64,
    /// First delay between reconnect attempts; doubles after each failure.
    pub backoff_initial_ms: u64,
    /// Longest delay between reconnect attempts.
    pub backoff_max_ms: u64,
    /// Most requests in flight on the connection at once.
    pub max_in_flight: usize,
    /// Let each event loop read its misses on a connection of its own
    /// (only where the server promises multi-conn consistency); see
    /// `loop_channel`.
    pub loop_connections: bool,
}

impl Default for NbdOptions {
    fn default() -> Self {
        NbdOptions {
            request_timeout_ms: 30_000,
            connect_timeout_ms: 10_000,
            reconnect_wait_ms: 5_000,
            backoff_initial_ms: 100,
            backoff_max_ms: 5_000,
            max_in_flight: 64,
            loop_connections: true,
        }
    }
}
