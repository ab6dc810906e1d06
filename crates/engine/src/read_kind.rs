//! Whose read a read is, for the counters: a client's (`reads`,
//! `read_hits`, `read_misses`, `read_zero_hits`: what the hit ratio is
//! made of) or a prefetch's (`cairn warm`, NBD CACHE), counted apart in
//! `prefetch_*`, so warming a cache leaves the hit ratio the clients'.

use std::sync::atomic::AtomicU64;

use crate::stats::Counters;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadKind {
    Client,
    Prefetch,
}

impl ReadKind {
    pub(crate) fn of(prefetch: bool) -> Self {
        if prefetch {
            Self::Prefetch
        } else {
            Self::Client
        }
    }

    /// Requests.
    pub(crate) fn requests(self, c: &Counters) -> &AtomicU64 {
        match self {
            Self::Client => &c.reads,
            Self::Prefetch => &c.prefetch_reads,
        }
    }

    pub(crate) fn bytes(self, c: &Counters) -> &AtomicU64 {
        match self {
            Self::Client => &c.read_bytes,
            Self::Prefetch => &c.prefetch_bytes,
        }
    }

    /// Blocks served from the cache (a slot or memory).
    pub(crate) fn hits(self, c: &Counters) -> &AtomicU64 {
        match self {
            Self::Client => &c.read_hits,
            Self::Prefetch => &c.prefetch_hits,
        }
    }

    /// Blocks read from the origin.
    pub(crate) fn misses(self, c: &Counters) -> &AtomicU64 {
        match self {
            Self::Client => &c.read_misses,
            Self::Prefetch => &c.prefetch_misses,
        }
    }

    /// Blocks known to be zeroes (a pending zero or discard range).
    pub(crate) fn zero_hits(self, c: &Counters) -> &AtomicU64 {
        match self {
            Self::Client => &c.read_zero_hits,
            Self::Prefetch => &c.prefetch_zero_hits,
        }
    }
}
