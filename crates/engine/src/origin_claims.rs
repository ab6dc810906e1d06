//! Claiming origins for this cache (see [`cairn_device::OriginClaim`]):
//! the claim a cache makes, and the error when an origin refuses it.

use cairn_device::{ClaimMode, Device, OriginClaim};

use crate::error::{EngineError, EngineResult};

/// This cache's claim, described by the host and cache device so another
/// cache's refusal says where the holder is.
pub(crate) fn claim_of(cache: &dyn Device, uuid: &[u8; 16], mode: ClaimMode) -> OriginClaim {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    let host = if host.is_empty() { "unknown" } else { &host };
    // A relative path means nothing to the operator of another cache.
    let cache_name = std::fs::canonicalize(cache.name())
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| cache.name().to_string());
    OriginClaim {
        cache_uuid: OriginClaim::format_uuid(uuid),
        // Spaces would split the stored value's words: the uuid is the
        // first, and the rest is only read by people.
        description: format!("host={host} cache={}", cache_name.replace(' ', "%20")),
        mode,
    }
}

/// Claim `origin` for the cache, or the error naming who holds it.
pub(crate) fn claim(
    cache: &dyn Device,
    origin: &dyn Device,
    uuid: &[u8; 16],
    mode: ClaimMode,
) -> EngineResult<()> {
    origin
        .claim(&claim_of(cache, uuid, mode))
        .map_err(EngineError::Origin)
}

/// Release the cache's claim on `origin` once its volume is gone. A
/// failure leaves the claim (the origin refuses other caches until it is
/// removed by hand), so it is reported, not fatal.
pub(crate) fn release(origin: &dyn Device, uuid: &[u8; 16]) {
    let cache_uuid = OriginClaim::format_uuid(uuid);
    if let Err(e) = origin.release_claim(&cache_uuid) {
        tracing::warn!(
            origin = origin.name(),
            cache = cache_uuid.as_str(),
            error = %e,
            "could not release this cache's claim on the removed volume's origin; other caches refuse it until the claim is removed by hand"
        );
    }
}
