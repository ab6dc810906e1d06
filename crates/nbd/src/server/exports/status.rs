//! [`ExportStatus`]: one export as status output and metrics see it.

/// One export, as [`super::Exports::list`] and [`super::Exports::get`]
/// report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportStatus {
    pub name: String,
    pub description: Option<String>,
    pub size_bytes: u64,
    /// Read-only by its own options (the server may add its own).
    pub read_only: bool,
    /// Established connections (past NBD_OPT_GO or EXPORT_NAME) serving it.
    pub connections: usize,
    /// Being removed: it takes no new connections and goes once the
    /// `connections` left (already shut down) have ended.
    pub removing: bool,
}
