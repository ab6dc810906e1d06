//! [`ExportList`]: a fixed set of exports, for a server whose exports do
//! not change while it runs, and for tests and the fuzz harness.

use super::{ExportCatalog, ExportInfo};

/// A fixed [`ExportCatalog`]. Names are matched byte for byte; the empty
/// name selects the default export: the one named by
/// [`ExportList::with_default`], else the export named `""`, else none.
/// With duplicate names the first one wins.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportList {
    exports: Vec<ExportInfo>,
    default_name: Option<String>,
}

impl ExportList {
    /// These exports, listed in this order, with no default beyond the
    /// export named `""` (if there is one).
    pub fn new(exports: Vec<ExportInfo>) -> Self {
        ExportList {
            exports,
            default_name: None,
        }
    }

    /// One export, which is also the default: the empty name selects it
    /// whatever its own name is (how a one-export server always behaved).
    pub fn single(export: ExportInfo) -> Self {
        let default_name = Some(export.name.clone());
        ExportList {
            exports: vec![export],
            default_name,
        }
    }

    /// Make the empty name select the export called `name`.
    pub fn with_default(mut self, name: &str) -> Self {
        self.default_name = Some(name.to_string());
        self
    }

    pub fn exports(&self) -> &[ExportInfo] {
        &self.exports
    }
}

impl ExportCatalog for ExportList {
    fn lookup(&self, name: &[u8]) -> Option<ExportInfo> {
        let wanted = match (name.is_empty(), &self.default_name) {
            (true, Some(default)) => default.as_bytes(),
            _ => name,
        };
        self.exports
            .iter()
            .find(|export| export.name.as_bytes() == wanted)
            .cloned()
    }

    fn list(&self, visit: &mut dyn FnMut(&str, Option<&str>) -> bool) {
        for export in &self.exports {
            if !visit(&export.name, export.description.as_deref()) {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::BlockSizes;

    fn export(id: u64, name: &str) -> ExportInfo {
        ExportInfo {
            id,
            name: name.to_string(),
            description: None,
            size_bytes: 4096 * (id + 1),
            read_only: false,
            block_sizes: BlockSizes::default(),
            extended_headers: true,
        }
    }

    #[test]
    fn the_empty_name_selects_the_default_export_or_none() {
        let single = ExportList::single(export(7, "disk"));
        assert_eq!(single.lookup(b"").map(|e| e.id), Some(7));
        assert_eq!(single.lookup(b"disk").map(|e| e.id), Some(7));
        assert_eq!(single.lookup(b"other"), None);

        let several = ExportList::new(vec![export(1, "a"), export(2, "b")]);
        assert_eq!(several.lookup(b""), None, "no export named \"\"");
        assert_eq!(several.lookup(b"b").map(|e| e.id), Some(2));
        assert_eq!(several.lookup(b"B"), None, "names are exact");
        let with_empty = ExportList::new(vec![export(1, "a"), export(3, "")]);
        assert_eq!(with_empty.lookup(b"").map(|e| e.id), Some(3));
        let defaulted = several.clone().with_default("b");
        assert_eq!(defaulted.lookup(b"").map(|e| e.name), Some("b".to_string()));
        let dangling = several.with_default("gone");
        assert_eq!(dangling.lookup(b""), None, "a default that names nothing");
    }

    #[test]
    fn list_visits_in_order_until_told_to_stop() {
        let list = ExportList::new(vec![export(1, "a"), export(2, "b"), export(3, "c")]);
        let mut seen = Vec::new();
        list.list(&mut |name, _| {
            seen.push(name.to_string());
            seen.len() < 2
        });
        assert_eq!(seen, ["a", "b"]);
    }
}
