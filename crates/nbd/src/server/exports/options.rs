//! [`ExportOptions`]: how one export is offered.

/// How an export is offered, beside its name and the export itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportOptions {
    /// Free text for people: the text after the name in NBD_OPT_LIST's
    /// reply and NBD_INFO_DESCRIPTION. At most 4096 bytes, no NUL.
    pub description: Option<String>,
    /// Advertise READ_ONLY and refuse writes with EPERM, for this export
    /// (the server's own `read_only` applies to every export).
    pub read_only: bool,
}
