//! [`ExportsError`]: why a change to the set of exports was refused.

use std::time::Duration;

/// Why [`super::Exports`] refused a change. Names in messages are cut at
/// 64 characters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExportsError {
    #[error("an export named {name:?} already exists")]
    Exists { name: String },
    #[error("export {name:?} is still being removed ({connections} connection(s) left to end)")]
    Removing { name: String, connections: usize },
    #[error("no export named {name:?}")]
    NotFound { name: String },
    #[error(
        "export {name:?} has {connections} established connection(s); \
         disconnect the clients first, or force the removal to close them"
    )]
    Busy { name: String, connections: usize },
    #[error(
        "export {name:?}: {connections} connection(s) still running {waited:?} after they were \
         shut down (a request is stuck in the export); it takes no new connections and goes \
         when they end: remove it again to wait for that"
    )]
    StillConnected {
        name: String,
        connections: usize,
        waited: Duration,
    },
    #[error("too many exports: at most {max}")]
    TooMany { max: usize },
    #[error("invalid export name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },
    #[error("invalid description for export {name:?}: {reason}")]
    InvalidDescription { name: String, reason: &'static str },
}

/// A name as error messages show it: at most 64 characters.
pub(super) fn shown(name: &str) -> String {
    match name.char_indices().nth(64) {
        Some((at, _)) => format!("{}...", &name[..at]),
        None => name.to_string(),
    }
}
