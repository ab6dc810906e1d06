//! [`CommandError`]: why an admin request failed, online or offline.

use cairn_engine::EngineError;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("cache {cache} was formatted without integrity tags, so the origin has no tags to check against")]
    NoIntegrity { cache: String },
    #[error("{0}")]
    BadSettings(String),
    #[error("{0}")]
    VolumeOrigin(String),
    #[error("volume {name:?} has {connections} clients connected to its export")]
    VolumeInUse { name: String, connections: usize },
    #[error("the volume was added to the cache, but not exported: {0}")]
    Export(String),
    #[error("range of {length_bytes} bytes at offset {offset_bytes} runs past the end of the {size_bytes}-byte volume")]
    RangePastEnd {
        offset_bytes: u64,
        length_bytes: u64,
        size_bytes: u64,
    },
}
