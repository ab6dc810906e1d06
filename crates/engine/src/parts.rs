//! The engine's parts, borrowed together by the request paths (read,
//! write, degraded mode, integrity), so each path names what it uses and
//! no part needs to know the `Engine` type.

use std::sync::Mutex;

use crate::commit::GroupCommit;
use crate::env::Env;
use crate::policy::Policy;
use crate::state_lock::StateLock;
use crate::writeback::Writeback;

#[derive(Clone, Copy)]
pub(crate) struct Parts<'a> {
    pub(crate) env: &'a Env,
    pub(crate) state: &'a StateLock,
    pub(crate) writeback: &'a Writeback,
    pub(crate) policy: &'a Policy,
    pub(crate) commit: &'a GroupCommit,
    /// Serialises degraded-mode writes, zeroes and discards: a partial
    /// block is read, patched and written whole, and two of those on the
    /// same block must not interleave.
    pub(crate) degraded_writes: &'a Mutex<()>,
}
