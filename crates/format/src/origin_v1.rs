//! The one origin of a format 1 cache, as its superblock describes it. In
//! format 2 the same facts are volume 0's entry in the volume table.

use crate::settings::StoredSettings;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OriginV1 {
    /// Opaque text naming the origin (path, device id or URI).
    pub origin_identity: String,
    pub origin_size_bytes: u64,
    /// Persisted cache mode (engine-defined code).
    pub mode: u8,
    /// Origin integrity: every origin block below this address has had its
    /// tag computed.
    pub recalc_position_blocks: u64,
    /// Policy settings stored with `cairn set`.
    pub settings: StoredSettings,
}
