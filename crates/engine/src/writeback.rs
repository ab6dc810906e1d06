//! Ordered write-back: epoch group by epoch group, checksums verified
//! before anything reaches the origin, origin flushed after each group.
//! Each volume has its own position in the shared log and its own lane: a
//! step writes back the next group of one volume, steps of one volume run
//! one at a time and in log order, and steps of different volumes run at
//! once, so a slow or failing origin holds back only its own volume. This
//! part owns the lanes, the exclusive lock (degrading, recalculation,
//! scrubbing and origin repair take it against every lane), the pause
//! switch and each origin's health as write-back sees it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use cairn_format::VOLUMES_MAX;
use cairn_io::Reactor;

use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::group;
use crate::origin_health::OriginHealth;
use crate::state_lock::StateLock;
use crate::stats::Counters;
use crate::volume_set::VolumeSet;
use crate::want::Want;
use crate::write_lane::{LaneTaken, WriteLane};
use crate::writeback_requests::WritebackRequests;

/// How many times a step looks for its volume again after the one it
/// waited for was written back by another step meanwhile.
const PICK_ATTEMPTS_MAX: usize = 1024;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WritebackProgress {
    pub blocks_written: u64,
    pub groups: u64,
    /// Dirty blocks left after this step.
    pub dirty_blocks: u64,
}

pub(crate) struct Writeback {
    /// Shared by write-back steps, exclusive for everything else that
    /// writes the origin or judges a tag: degrading, recalculation,
    /// scrubbing and origin repair.
    exclusive: RwLock<()>,
    /// One per volume id: that volume's steps, one at a time.
    lanes: [WriteLane; VOLUMES_MAX],
    paused: AtomicBool,
    /// Each volume's origin as write-back sees it.
    health: OriginHealth,
    /// Steps that tasks wait for, run by the daemon's request threads.
    requests: WritebackRequests,
}

impl Default for Writeback {
    fn default() -> Self {
        Writeback {
            exclusive: RwLock::new(()),
            lanes: std::array::from_fn(|_| WriteLane::default()),
            paused: AtomicBool::new(false),
            health: OriginHealth::default(),
            requests: WritebackRequests::default(),
        }
    }
}

impl Writeback {
    /// Stop every lane: no write-back step runs until the guard drops.
    pub(crate) fn lock(&self) -> RwLockWriteGuard<'_, ()> {
        self.exclusive.write().unwrap_or_else(|p| p.into_inner())
    }

    fn shared(&self) -> RwLockReadGuard<'_, ()> {
        self.exclusive.read().unwrap_or_else(|p| p.into_inner())
    }

    fn lane(&self, id: u16) -> &WriteLane {
        &self.lanes[id as usize]
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

    /// Is volume `id`'s origin failing?
    pub(crate) fn volume_origin_failing(&self, id: u16) -> bool {
        self.health.failing().contains(id)
    }

    /// The last error of volume `id`'s origin while it is failing.
    pub(crate) fn volume_origin_error(&self, id: u16) -> Option<String> {
        self.health.error_of(id)
    }

    /// Volume `id` was added or removed: its origin's record starts afresh.
    pub(crate) fn forget_volume(&self, id: u16) {
        self.health.forget(id);
    }

    /// Run the steps that tasks ask for ([`Writeback::step_for`]) until
    /// `stop`: a thread of the daemon's; several may run at once.
    pub(crate) fn serve_requests(&self, env: &Env, state: &StateLock, stop: &AtomicBool) {
        self.requests.serve(stop, |want| {
            Counters::add(&env.counters.writeback_request_steps, 1);
            self.run_group(env, state, want).map(|_| ())
        });
    }

    /// Threads in [`Writeback::serve_requests`] now.
    pub(crate) fn request_servers(&self) -> usize {
        self.requests.servers()
    }

    /// Wake the threads in [`Writeback::serve_requests`] to see their stop.
    pub(crate) fn wake_request_servers(&self) {
        self.requests.wake_servers();
    }

    /// [`Writeback::run_group`] for a caller that only needs it done (a
    /// writer waiting for space, for its dirty share, for its origin). A
    /// reactor task queues it for the request threads and waits as a task,
    /// so its event loop serves its other requests meanwhile, and one step
    /// answers every task waiting for the same; anyone else (or when no
    /// thread serves) runs it here.
    pub(crate) async fn step_for(
        &self,
        env: &Env,
        state: &StateLock,
        want: Want,
    ) -> EngineResult<()> {
        if Reactor::current().is_some() {
            if let Some(answer) = self.requests.submit(want) {
                Counters::add(&env.counters.writeback_requests, 1);
                match answer.await {
                    Ok(Ok(())) => return Ok(()),
                    Ok(Err(failed)) => return Err(WritebackRequests::error_of(failed)),
                    // Nobody serves any more (the daemon is stopping).
                    Err(_) => {}
                }
            }
        }
        self.run_group(env, state, want).map(|_| ())
    }

    /// Write back the next epoch group of one volume that `want` names.
    /// An error if that volume's origin failed.
    pub(crate) fn run_group(
        &self,
        env: &Env,
        state: &StateLock,
        want: Want,
    ) -> EngineResult<WritebackProgress> {
        let _shared = self.shared();
        let picked = match want {
            Want::Through(volume) => self.pick_through(env, state, volume)?,
            _ => self.pick(env, state, want)?,
        };
        let Some((step, _lane)) = picked else {
            return Ok(WritebackProgress {
                dirty_blocks: state.normal(env)?.index.dirty_blocks(),
                ..Default::default()
            });
        };
        let served = VolumeSet::single(step.volume);
        let (records, end) =
            group::read_for_writeback(env, step.start, step.limit, step.slot_count, served)?;
        let mut applied = group::apply(env, &records, served);
        let mut st = state.normal(env)?;
        group::commit(env, &mut st, step.start, end, &records, &applied);
        let name = st
            .volumes
            .by_id(step.volume)
            .map_or_else(|| format!("#{}", step.volume), |v| format!("{:?}", v.name));
        if applied.done.contains(step.volume) {
            self.health.succeeded(step.volume, &name);
            env.health.set_origin_failing(step.volume, false);
        }
        let progress = WritebackProgress {
            blocks_written: applied.blocks_written,
            groups: u64::from(!applied.done.is_empty()),
            dirty_blocks: st.index.dirty_blocks(),
        };
        drop(st);
        match applied.failed.pop() {
            Some((id, e)) => {
                assert_eq!(id, step.volume, "a step writes only its own volume");
                assert!(applied.failed.is_empty());
                self.health.failed(id, &name, &e.to_string());
                env.health.set_origin_failing(id, true);
                note_fence(env, id, &name);
                Err(e)
            }
            None => Ok(progress),
        }
    }

    /// The volume a step writes back and its lane, held: the volume
    /// furthest behind the last durable epoch end among those `want`
    /// names. `None` if none is behind, or, in the background, none
    /// behind has a free lane, or a writer waited for another step.
    fn pick<'a>(
        &'a self,
        env: &Env,
        state: &StateLock,
        want: Want,
    ) -> EngineResult<Option<(Step, LaneTaken<'a>)>> {
        // Bounded: a retry means another step moved the volume waited for.
        for _ in 0..PICK_ATTEMPTS_MAX {
            let candidates = self.candidates(env, state, want)?;
            let Some(&(first, _)) = candidates.first() else {
                return Ok(None);
            };
            let (volume, lane) = match want {
                Want::Background => {
                    match candidates
                        .iter()
                        .find_map(|&(id, _)| self.lane(id).try_take().map(|lane| (id, lane)))
                    {
                        Some(found) => found,
                        None => return Ok(None),
                    }
                }
                Want::Volumes(_) => (first, self.lane(first).take()),
                Want::Progress(_) | Want::Laggards | Want::Through(_) => {
                    match self.lane(first).take_or_wait() {
                        Some(lane) => (first, lane),
                        None => return Ok(None),
                    }
                }
            };
            // With the lane held, this volume's position moves no more.
            let st = state.normal(env)?;
            let log = &st.log;
            let limit = log.writeback_limit();
            match log.writeback_cursors().get(volume) {
                Some(start) if start < limit => {
                    return Ok(Some((
                        Step {
                            volume,
                            start,
                            limit,
                            slot_count: log.slot_count(),
                        },
                        lane,
                    )))
                }
                _ => continue,
            }
        }
        Err(EngineError::Failed(format!(
            "write-back found no turn for its volume after {PICK_ATTEMPTS_MAX} tries"
        )))
    }

    /// [`Writeback::pick`] for [`Want::Through`]: with the volume's lane
    /// held (waiting for a running step of it to end, then returning
    /// without one, as for [`Want::Progress`]), end an epoch if none of
    /// the volume's is left to write back, then its next group. The epoch
    /// ends only with the lane held, right before the step that writes it
    /// back: ended earlier, it would hold only the writes made until then,
    /// and the writes made while the running step finished would need an
    /// epoch and a step of their own.
    fn pick_through<'a>(
        &'a self,
        env: &Env,
        state: &StateLock,
        volume: u16,
    ) -> EngineResult<Option<(Step, LaneTaken<'a>)>> {
        let Some(lane) = self.lane(volume).take_or_wait() else {
            return Ok(None);
        };
        let mut st = state.normal(env)?;
        if st.log.volume_writeback_position(volume) >= Some(st.log.writeback_limit()) {
            Counters::add(&env.counters.internal_flushes, 1);
            st.flush(env)?;
        }
        let log = &st.log;
        let limit = log.writeback_limit();
        Ok(match log.writeback_cursors().get(volume) {
            Some(start) if start < limit => Some((
                Step {
                    volume,
                    start,
                    limit,
                    slot_count: log.slot_count(),
                },
                lane,
            )),
            _ => None,
        })
    }

    /// The volumes behind that `want` names, furthest behind first.
    fn candidates(
        &self,
        env: &Env,
        state: &StateLock,
        want: Want,
    ) -> EngineResult<Vec<(u16, u64)>> {
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
        let wanted = match want {
            Want::Background => behind.without(self.health.backing_off()),
            Want::Volumes(set) | Want::Progress(set) => behind.intersection(set),
            Want::Through(volume) => unreachable!("volume {volume}: picked by pick_through"),
            Want::Laggards => cursors.at(log.writeback_position(), behind),
        };
        let mut candidates: Vec<(u16, u64)> = cursors
            .iter()
            .filter(|&(id, _)| wanted.contains(id))
            .collect();
        candidates.sort_unstable_by_key(|&(id, at)| (at, id));
        Ok(candidates)
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

/// One write-back step's group: volume `volume`'s next one.
struct Step {
    volume: u16,
    start: u64,
    limit: u64,
    slot_count: u64,
}

/// After a failed step: if volume `id`'s origin fenced this process, stop
/// taking the volume's writes (see `Engine::refuse_if_fenced`).
fn note_fence(env: &Env, id: u16, name: &str) {
    let Some(why) = env.origins.get(id).and_then(|o| o.device().fenced()) else {
        return;
    };
    if !env.health.origin_fenced(id) {
        tracing::error!(
            volume = name,
            id,
            "the origin fenced this cairn: new writes to the volume are refused (EIO) until cairn is restarted; the writes acknowledged before stay in the cache and are written back after the restart. {why}"
        );
    }
    env.health.set_origin_fenced(id, true);
}
