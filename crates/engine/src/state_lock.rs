//! The engine lock: the [`State`] behind one mutex, taken with the check
//! the caller's path needs.

use std::sync::{Mutex, MutexGuard};

use crate::env::Env;
use crate::error::EngineResult;
use crate::state::State;

pub(crate) struct StateLock {
    inner: Mutex<State>,
}

impl StateLock {
    pub(crate) fn new(state: State) -> StateLock {
        StateLock {
            inner: Mutex::new(state),
        }
    }

    /// The state with no check, for status and for the degrade switch
    /// itself. A panic elsewhere must not take every later request down
    /// with poison.
    pub(crate) fn unchecked(&self) -> MutexGuard<'_, State> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The state, for the normal (cache-writing) paths: fails once the
    /// engine stopped, and with `DegradeRequired` once a cache write failed
    /// for good or the engine went degraded (the request is then re-run on
    /// the degraded path).
    pub(crate) fn normal(&self, env: &Env) -> EngineResult<MutexGuard<'_, State>> {
        let guard = self.unchecked();
        env.health.check_normal()?;
        Ok(guard)
    }

    /// The state, for paths valid in every state but stopped (reads,
    /// checks, degraded writes). They never write the cache device when it
    /// is degraded or about to be.
    pub(crate) fn running(&self, env: &Env) -> EngineResult<MutexGuard<'_, State>> {
        let guard = self.unchecked();
        env.health.check_running()?;
        Ok(guard)
    }
}
