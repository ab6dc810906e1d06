//! [`ClaimMode`]: what a cache may do about an origin's existing claim.

/// When a cache claims its origin, and so what it accepts finding there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimMode {
    /// `format`: the origin may be unclaimed, claimed by this cache, or
    /// claimed by `replaces`, the cache that was on this device before
    /// (`format --force` destroys it, dirty blocks and all, by the user's
    /// choice). Any other claim is refused.
    Format { replaces: Option<String> },
    /// `volume add`: unclaimed or claimed by this cache.
    AddVolume,
    /// Every open: claimed by this cache. An unclaimed origin is refused
    /// unless `adopt` (`--force-origin`, the user saying this origin is
    /// the volume's): it may have been released and written by another
    /// cache since, which this cache's replay would roll back.
    Open { adopt: bool },
}
