//! [`RemovedExport`]: what [`super::Exports::remove`] hands back.

use std::sync::Arc;

use crate::export::Export;

/// An export taken out of service: no connection uses it any more and none
/// will, so its owner may flush and close it.
pub struct RemovedExport {
    pub name: String,
    pub export: Arc<dyn Export>,
    /// Established connections that were shut down to remove it (only
    /// with force; 0 otherwise).
    pub connections_closed: usize,
}

impl std::fmt::Debug for RemovedExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemovedExport")
            .field("name", &self.name)
            .field("connections_closed", &self.connections_closed)
            .finish_non_exhaustive()
    }
}
