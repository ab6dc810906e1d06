//! How a read on a loop's own connection ([`super::loop_channel`]) failed.

/// Why a read on a loop's own connection gave no data.
#[derive(Debug)]
pub(super) enum LoopReadError {
    /// The server answered with this NBD error: final, as on the main
    /// connection.
    Server(u32),
    /// No reply within the request timeout (the connection is torn down).
    TimedOut(String),
    /// The connection broke before the reply came: a read changes nothing,
    /// so the caller may ask again on the main connection.
    Lost(String),
}
