//! [`ExportCatalog`]: what the negotiation asks of the server about its
//! exports. The codec stays pure: the server answers from memory (a list,
//! a registry behind a lock), never with I/O.

use super::ExportInfo;

/// The most NBD_REP_SERVER replies one NBD_OPT_LIST gets, whatever the
/// catalog holds, so one option's reply stays bounded.
pub const MAX_LISTED_EXPORTS: usize = 1024;

/// The exports a server offers, as its negotiation sees them.
///
/// Both methods may be called from any connection's thread at any time, so
/// an implementation whose exports change at run time answers each call
/// from its current state: a name the client saw in a LIST may be unknown
/// by the time of its GO.
pub trait ExportCatalog: Send + Sync {
    /// The export that `name` (as the client sent it) selects, or `None`
    /// (NBD_REP_ERR_UNKNOWN; EXPORT_NAME ends the session). The empty name
    /// is the default export, if the catalog has one. The returned
    /// [`ExportInfo::name`] is the canonical name (NBD_INFO_NAME).
    fn lookup(&self, name: &[u8]) -> Option<ExportInfo>;

    /// Call `visit(name, description)` for each export NBD_OPT_LIST shows,
    /// in a stable order, until it returns `false` (the codec stops after
    /// [`MAX_LISTED_EXPORTS`]).
    fn list(&self, visit: &mut dyn FnMut(&str, Option<&str>) -> bool);
}
