//! Ordered write-back: epoch group by epoch group, checksums verified
//! before anything reaches the origin, origin flushed after each group.
//! Each volume has its own position in the shared log: a step writes back
//! the next group of the volumes standing at the least position it is
//! asked for, and a volume whose origin fails stays where it is while the
//! others go on. This part owns the write-back lock (every origin writer
//! and every origin reader that judges a tag holds it), the pause switch
//! and each origin's health as write-back sees it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use cairn_format::VOLUMES_MAX;

use crate::env::Env;
use crate::error::EngineResult;
use crate::group;
use crate::origin_health::OriginHealth;
use crate::state_lock::StateLock;
use crate::volume_set::VolumeSet;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WritebackProgress {
    pub blocks_written: u64,
    pub groups: u64,
    /// Dirty blocks left after this step.
    pub dirty_blocks: u64,
}

/// Which volumes a write-back step is for.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Want {
    /// The daemon's loop: every volume behind, except those backing off
    /// after a failure of their origin.
    Background,
    /// These volumes (a drain, a write-through write), backoff or not;
    /// others standing at the same group come along unless failing.
    Volumes(VolumeSet),
    /// The volumes at the least write-back position, which pin the tail
    /// (a writer waiting for space).
    Laggards,
}

#[derive(Default)]
pub(crate) struct Writeback {
    /// Serialises write-back, degrading, recalculation, scrubbing and
    /// origin repair: everything that writes the origin or judges a tag.
    serial: Mutex<()>,
    paused: AtomicBool,
    /// Each volume's origin as write-back sees it.
    health: OriginHealth,
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

    /// Is any volume's origin failing?
    pub(crate) fn origin_failing(&self) -> bool {
        !self.health.failing().is_empty()
    }

    /// The last origin error of the first failing volume.
    pub(crate) fn origin_error(&self) -> Option<String> {
        self.health
            .failing()
            .iter()
            .find_map(|id| self.health.error_of(id))
    }

    /// The last error of volume `id`'s origin while it is failing.
    pub(crate) fn volume_origin_error(&self, id: u16) -> Option<String> {
        self.health.error_of(id)
    }

    /// Volume `id` was added or removed: its origin's record starts afresh.
    pub(crate) fn forget_volume(&self, id: u16) {
        self.health.forget(id);
    }

    /// Write back the next epoch group of the volumes `want` names.
    /// Background: an error only if no volume made progress; otherwise an
    /// error if any wanted volume's origin failed.
    pub(crate) fn run_group(
        &self,
        env: &Env,
        state: &StateLock,
        want: Want,
    ) -> EngineResult<WritebackProgress> {
        let _serial = self.lock();
        let Some(step) = self.plan(env, state, want)? else {
            return Ok(WritebackProgress {
                dirty_blocks: state.normal(env)?.index.dirty_blocks(),
                ..Default::default()
            });
        };
        let (records, end) =
            group::read_for_writeback(env, step.start, step.limit, step.slot_count, step.served)?;
        let mut applied = group::apply(env, &records, step.served);
        let mut st = state.normal(env)?;
        group::commit(env, &mut st, step.start, end, &records, &applied);
        let name = |id: u16| {
            st.volumes
                .by_id(id)
                .map_or_else(|| format!("#{id}"), |v| format!("{:?}", v.name))
        };
        for id in applied.done.iter() {
            self.health.succeeded(id, &name(id));
        }
        for (id, e) in &applied.failed {
            self.health.failed(*id, &name(*id), &e.to_string());
        }
        let progress = WritebackProgress {
            blocks_written: applied.blocks_written,
            groups: u64::from(!applied.done.is_empty()),
            dirty_blocks: st.index.dirty_blocks(),
        };
        let must_fail = match want {
            Want::Background => applied.done.is_empty(),
            Want::Volumes(_) | Want::Laggards => true,
        };
        let wanted_failed = applied
            .failed
            .iter()
            .position(|(id, _)| step.wanted.contains(*id));
        match wanted_failed {
            Some(i) if must_fail => Err(applied.failed.swap_remove(i).1),
            _ => Ok(progress),
        }
    }

    /// The group a step writes back: the least position among the wanted
    /// volumes behind the last durable epoch end, and every volume served
    /// at it. `None` if no wanted volume is behind.
    fn plan(&self, env: &Env, state: &StateLock, want: Want) -> EngineResult<Option<Step>> {
        let st = state.normal(env)?;
        let log = &st.log;
        let cursors = log.writeback_cursors();
        let limit = log.writeback_limit();
        let mut behind = VolumeSet::EMPTY;
        for (id, at) in cursors.iter() {
            assert!(at <= limit, "volume {id} wrote back past the durable log");
            if at < limit {
                behind.insert(id);
            }
        }
        let (wanted, along) = match want {
            Want::Background => {
                let wanted = behind.without(self.health.backing_off());
                (wanted, wanted)
            }
            Want::Volumes(set) => (
                behind.intersection(set),
                behind.without(self.health.failing()),
            ),
            Want::Laggards => {
                let laggards = cursors.at(log.writeback_position(), behind);
                (laggards, behind.without(self.health.failing()))
            }
        };
        let start = wanted.iter().filter_map(|id| cursors.get(id)).min();
        Ok(start.map(|start| Step {
            start,
            limit,
            slot_count: log.slot_count(),
            wanted,
            served: cursors.at(start, wanted.union(along)),
        }))
    }

    /// Write back every complete group of `volumes`, then persist the
    /// write-back positions. The caller flushed first, so every
    /// acknowledged write is in a complete group.
    pub(crate) fn drain(
        &self,
        env: &Env,
        state: &StateLock,
        volumes: VolumeSet,
        progress: &mut impl FnMut(&WritebackProgress),
    ) -> EngineResult<WritebackProgress> {
        let mut total = WritebackProgress::default();
        // Bounded: each step moves at least one wanted volume's position
        // forward by at least a record.
        let steps_max = (env.layout.log_blocks + 1) * VOLUMES_MAX as u64;
        for _ in 0..steps_max {
            let step = self.run_group(env, state, Want::Volumes(volumes))?;
            total.blocks_written += step.blocks_written;
            total.groups += step.groups;
            total.dirty_blocks = step.dirty_blocks;
            progress(&total);
            if step.groups == 0 {
                break;
            }
        }
        let mut st = state.normal(env)?;
        if total.groups > 0 || st.log.writeback_persisted() != st.log.writeback_position() {
            st.persist_writeback(env)?;
        }
        total.dirty_blocks = st.index.dirty_blocks();
        Ok(total)
    }
}

/// One write-back step's group.
struct Step {
    start: u64,
    limit: u64,
    slot_count: u64,
    /// The volumes the caller asked for (their failure is its error).
    wanted: VolumeSet,
    /// Every volume whose position is `start` and that this step serves.
    served: VolumeSet,
}
