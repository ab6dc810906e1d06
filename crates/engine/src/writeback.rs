//! Ordered write-back: epoch group by epoch group, checksums verified
//! before anything reaches the origin, origin flushed after each group.
//! This part owns the write-back lock (every origin writer and every
//! origin reader that judges a tag holds it), the pause switch and the
//! origin's health as write-back sees it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::group;
use crate::state_lock::StateLock;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WritebackProgress {
    pub blocks_written: u64,
    pub groups: u64,
    /// Dirty blocks left after this step.
    pub dirty_blocks: u64,
}

#[derive(Default)]
pub(crate) struct Writeback {
    /// Serialises write-back, degrading, recalculation, scrubbing and
    /// origin repair: everything that writes the origin or judges a tag.
    serial: Mutex<()>,
    paused: AtomicBool,
    /// Set while write-back to the origin keeps failing; the last error is
    /// kept for status.
    origin_failing: AtomicBool,
    origin_last_error: Mutex<Option<String>>,
}

impl Writeback {
    pub(crate) fn lock(&self) -> MutexGuard<'_, ()> {
        self.serial.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn set_paused(&self, paused: bool) {
        self.paused.store(paused, Ordering::Relaxed);
    }

    pub(crate) fn paused(&self) -> bool {
        self.paused.load(Ordering::Relaxed)
    }

    pub(crate) fn origin_failing(&self) -> bool {
        self.origin_failing.load(Ordering::Relaxed)
    }

    /// The last origin error while the origin is failing.
    pub(crate) fn origin_error(&self) -> Option<String> {
        if !self.origin_failing() {
            return None;
        }
        self.origin_last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Write back the oldest complete epoch group, tracking origin health.
    pub(crate) fn run_group(
        &self,
        env: &Env,
        state: &StateLock,
    ) -> EngineResult<WritebackProgress> {
        let result = self.run_group_serial(env, state);
        match &result {
            Err(EngineError::Origin(e)) => {
                if !self.origin_failing.swap(true, Ordering::Relaxed) {
                    tracing::error!("origin is failing; dirty data stays on the cache: {e}");
                }
                *self
                    .origin_last_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
            }
            Ok(p) if p.groups > 0 && self.origin_failing.swap(false, Ordering::Relaxed) => {
                tracing::info!("origin recovered; write-back resumed");
            }
            _ => {}
        }
        result
    }

    /// Write back every complete group, then persist the write-back
    /// position. The caller flushed first, so every acknowledged write is
    /// in a complete group.
    pub(crate) fn drain(
        &self,
        env: &Env,
        state: &StateLock,
        progress: &mut impl FnMut(&WritebackProgress),
    ) -> EngineResult<WritebackProgress> {
        let mut total = WritebackProgress::default();
        // Bounded: each group advances the write-back position.
        for _ in 0..=env.layout.log_blocks {
            let step = self.run_group(env, state)?;
            total.blocks_written += step.blocks_written;
            total.groups += step.groups;
            total.dirty_blocks = step.dirty_blocks;
            progress(&total);
            if step.groups == 0 {
                break;
            }
        }
        let mut st = state.normal(env)?;
        if st.log.writeback_persisted() != st.log.writeback_position() {
            st.persist_writeback(env)?;
        }
        total.dirty_blocks = st.index.dirty_blocks();
        Ok(total)
    }

    /// Read the group from the log and copy it to the origin without the
    /// engine lock (clients keep going), then commit it under the lock.
    fn run_group_serial(&self, env: &Env, state: &StateLock) -> EngineResult<WritebackProgress> {
        let _serial = self.lock();
        let (start, limit, slot_count) = {
            let st = state.normal(env)?;
            (
                st.log.writeback_position(),
                st.log.writeback_limit(),
                st.log.slot_count(),
            )
        };
        if start == limit {
            return Ok(WritebackProgress {
                dirty_blocks: state.normal(env)?.index.dirty_blocks(),
                ..Default::default()
            });
        }
        let (records, end) = group::read_for_writeback(env, start, limit, slot_count)?;
        let applied = group::apply(env, &records)?;
        let mut st = state.normal(env)?;
        group::commit(env, &mut st, start, end, &records, &applied);
        Ok(WritebackProgress {
            blocks_written: applied.blocks_written,
            groups: 1,
            dirty_blocks: st.index.dirty_blocks(),
        })
    }
}
