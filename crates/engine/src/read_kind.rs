//! Whose read a read is, for the counters: a client's (`reads`,
//! `read_hits`, `read_misses`, `read_zero_hits`: what the hit ratio is
//! made of), a prefetch's (`cairn warm`, NBD CACHE), counted apart in
//! `prefetch_*`, so warming a cache leaves the hit ratio the clients', or
//! a partial write's (the old contents of a block it covers in part, for
//! read-modify-write), counted apart in `write_rmw_*`, so a client that
//! only writes leaves it too.

use std::sync::atomic::AtomicU64;

use crate::stats::Counters;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadKind {
    Client,
    Prefetch,
    /// The old contents of a block a write covers in part.
    WriteBase,
}

impl ReadKind {
    pub(crate) fn of(prefetch: bool) -> Self {
        if prefetch {
            Self::Prefetch
        } else {
            Self::Client
        }
    }

    /// Requests; `None` for a write's base, which is one block of a
    /// write (counted in `write_rmw`), not a request of its own.
    pub(crate) fn requests(self, c: &Counters) -> Option<&AtomicU64> {
        match self {
            Self::Client => Some(&c.reads),
            Self::Prefetch => Some(&c.prefetch_reads),
            Self::WriteBase => None,
        }
    }

    /// Bytes requested; `None` for a write's base (see [`Self::requests`]).
    pub(crate) fn bytes(self, c: &Counters) -> Option<&AtomicU64> {
        match self {
            Self::Client => Some(&c.read_bytes),
            Self::Prefetch => Some(&c.prefetch_bytes),
            Self::WriteBase => None,
        }
    }

    /// Blocks served from the cache (a slot or memory).
    pub(crate) fn hits(self, c: &Counters) -> &AtomicU64 {
        match self {
            Self::Client => &c.read_hits,
            Self::Prefetch => &c.prefetch_hits,
            Self::WriteBase => &c.write_rmw_hits,
        }
    }

    /// Blocks read from the origin.
    pub(crate) fn misses(self, c: &Counters) -> &AtomicU64 {
        match self {
            Self::Client => &c.read_misses,
            Self::Prefetch => &c.prefetch_misses,
            Self::WriteBase => &c.write_rmw_origin_reads,
        }
    }

    /// Blocks known to be zeroes (a pending zero or discard range).
    pub(crate) fn zero_hits(self, c: &Counters) -> &AtomicU64 {
        match self {
            Self::Client => &c.read_zero_hits,
            Self::Prefetch => &c.prefetch_zero_hits,
            Self::WriteBase => &c.write_rmw_zero_hits,
        }
    }
}
