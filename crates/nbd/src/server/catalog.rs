//! [`ServerCatalog`]: the server's [`Exports`] as the codec's negotiation
//! sees them, with the server-wide settings filled in.

use crate::codec::{BlockSizes, ExportCatalog, ExportInfo};
use crate::server::exports::Exports;

/// Answers each connection's negotiation from the registry as it is at
/// that option.
pub(crate) struct ServerCatalog {
    pub(crate) exports: Exports,
    pub(crate) block_sizes: BlockSizes,
    /// The server's `read_only`, on top of each export's own.
    pub(crate) read_only: bool,
    pub(crate) extended_headers: bool,
}

impl ExportCatalog for ServerCatalog {
    fn lookup(&self, name: &[u8]) -> Option<ExportInfo> {
        let entry = self.exports.resolve(name)?;
        Some(ExportInfo {
            id: entry.id,
            name: entry.name.clone(),
            description: entry.description.clone(),
            size_bytes: entry.export.size_bytes(),
            read_only: entry.read_only || self.read_only,
            block_sizes: self.block_sizes,
            extended_headers: self.extended_headers,
        })
    }

    fn list(&self, visit: &mut dyn FnMut(&str, Option<&str>) -> bool) {
        self.exports.visit(visit);
    }
}
