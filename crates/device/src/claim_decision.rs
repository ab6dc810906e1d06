//! [`ClaimDecision`]: what a claim finds on its origin.

/// The outcome of [`crate::OriginClaim::decide`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimDecision {
    /// The origin holds this cache's claim: nothing to write.
    AlreadyOurs,
    /// Record this cache's claim (the origin is unclaimed, or claimed by
    /// the cache a format replaces).
    Record,
    /// Another cache's claim is there.
    RefuseOther,
    /// No claim is there, and this open needs its own.
    RefuseUnclaimed,
}
