//! [`ExportEntry`]: one export of the registry, with the connections that
//! use it.

use std::net::Shutdown;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use crate::export::Export;
use crate::server::listener::Stream;

/// One registered export. Its connection list is what removal waits on.
pub(crate) struct ExportEntry {
    /// Unique in the process: a session names the export it was promised
    /// by this, not by its name, which a remove and an add can reuse.
    pub(crate) id: u64,
    pub(crate) name: String,
    pub(crate) description: Option<String>,
    pub(crate) read_only: bool,
    pub(crate) export: Arc<dyn Export>,
    users: Mutex<Users>,
    left: Condvar,
}

/// The established connections of an export, by token, each with a handle
/// on its socket to shut it down.
struct Users {
    open: Vec<(u64, Stream)>,
    next_token: u64,
    removing: bool,
}

impl ExportEntry {
    pub(crate) fn new(
        id: u64,
        name: String,
        description: Option<String>,
        read_only: bool,
        export: Arc<dyn Export>,
    ) -> ExportEntry {
        ExportEntry {
            id,
            name,
            description,
            read_only,
            export,
            users: Mutex::new(Users {
                open: Vec::new(),
                next_token: 0,
                removing: false,
            }),
            left: Condvar::new(),
        }
    }

    fn users(&self) -> MutexGuard<'_, Users> {
        // A panic elsewhere must not take the registry down with poison.
        self.users.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn connections(&self) -> usize {
        self.users().open.len()
    }

    pub(crate) fn is_removing(&self) -> bool {
        self.users().removing
    }

    /// Removing, and nothing left to wait for: it can leave the registry.
    pub(crate) fn is_gone(&self) -> bool {
        let users = self.users();
        users.removing && users.open.is_empty()
    }

    /// A connection starts using the export: its token, or `None` if the
    /// export is being removed.
    pub(crate) fn attach(&self, control: Stream) -> Option<u64> {
        let mut users = self.users();
        if users.removing {
            return None;
        }
        let token = users.next_token;
        users.next_token += 1;
        users.open.push((token, control));
        Some(token)
    }

    /// The connection of `token` ended (all its requests are done).
    pub(crate) fn detach(&self, token: u64) {
        let mut users = self.users();
        users.open.retain(|(t, _)| *t != token);
        drop(users);
        self.left.notify_all();
    }

    /// Take no new connections, and shut down the sockets of the
    /// established ones: their clients see the connection end, their
    /// readers see EOF, their requests in flight finish (their replies
    /// cannot be sent) and their tasks end. Returns how many there were.
    pub(crate) fn shut_down(&self) -> usize {
        let mut users = self.users();
        users.removing = true;
        for (_, control) in &users.open {
            control.shutdown(Shutdown::Both);
        }
        users.open.len()
    }

    /// Wait until no connection uses the export, or `deadline` (`None`:
    /// no deadline); the connections still open.
    pub(crate) fn wait_unused(&self, deadline: Option<Instant>) -> usize {
        let mut users = self.users();
        while !users.open.is_empty() {
            let Some(deadline) = deadline else {
                users = self
                    .left
                    .wait(users)
                    .unwrap_or_else(PoisonError::into_inner);
                continue;
            };
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            users = self
                .left
                .wait_timeout(users, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        users.open.len()
    }
}
