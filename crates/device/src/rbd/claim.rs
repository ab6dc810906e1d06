//! An RBD image's claim: the image metadata key [`CLAIM_KEY`] names the
//! cache that writes back to it (see [`crate::OriginClaim`]).
//!
//! Image metadata lives in the image's header object, survives every
//! client's crash, and is what `rbd image-meta` shows and edits, so an
//! operator can see and, when a cache is gone for good, remove it. Setting
//! it while the exclusive lock is held (format and serve hold it) makes
//! check-then-set safe against another cache doing the same.

use super::handles::Handles;
use crate::{ClaimDecision, ClaimMode, OriginClaim};

/// The metadata key holding the claiming cache's uuid and description.
pub(super) const CLAIM_KEY: &str = "cairn.cache";

/// Check `claim` against the image's metadata and record it where its mode
/// allows. `Err` is the message for the user (the image and what to do).
pub(super) fn claim_image(
    handles: &Handles,
    image_path: &str,
    claim: &OriginClaim,
) -> Result<(), String> {
    let stored = handles
        .metadata_get(CLAIM_KEY)
        .map_err(|e| format!("cannot read the image's metadata {CLAIM_KEY}: {e}"))?;
    let record = match claim.decide(stored.as_deref()) {
        ClaimDecision::AlreadyOurs => false,
        ClaimDecision::Record => {
            if stored.is_some() {
                tracing::warn!(
                    image = image_path,
                    previous = stored.as_deref().unwrap_or_default(),
                    "the image was claimed by the cache this format replaces; it is this cache's now"
                );
            } else if claim.mode == (ClaimMode::Open { adopt: true }) {
                tracing::warn!(
                    image = image_path,
                    cache = claim.cache_uuid.as_str(),
                    "the image carried no cache's claim; claimed for this cache (--force)"
                );
            }
            true
        }
        ClaimDecision::RefuseUnclaimed => {
            return Err(format!(
                "the image carries no claim by this cache ({uuid}): it was released (its image metadata {CLAIM_KEY} removed), or this cache was formatted by a cairn that did not claim images. Another cache may have written to it since, and this cache's unwritten blocks would then roll those writes back. If none has, claim it again with `rbd image-meta set {image_path} {CLAIM_KEY} {uuid}` or `cairn serve --force`",
                uuid = claim.cache_uuid
            ));
        }
        ClaimDecision::RefuseOther if stored.as_deref().is_some_and(|s| claim.same_place_as(s)) => {
            return Err(format!(
                "the image is claimed by an earlier cache on this same device ({}), which has been formatted again since (for another origin, with no claim on this image passed on). If that earlier cache's unwritten data was wanted, it is gone with that format; release the stale claim with `rbd image-meta remove {image_path} {CLAIM_KEY}` and try again",
                stored.as_deref().unwrap_or_default()
            ));
        }
        ClaimDecision::RefuseOther => {
            return Err(format!(
                "the image belongs to another cairn cache ({}): two caches writing back to one image roll back each other's writes. Use that cache; if it is gone for good and none of its unwritten data is wanted, release the image with `rbd image-meta remove {image_path} {CLAIM_KEY}` and try again",
                stored.as_deref().unwrap_or_default()
            ));
        }
    };
    if record {
        handles
            .metadata_set(CLAIM_KEY, &claim.stored_value())
            .map_err(|e| {
                format!("cannot record this cache's claim in the image's metadata {CLAIM_KEY}: {e}")
            })?;
    }
    Ok(())
}

/// Remove `cache_uuid`'s claim; another cache's stays.
pub(super) fn release_image(handles: &Handles, cache_uuid: &str) -> Result<(), String> {
    let stored = handles
        .metadata_get(CLAIM_KEY)
        .map_err(|e| format!("cannot read the image's metadata {CLAIM_KEY}: {e}"))?;
    match stored.as_deref().map(OriginClaim::uuid_of_stored) {
        Some(holder) if holder == cache_uuid => handles
            .metadata_remove(CLAIM_KEY)
            .map_err(|e| format!("cannot remove this cache's claim ({CLAIM_KEY}): {e}")),
        _ => Ok(()),
    }
}
