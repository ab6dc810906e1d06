//! Counters of the NBD client: the live atomics and the snapshot callers
//! read.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of one [`super::NbdDevice`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NbdStats {
    /// Requests sent (reads, writes, flushes, trims, zeroes).
    pub requests: u64,
    /// Successful connections after the first.
    pub reconnects: u64,
    /// Connections lost (server gone, protocol error or timeout).
    pub connection_losses: u64,
    /// Requests that got no reply in time.
    pub timeouts: u64,
    /// Most requests ever in flight at once (on the main connection).
    pub peak_in_flight: u64,
    /// Reads answered on an event loop's own connection rather than the
    /// main one (see `loop_channel`).
    pub loop_reads: u64,
    /// Such connections opened.
    pub loop_connections: u64,
    /// Sends of requests on those connections: each carries every request
    /// the loop queued since the last one (one per pass of the loop).
    pub loop_sends: u64,
}

/// The live counters, shared by the device, its link and its connections.
#[derive(Default)]
pub(super) struct Counters {
    pub requests: AtomicU64,
    pub reconnects: AtomicU64,
    pub connection_losses: AtomicU64,
    pub timeouts: AtomicU64,
    pub peak_in_flight: AtomicU64,
    pub loop_reads: AtomicU64,
    pub loop_connections: AtomicU64,
    pub loop_sends: AtomicU64,
}

impl Counters {
    pub fn snapshot(&self) -> NbdStats {
        NbdStats {
            requests: self.requests.load(Ordering::Relaxed),
            reconnects: self.reconnects.load(Ordering::Relaxed),
            connection_losses: self.connection_losses.load(Ordering::Relaxed),
            timeouts: self.timeouts.load(Ordering::Relaxed),
            peak_in_flight: self.peak_in_flight.load(Ordering::Relaxed),
            loop_reads: self.loop_reads.load(Ordering::Relaxed),
            loop_connections: self.loop_connections.load(Ordering::Relaxed),
            loop_sends: self.loop_sends.load(Ordering::Relaxed),
        }
    }
}
