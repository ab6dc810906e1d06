//! [`Attachment`]: a connection's hold on the export it serves.

use std::sync::Arc;

use super::entry::ExportEntry;
use crate::export::Export;

/// Held by a connection from the end of its handshake until its last
/// request is done; counts it among the export's established connections
/// (and lets a forced removal shut its socket). Dropping it detaches.
pub(crate) struct Attachment {
    entry: Arc<ExportEntry>,
    token: u64,
}

impl Attachment {
    pub(super) fn new(entry: Arc<ExportEntry>, token: u64) -> Attachment {
        Attachment { entry, token }
    }

    pub(crate) fn export(&self) -> &Arc<dyn Export> {
        &self.entry.export
    }

    pub(crate) fn name(&self) -> &str {
        &self.entry.name
    }

    /// The export is being removed (the connection was shut down for it).
    pub(crate) fn removed(&self) -> bool {
        self.entry.is_removing()
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        self.entry.detach(self.token);
    }
}
