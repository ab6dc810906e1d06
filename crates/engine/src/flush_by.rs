//! Who asked for a flush: what it is counted as.

/// A flush of the cache (a barrier over everything sealed) is asked for
/// by a client (FLUSH, FUA) or by the engine itself (the periodic end of
/// an epoch, so write-back can go on). Both are the same barrier; only
/// the counters differ: `flushes` and `flush_barriers` count the clients'
/// (and `flushes_per_barrier` is theirs), `internal_flushes` the engine's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FlushBy {
    Client,
    Engine,
}
