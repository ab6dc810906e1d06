//! [`Exports`]: the named exports a server offers, changed while it runs.
//!
//! Each export has a name (what NBD_OPT_GO, NBD_OPT_INFO and
//! NBD_OPT_EXPORT_NAME select it by), an optional description, a
//! read-only flag, the [`Export`] itself, and the established connections
//! that use it. Exports come and go without disturbing the others; one
//! with connections is removed only by force, which shuts those
//! connections down and waits (bounded) for them to end.
//!
//! **The empty name** selects the *default export*: the export named by
//! [`Exports::set_default`], else the export named `""`, else nothing (the
//! client gets NBD_REP_ERR_UNKNOWN). A one-export server ([`crate::serve`])
//! makes its export the default, so the empty name selects it whatever it
//! is called, as it always did.

mod attachment;
mod entry;
mod error;
mod options;
mod removed;
mod status;

pub(crate) use attachment::Attachment;
pub(crate) use entry::ExportEntry;
pub use error::ExportsError;
pub use options::ExportOptions;
pub use removed::RemovedExport;
pub use status::ExportStatus;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::export::Export;
use crate::proto::MAX_STRING_BYTES;
use crate::server::listener::Stream;
use error::shown;

/// Export ids are unique in the process, across registries.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The set of exports; cloning gives another handle on the same set.
#[derive(Clone, Default)]
pub struct Exports {
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    /// By name, so NBD_OPT_LIST and status list them sorted.
    by_name: BTreeMap<String, Arc<ExportEntry>>,
    /// The export the empty name selects; `None`: the one named "".
    default_name: Option<String>,
}

impl State {
    /// Forget exports whose removal finished after their remover stopped
    /// waiting (see [`ExportsError::StillConnected`]).
    fn prune(&mut self) {
        self.by_name.retain(|_, entry| !entry.is_gone());
    }
}

impl std::fmt::Debug for Exports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state();
        f.debug_struct("Exports")
            .field("names", &state.by_name.keys().collect::<Vec<_>>())
            .field("default_name", &state.default_name)
            .finish()
    }
}

impl Exports {
    /// The most exports one set holds (NBD_OPT_LIST lists them all).
    pub const MAX_EXPORTS: usize = 256;

    /// How long [`Exports::remove`] with force waits for the connections
    /// it shut down to finish their requests.
    pub const REMOVE_WAIT: Duration = Duration::from_secs(30);

    pub fn new() -> Exports {
        Exports::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere must not take the registry down with poison.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Offer `export` as `name`. Clients can select it from now on,
    /// whatever connections to other exports are doing.
    pub fn add(
        &self,
        name: &str,
        export: Arc<dyn Export>,
        options: ExportOptions,
    ) -> Result<(), ExportsError> {
        check_text(name).map_err(|reason| ExportsError::InvalidName {
            name: shown(name),
            reason,
        })?;
        if let Some(text) = &options.description {
            check_text(text).map_err(|reason| ExportsError::InvalidDescription {
                name: shown(name),
                reason,
            })?;
        }
        let mut state = self.state();
        state.prune();
        if let Some(entry) = state.by_name.get(name) {
            return Err(match entry.is_removing() {
                true => ExportsError::Removing {
                    name: shown(name),
                    connections: entry.connections(),
                },
                false => ExportsError::Exists { name: shown(name) },
            });
        }
        if state.by_name.len() >= Self::MAX_EXPORTS {
            return Err(ExportsError::TooMany {
                max: Self::MAX_EXPORTS,
            });
        }
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let entry = ExportEntry::new(
            id,
            name.to_string(),
            options.description,
            options.read_only,
            export,
        );
        state.by_name.insert(name.to_string(), Arc::new(entry));
        tracing::info!(export = name, id, "export added");
        Ok(())
    }

    /// Stop offering `name`, waiting at most [`Exports::REMOVE_WAIT`] for
    /// its connections with `force`; see [`Exports::remove_within`].
    pub fn remove(&self, name: &str, force: bool) -> Result<RemovedExport, ExportsError> {
        self.remove_within(name, force, Self::REMOVE_WAIT)
    }

    /// Stop offering `name`. Without `force`, refused
    /// ([`ExportsError::Busy`]) while any established connection uses it.
    /// With `force`, those connections are shut down (their clients see
    /// the connection end; requests in flight finish, new ones are not
    /// read) and this waits up to `wait` for them to end. From the moment
    /// this is called the export takes no new connection. On success
    /// nothing uses the export any more; on
    /// [`ExportsError::StillConnected`] it goes by itself when they end,
    /// and calling this again waits for that.
    pub fn remove_within(
        &self,
        name: &str,
        force: bool,
        wait: Duration,
    ) -> Result<RemovedExport, ExportsError> {
        let (entry, closed) = {
            let mut state = self.state();
            let Some(entry) = state.by_name.get(name).cloned() else {
                return Err(ExportsError::NotFound { name: shown(name) });
            };
            // Under the registry's lock no connection attaches meanwhile.
            let connections = entry.connections();
            if connections > 0 && !force {
                return Err(ExportsError::Busy {
                    name: shown(name),
                    connections,
                });
            }
            let closed = entry.shut_down();
            if closed == 0 {
                state.by_name.remove(name);
                tracing::info!(export = name, "export removed");
                return Ok(removed(&entry, 0));
            }
            (entry, closed)
        };
        tracing::info!(
            export = name,
            connections = closed,
            "removing export: its connections were shut down"
        );
        // A wait too long to be a deadline is no deadline.
        let left = entry.wait_unused(Instant::now().checked_add(wait));
        let mut state = self.state();
        state.prune();
        if left > 0 {
            return Err(ExportsError::StillConnected {
                name: shown(name),
                connections: left,
                waited: wait,
            });
        }
        if state
            .by_name
            .get(name)
            .is_some_and(|e| Arc::ptr_eq(e, &entry))
        {
            state.by_name.remove(name);
        }
        tracing::info!(export = name, "export removed");
        Ok(removed(&entry, closed))
    }

    /// Make the empty name select the export called `name` (whether or not
    /// it exists yet); `None` restores the rule: the export named "".
    pub fn set_default(&self, name: Option<&str>) {
        self.state().default_name = name.map(str::to_string);
    }

    /// The export called `name` (also while it is being removed).
    pub fn get(&self, name: &str) -> Option<ExportStatus> {
        let entry = {
            let mut state = self.state();
            state.prune();
            state.by_name.get(name).cloned()
        };
        // The export's size is asked outside the registry's lock, which
        // every handshake takes.
        entry.map(|entry| status(&entry))
    }

    /// The export itself, if `name` is offered (not being removed).
    pub fn export(&self, name: &str) -> Option<Arc<dyn Export>> {
        let state = self.state();
        let entry = state.by_name.get(name)?;
        (!entry.is_removing()).then(|| entry.export.clone())
    }

    /// Established connections to `name`.
    pub fn connections(&self, name: &str) -> Option<usize> {
        self.get(name).map(|s| s.connections)
    }

    /// Every export, by name, with its connection count (those being
    /// removed too, marked so).
    pub fn list(&self) -> Vec<ExportStatus> {
        let entries: Vec<Arc<ExportEntry>> = {
            let mut state = self.state();
            state.prune();
            state.by_name.values().cloned().collect()
        };
        entries.iter().map(|entry| status(entry)).collect()
    }

    pub fn len(&self) -> usize {
        let mut state = self.state();
        state.prune();
        state.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The export a client's `name` selects, if it is offered.
    pub(crate) fn resolve(&self, name: &[u8]) -> Option<Arc<ExportEntry>> {
        let state = self.state();
        let wanted = match (name.is_empty(), &state.default_name) {
            (true, Some(default)) => default.as_str(),
            _ => std::str::from_utf8(name).ok()?,
        };
        let entry = state.by_name.get(wanted)?;
        (!entry.is_removing()).then(|| entry.clone())
    }

    /// `visit(name, description)` for each export offered, by name, until
    /// it returns false.
    pub(crate) fn visit(&self, visit: &mut dyn FnMut(&str, Option<&str>) -> bool) {
        let state = self.state();
        for entry in state.by_name.values() {
            if !entry.is_removing() && !visit(&entry.name, entry.description.as_deref()) {
                return;
            }
        }
    }

    /// A connection finished its handshake for the export `id`: its hold
    /// on it, or `None` if that export is no longer offered (removed, or
    /// being removed, since the client chose it).
    pub(crate) fn attach(&self, id: u64, control: Stream) -> Option<Attachment> {
        let state = self.state();
        let entry = state.by_name.values().find(|e| e.id == id)?;
        let token = entry.attach(control)?;
        Some(Attachment::new(entry.clone(), token))
    }

    /// Every export in the set, by name (for the final flush).
    pub(crate) fn all(&self) -> Vec<(String, Arc<dyn Export>)> {
        let state = self.state();
        state
            .by_name
            .values()
            .map(|e| (e.name.clone(), e.export.clone()))
            .collect()
    }
}

fn removed(entry: &ExportEntry, connections_closed: usize) -> RemovedExport {
    RemovedExport {
        name: entry.name.clone(),
        export: entry.export.clone(),
        connections_closed,
    }
}

fn status(entry: &ExportEntry) -> ExportStatus {
    ExportStatus {
        name: entry.name.clone(),
        description: entry.description.clone(),
        size_bytes: entry.export.size_bytes(),
        read_only: entry.read_only,
        connections: entry.connections(),
        removing: entry.is_removing(),
    }
}

/// An NBD string: at most 4096 bytes, no NUL.
fn check_text(text: &str) -> Result<(), &'static str> {
    if text.len() > MAX_STRING_BYTES {
        return Err("longer than the protocol's 4096 bytes");
    }
    if text.contains('\0') {
        return Err("contains a NUL character");
    }
    Ok(())
}

#[cfg(test)]
mod tests;
