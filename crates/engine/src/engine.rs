//! The engine: its parts behind one lock, the switch to degraded mode, and
//! the entry points every caller uses. The work itself is done by the
//! parts (`log`, `index`, `tags`, `policy`, `writeback`) and the request
//! paths (`read`, `write`, `degrade`, `integrity`). The write entry points
//! are in `engine/writes.rs`.

use std::sync::{Arc, Mutex};

use cairn_device::Device;
use cairn_format::{
    block_checksum, block_key, StoredSettings, Superblock, VolumeEntry, VolumeTable,
    ORIGIN_BLOCKS_MAX,
};

use crate::block_status::{self, BlockStatusRun};
use crate::checkpoint;
use crate::commit::GroupCommit;
use crate::degrade;
use crate::env::Env;
use crate::error::{EngineError, EngineResult};
use crate::flush_by::FlushBy;
use crate::format;
use crate::integrity::{self, RecalcProgress, ScrubOptions, ScrubReport};
use crate::open::{self, OriginResolver};
use crate::options::{FormatOptions, OpenOptions};
use crate::parts::Parts;
use crate::policy::{CacheMode, Policy};
use crate::read::{self, Scope};
use crate::read_data::ReadData;
use crate::read_kind::ReadKind;
use crate::state_lock::StateLock;
use crate::stats::{Counters, StatsSnapshot};
use crate::superblocks;
use crate::volume_admin::{self, NewVolume};
use crate::volume_set::VolumeSet;
use crate::volume_status::VolumeStatus;
use crate::want::Want;
use crate::write;
use crate::writeback::{Writeback, WritebackProgress};

mod writes;

pub struct Engine {
    env: Env,
    state: StateLock,
    writeback: Writeback,
    policy: Policy,
    commit: GroupCommit,
    degraded_writes: Mutex<()>,
}

impl Engine {
    // ----------------------------------------------------------------- setup

    /// Format `cache` for `origin`. Refuses to overwrite an existing cairn
    /// cache unless `opts.force`.
    pub fn format(
        cache: Arc<dyn Device>,
        origin: Arc<dyn Device>,
        opts: &FormatOptions,
    ) -> EngineResult<Superblock> {
        format::format(cache, origin, opts)
    }

    /// Read and validate the newest superblock of a cache device.
    pub fn read_superblock(cache: &dyn Device) -> EngineResult<Superblock> {
        superblocks::read_newest(cache)
    }

    /// Read the volumes a cache device serves, from the volume table its
    /// newest superblock names (a format 1 cache: its one origin, as the
    /// table an upgrade will write).
    pub fn read_volume_table(cache: &dyn Device) -> EngineResult<VolumeTable> {
        let superblock = superblocks::read_newest(cache)?;
        superblocks::read_table(cache, &superblock)
    }

    /// Open a formatted cache of one volume on `origin`: load the newest
    /// checkpoint, replay the log. A cache of several volumes needs each
    /// one's origin: [`Engine::open_volumes`].
    pub fn open(
        cache: Arc<dyn Device>,
        origin: Arc<dyn Device>,
        opts: &OpenOptions,
    ) -> EngineResult<Engine> {
        Self::open_volumes(
            cache,
            &mut |volume: &VolumeEntry| {
                if volume.id == 0 {
                    Ok(origin.clone())
                } else {
                    Err(EngineError::VolumeOriginMissing {
                        name: volume.name.clone(),
                        origin: volume.origin_identity.clone(),
                    })
                }
            },
            opts,
        )
    }

    /// Open a formatted cache, asking `resolve` for each volume's origin.
    pub fn open_volumes(
        cache: Arc<dyn Device>,
        resolve: &mut OriginResolver<'_>,
        opts: &OpenOptions,
    ) -> EngineResult<Engine> {
        Ok(Self::of_opened(open::open(cache, resolve, opts)?))
    }

    /// The engine over what an open (or an inspection) recovered.
    pub(crate) fn of_opened(opened: open::Opened) -> Engine {
        let policy = Policy::new(CacheMode::WriteBack, &opened.env.config);
        for &(id, mode) in &opened.modes {
            policy.set_mode_of(id, mode);
        }
        Engine {
            env: opened.env,
            state: StateLock::new(opened.state),
            writeback: Writeback::default(),
            policy,
            commit: GroupCommit::default(),
            degraded_writes: Mutex::new(()),
        }
    }

    pub(crate) fn parts(&self) -> Parts<'_> {
        Parts {
            env: &self.env,
            state: &self.state,
            writeback: &self.writeback,
            policy: &self.policy,
            commit: &self.commit,
            degraded_writes: &self.degraded_writes,
        }
    }

    // --------------------------------------------------- degraded switching

    /// Is the engine in degraded mode (the cache device is no longer used
    /// for writes)?
    pub fn is_degraded(&self) -> bool {
        self.env.health.is_degraded()
    }

    /// Run a request on the path for the engine's state: `op(false)` on the
    /// normal path, `op(true)` on the degraded one. If the normal path
    /// fails because a cache write failed for good (here or on another
    /// thread), switch to degraded mode and run the request again,
    /// degraded. Every request wrapped this way is idempotent: re-running
    /// it writes the same bytes again.
    fn with_degrade<T>(&self, mut op: impl FnMut(bool) -> EngineResult<T>) -> EngineResult<T> {
        let degraded = self.is_degraded();
        match op(degraded) {
            Err(e) if !degraded => {
                if self.env.health.wants_degraded_path()? {
                    degrade::enter(self.parts())?;
                    tracing::debug!("re-running a request on the degraded path after: {e}");
                    op(true)
                } else {
                    Err(e)
                }
            }
            result => result,
        }
    }

    // ------------------------------------------------------------ geometry

    pub fn block_size_bytes(&self) -> u32 {
        self.env.block_size_bytes as u32
    }

    pub fn size_bytes(&self) -> u64 {
        self.env.volume_blocks * self.env.block_size_bytes as u64
    }

    /// The cache device's name (its path), for messages.
    pub fn cache_name(&self) -> &str {
        self.env.cache.name()
    }

    pub fn superblock(&self) -> Superblock {
        self.state.unchecked().superblock.clone()
    }

    /// The volumes, as the volume table last written says.
    pub fn volume_table(&self) -> VolumeTable {
        self.state.unchecked().volumes.clone()
    }

    /// The first volume (id 0, the one format made), as last written.
    pub fn volume(&self) -> VolumeEntry {
        let st = self.state.unchecked();
        st.volumes
            .by_id(0)
            .expect("volume 0 is served for the engine's life")
            .clone()
    }

    /// How many volumes the cache serves.
    pub fn volume_count(&self) -> usize {
        self.state.unchecked().volumes.volumes().len()
    }

    /// Every volume with its blocks in the cache, in table order.
    pub fn volumes_status(&self) -> Vec<VolumeStatus> {
        crate::volume_status::statuses(self.parts())
    }

    /// Add a volume on `origin` while the cache is open; its requests go
    /// through the `*_in` entry points with the id of the entry returned.
    pub fn add_volume(
        &self,
        origin: Arc<dyn Device>,
        new: &NewVolume,
    ) -> EngineResult<VolumeEntry> {
        volume_admin::add(self.parts(), origin, new)
    }

    /// Volume `name`'s entry, if [`Engine::remove_volume`] may remove it
    /// (it exists and is not the first volume); asked before a daemon
    /// stops its export.
    pub fn removable_volume(&self, name: &str) -> EngineResult<VolumeEntry> {
        volume_admin::removable(&self.state.unchecked().volumes, name)
    }

    /// Remove volume `name`: take no new request for it, write back all
    /// its dirty data (with everything else's), drop its cached copies and
    /// its table entry. Its origin then holds everything acknowledged to
    /// it. The first volume stays. On a failure (its origin cannot be
    /// written) the volume is served again and nothing is lost.
    pub fn remove_volume(&self, name: &str) -> EngineResult<VolumeEntry> {
        let entry = volume_admin::close(self.parts(), name)?;
        // Only this volume is drained: another volume's failing origin
        // does not stop a removal.
        let removed = self
            .drain_volumes(VolumeSet::single(entry.id), &mut |_| {})
            .and_then(|_| volume_admin::forget(self.parts(), &entry));
        match removed {
            Ok(()) => Ok(entry),
            Err(e) => {
                volume_admin::reopen(self.parts(), &entry);
                Err(e)
            }
        }
    }

    /// Set volume `name`'s dirty share: `Some(pct)` percent of the log
    /// (1-100), `None` the default for the number of volumes. It applies
    /// to the next write; stored in the volume table.
    pub fn set_volume_dirty_share(&self, name: &str, pct: Option<u8>) -> EngineResult<()> {
        volume_admin::set_dirty_share(self.parts(), name, pct)
    }

    /// The size of volume `volume` in bytes.
    pub fn volume_size_bytes(&self, volume: u16) -> EngineResult<u64> {
        let origin = self
            .env
            .origins
            .get(volume)
            .ok_or(EngineError::NoSuchVolume { volume_id: volume })?;
        Ok(origin.blocks * self.env.block_size_bytes as u64)
    }

    /// Check that `[offset, offset + length_bytes)` lies inside `volume`,
    /// and return where `offset` is in the key space every part of the
    /// engine below the entry points works in (block `key` at byte
    /// `key * block_size_bytes`; see `cairn_format::block_key`).
    fn key_offset(&self, volume: u16, offset: u64, length_bytes: u64) -> EngineResult<u64> {
        // A volume being removed takes no new request.
        let size_bytes = self
            .env
            .origins
            .taking_blocks(volume)
            .ok_or(EngineError::NoSuchVolume { volume_id: volume })?
            * self.env.block_size_bytes as u64;
        match offset.checked_add(length_bytes) {
            Some(end) if end <= size_bytes => {
                let base_bytes = block_key(volume, 0) * self.env.block_size_bytes as u64;
                Ok(base_bytes + offset)
            }
            _ => Err(EngineError::OutOfRange {
                offset,
                length_bytes,
                size_bytes,
            }),
        }
    }

    // --------------------------------------------------------------- reads

    /// Read `buf.len()` bytes at `offset` of the first volume. Any
    /// alignment is accepted.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> EngineResult<()> {
        self.read_in(0, offset, buf)
    }

    /// Read `buf.len()` bytes at `offset` of `volume`.
    pub fn read_in(&self, volume: u16, offset: u64, buf: &mut [u8]) -> EngineResult<()> {
        let data = cairn_io::block_on(self.read_async_in(volume, offset, buf.len(), false))?;
        buf.copy_from_slice(data.as_bytes());
        Ok(())
    }

    /// Read and promote every missed block, ignoring the sequential cutoff
    /// and the n-hit policy: a prefetch (NBD CACHE, `cairn warm`).
    pub fn read_uncut(&self, offset: u64, buf: &mut [u8]) -> EngineResult<()> {
        self.read_uncut_in(0, offset, buf)
    }

    /// [`Engine::read_uncut`] of `volume`.
    pub fn read_uncut_in(&self, volume: u16, offset: u64, buf: &mut [u8]) -> EngineResult<()> {
        let data = cairn_io::block_on(self.read_async_in(volume, offset, buf.len(), true))?;
        buf.copy_from_slice(data.as_bytes());
        Ok(())
    }

    /// [`Engine::read`] as a task: the cache and origin reads are all in
    /// flight together while other tasks run, and the data comes back in
    /// a page-aligned buffer (an NBD reply is sent straight from it).
    /// `prefetch` is [`Engine::read_uncut`].
    pub async fn read_async(
        &self,
        offset: u64,
        length_bytes: usize,
        prefetch: bool,
    ) -> EngineResult<ReadData> {
        self.read_async_in(0, offset, length_bytes, prefetch).await
    }

    /// [`Engine::read_async`] of `volume`.
    pub async fn read_async_in(
        &self,
        volume: u16,
        offset: u64,
        length_bytes: usize,
        prefetch: bool,
    ) -> EngineResult<ReadData> {
        let offset = self.key_offset(volume, offset, length_bytes as u64)?;
        let (c, kind) = (&self.env.counters, ReadKind::of(prefetch));
        if let (Some(requests), Some(bytes)) = (kind.requests(c), kind.bytes(c)) {
            Counters::add(requests, 1);
            Counters::add(bytes, length_bytes as u64);
        }
        let block_bytes = self.env.block_size_bytes as u64;
        let first = offset / block_bytes * block_bytes;
        let end = (offset + length_bytes as u64).div_ceil(block_bytes) * block_bytes;
        let mut buf = self.env.read_bufs.lend((end - first) as usize);
        buf.set_len((end - first) as usize);
        let data = |buf| ReadData {
            buf,
            start: (offset - first) as usize,
            len: length_bytes,
        };
        if length_bytes == 0 {
            return Ok(data(buf));
        }
        let bypassed = !prefetch && self.policy.observe_read(offset, length_bytes as u64);
        let scope = Scope::All {
            promote: self.policy.promotes_misses(volume, bypassed),
            bypassed,
            kind,
        };
        // Reads take the same path in every state; only promotion (a cache
        // write) stops once the cache is degraded. A promotion that hits a
        // cache write failure re-runs the read after the switch.
        let was_degraded = self.is_degraded();
        let (result, buf) = read::read_blocks(self.parts(), first, buf, scope).await;
        match result.expect("a read of every scope is served") {
            Ok(()) => Ok(data(buf)),
            Err(e) if !was_degraded && self.env.health.wants_degraded_path()? => {
                // If the switch cannot be made now, the read's own error is
                // the one to report.
                if degrade::enter(self.parts()).is_err() {
                    return Err(e);
                }
                tracing::debug!("re-running a read on the degraded path after: {e}");
                let (result, buf) = read::read_blocks(self.parts(), first, buf, scope).await;
                result
                    .expect("a read of every scope is served")
                    .map(|()| data(buf))
            }
            Err(e) => Err(e),
        }
    }

    /// Serve those of `requests` whose every block is cached: `result[i]`
    /// is the outcome of `requests[i]` as [`Engine::read`] would give it,
    /// or `None` if the request was left untouched (not wholly cached,
    /// unaligned or out of range); serve those with [`Engine::read`].
    pub fn read_cached_many(
        &self,
        requests: &mut [(u64, &mut [u8])],
    ) -> Vec<Option<EngineResult<()>>> {
        self.read_cached_many_in(0, requests)
    }

    /// [`Engine::read_cached_many`] of `volume`.
    pub fn read_cached_many_in(
        &self,
        volume: u16,
        requests: &mut [(u64, &mut [u8])],
    ) -> Vec<Option<EngineResult<()>>> {
        let block_bytes = self.env.block_size_bytes as u64;
        let servable = |offset: u64, len: u64| {
            if len == 0 || !offset.is_multiple_of(block_bytes) || !len.is_multiple_of(block_bytes) {
                return None;
            }
            self.key_offset(volume, offset, len).ok()
        };
        let reads: Vec<_> = requests
            .iter()
            .map(|(offset, buf)| {
                let key_offset = servable(*offset, buf.len() as u64);
                let mut data = self.env.read_bufs.lend(buf.len());
                data.set_len(buf.len());
                async move {
                    let Some(offset) = key_offset else {
                        return (None, data);
                    };
                    read::read_blocks(self.parts(), offset, data, Scope::CachedOnly).await
                }
            })
            .collect();
        let served = cairn_io::block_on(cairn_io::join_all(reads));
        let mut results = Vec::with_capacity(requests.len());
        for ((offset, buf), (result, data)) in requests.iter_mut().zip(served) {
            if let Some(Ok(())) = &result {
                buf.copy_from_slice(&data);
            }
            if result.is_some() {
                // Counted like a single read, and seen by the sequential
                // detector like one.
                let c = &self.env.counters;
                Counters::add(&c.reads, 1);
                Counters::add(&c.read_bytes, buf.len() as u64);
                if let Ok(offset) = self.key_offset(volume, *offset, buf.len() as u64) {
                    self.policy.observe_read(offset, buf.len() as u64);
                }
            }
            results.push(result);
        }
        results
    }

    /// What `[offset, offset + length)` holds, as runs from `offset` that
    /// cover at least one byte (NBD block status, `base:allocation`): data
    /// where anything may be, zeroes only where that is certain (see
    /// `block_status`). `offset` must be inside the volume, `length` > 0.
    pub fn block_status(&self, offset: u64, length: u64) -> EngineResult<Vec<BlockStatusRun>> {
        self.block_status_in(0, offset, length)
    }

    /// [`Engine::block_status`] of `volume`.
    pub fn block_status_in(
        &self,
        volume: u16,
        offset: u64,
        length: u64,
    ) -> EngineResult<Vec<BlockStatusRun>> {
        cairn_io::block_on(self.block_status_async_in(volume, offset, length))
    }

    /// [`Engine::block_status_in`] as a task: a question to an origin that
    /// answers over the network is waited for as a task.
    pub async fn block_status_async_in(
        &self,
        volume: u16,
        offset: u64,
        length: u64,
    ) -> EngineResult<Vec<BlockStatusRun>> {
        let key_offset = self.key_offset(volume, offset, length.max(1))?;
        block_status::block_status(&self.env, &self.state, key_offset, length.max(1)).await
    }

    /// Is block `lba` of the first volume cached (for tests)?
    pub fn is_cached(&self, lba: u64) -> bool {
        self.is_cached_in(0, lba)
    }

    /// Is block `lba` of `volume` cached (for tests)?
    pub fn is_cached_in(&self, volume: u16, lba: u64) -> bool {
        lba <= ORIGIN_BLOCKS_MAX
            && (volume as usize) < cairn_format::VOLUMES_MAX
            && self
                .state
                .unchecked()
                .index
                .is_cached(block_key(volume, lba))
    }

    /// Make every write acknowledged so far durable. Costs one cache barrier
    /// when there is something to persist, none otherwise, and shares it
    /// with every flush made meanwhile.
    pub fn flush(&self) -> EngineResult<()> {
        cairn_io::block_on(self.flush_async())
    }

    /// [`Engine::flush`] as a task: waiting for the barrier holds no thread.
    pub async fn flush_async(&self) -> EngineResult<()> {
        self.flush_volumes(None).await
    }

    /// A client's flush on `volume`'s export: the cache barrier is shared
    /// by every volume, but degraded (writes go to the origins) only that
    /// volume's origin is flushed, so a failing origin of another volume
    /// does not fail it.
    pub async fn flush_async_in(&self, volume: u16) -> EngineResult<()> {
        self.flush_volumes(Some(volume)).await
    }

    /// [`Engine::flush_async_in`], blocking.
    pub fn flush_in(&self, volume: u16) -> EngineResult<()> {
        cairn_io::block_on(self.flush_async_in(volume))
    }

    async fn flush_volumes(&self, volume: Option<u16>) -> EngineResult<()> {
        Counters::add(&self.env.counters.flushes, 1);
        if !self.is_degraded() {
            self.flush_cached(FlushBy::Client).await?;
        }
        if self.is_degraded() {
            return degrade::degraded_flush(self.parts(), volume);
        }
        Ok(())
    }

    /// A client flush on the normal path; a cache write that failed for
    /// good switches to degraded mode here (the caller then flushes the
    /// origin: `drain` wrote every acknowledged write there).
    async fn flush_cached(&self, by: FlushBy) -> EngineResult<()> {
        match write::flush(self.parts(), by).await {
            // Another thread may have finished the switch meanwhile:
            // `enter` is idempotent.
            Err(e) if self.env.health.wants_degraded_path()? => {
                degrade::enter(self.parts())?;
                tracing::debug!("a flush switched to degraded mode after: {e}");
                Ok(())
            }
            result => result,
        }
    }

    /// End the epoch in progress, so write-back can go on with it: a
    /// barrier like a client's flush (made outside the engine lock, shared
    /// with client flushes in progress), counted as `internal_flushes`.
    /// For the daemon's periodic epoch end; degraded, nothing is cached to
    /// end an epoch of.
    pub fn end_epoch(&self) -> EngineResult<()> {
        Counters::add(&self.env.counters.internal_flushes, 1);
        if self.is_degraded() {
            return Ok(());
        }
        cairn_io::block_on(self.flush_cached(FlushBy::Engine))
    }

    /// A flush the engine needs for itself (not counted as a client flush).
    fn flush_internal(&self) -> EngineResult<()> {
        self.state.normal(&self.env)?.flush(&self.env)
    }

    // ---------------------------------------------------------------- modes

    pub fn mode(&self) -> CacheMode {
        self.policy.mode()
    }

    /// Switch the cache mode online. New writes follow the new mode at
    /// once; leaving write-back drains the dirty data first (with progress).
    /// The mode is persisted in the volume table.
    pub fn set_mode(
        &self,
        mode: CacheMode,
        progress: impl FnMut(&WritebackProgress),
    ) -> EngineResult<WritebackProgress> {
        self.set_mode_of(0, mode, progress)
    }

    /// [`Engine::set_mode`] of volume `name`.
    pub fn set_volume_mode(
        &self,
        name: &str,
        mode: CacheMode,
        progress: impl FnMut(&WritebackProgress),
    ) -> EngineResult<WritebackProgress> {
        let id = volume_admin::id_of(&self.state.unchecked().volumes, name)?;
        self.set_mode_of(id, mode, progress)
    }

    fn set_mode_of(
        &self,
        id: u16,
        mode: CacheMode,
        mut progress: impl FnMut(&WritebackProgress),
    ) -> EngineResult<WritebackProgress> {
        self.with_degrade(|degraded| {
            if degraded {
                return Err(EngineError::CacheDegraded {
                    device: self.env.cache.name().to_string(),
                    action: format!("switching to mode {}", mode.name()),
                });
            }
            // A mode change is a management action: everything
            // acknowledged before it is made durable first.
            self.flush_internal()?;
            {
                let mut st = self.state.normal(&self.env)?;
                let table =
                    volume_admin::changed(&self.env, &st.volumes, id, |v| v.mode = mode.code())?;
                st.write_volume_table(&self.env, table)?;
                // Under the engine lock, after the table: a volume removed
                // meanwhile is refused above and keeps its slot's mode.
                self.policy.set_mode_of(id, mode);
            }
            if mode == CacheMode::WriteBack {
                return Ok(WritebackProgress {
                    dirty_blocks: self.state.normal(&self.env)?.index.dirty_blocks(),
                    ..Default::default()
                });
            }
            // Only this volume's dirty data must reach its origin now: its
            // new writes go through, and a volume left dirty would be
            // written back to an origin the user now trusts to be current.
            // The mode is recorded already; a drain that fails says so, so
            // the user knows what state the volume is in.
            self.drain_cached(VolumeSet::single(id), &mut progress)
                .map_err(|e| EngineError::ModeSetNotDrained {
                    mode: mode.name(),
                    dirty_blocks: self.stats().dirty_blocks,
                    source: Box::new(e),
                })
        })
    }

    // ------------------------------------------------------------ settings

    /// The policy settings stored in the cache (`cairn set`).
    pub fn stored_settings(&self) -> StoredSettings {
        self.volume().settings
    }

    /// Store policy settings in the cache, in the volume table (a torn
    /// write leaves the previous table, with the previous settings). A
    /// degraded cache takes no writes: refused, like a mode change.
    pub fn store_settings(&self, settings: StoredSettings) -> EngineResult<()> {
        let mut st = self.state.normal(&self.env)?;
        let table = volume_admin::changed(&self.env, &st.volumes, 0, |v| v.settings = settings)?;
        st.write_volume_table(&self.env, table)
    }

    /// Change the read policy while serving: the sequential cutoff (0
    /// disables it) and n-hit promotion (1 = promote every miss).
    pub fn set_read_policy(&self, sequential_cutoff_bytes: u64, promote_after_misses: u32) {
        self.policy
            .set_read_policy(sequential_cutoff_bytes, promote_after_misses);
    }

    // ----------------------------------------------------------- write-back

    pub fn set_writeback_paused(&self, paused: bool) {
        self.writeback.set_paused(paused);
    }

    pub fn writeback_paused(&self) -> bool {
        self.writeback.paused()
    }

    /// Run the write-back steps that requests on event loops wait for (a
    /// full log, a volume at its dirty share, write-through writes) until
    /// `stop`: the daemon runs this on threads of its own, so those
    /// requests wait as tasks. Without such a thread, each writer runs the
    /// steps it needs in its own thread.
    pub fn serve_writeback_requests(&self, stop: &std::sync::atomic::AtomicBool) {
        self.writeback.serve_requests(&self.env, &self.state, stop);
    }

    /// Threads in [`Engine::serve_writeback_requests`] now (a thread counts
    /// from when it has started serving; until then requests run their
    /// steps themselves).
    pub fn writeback_request_servers(&self) -> usize {
        self.writeback.request_servers()
    }

    /// Wake the threads in [`Engine::serve_writeback_requests`] once their
    /// stop flag is set, so they return at once. Requests still waiting
    /// then run their steps themselves.
    pub fn wake_writeback_request_servers(&self) {
        self.writeback.wake_request_servers();
    }

    /// One step of background write-back: one epoch group, unless paused.
    /// Returns what was written; zero blocks means nothing was eligible.
    pub fn writeback_step(&self) -> EngineResult<WritebackProgress> {
        self.with_degrade(|degraded| {
            if degraded {
                // Degrading wrote everything back; nothing is dirty since.
                return Ok(WritebackProgress::default());
            }
            if self.writeback.paused() {
                return Ok(WritebackProgress {
                    dirty_blocks: self.state.normal(&self.env)?.index.dirty_blocks(),
                    ..Default::default()
                });
            }
            self.writeback
                .run_group(&self.env, &self.state, Want::Background)
        })
    }

    /// Write back everything: flush, then write back every group, then
    /// persist the write-back position. Runs even when paused.
    pub fn drain(&self) -> EngineResult<WritebackProgress> {
        self.drain_with_progress(|_| {})
    }

    pub fn drain_with_progress(
        &self,
        mut progress: impl FnMut(&WritebackProgress),
    ) -> EngineResult<WritebackProgress> {
        self.drain_volumes(VolumeSet::all(), &mut progress)
    }

    /// [`Engine::drain`] of `volumes` only (degraded: every volume is
    /// on its origin already).
    fn drain_volumes(
        &self,
        volumes: VolumeSet,
        progress: &mut impl FnMut(&WritebackProgress),
    ) -> EngineResult<WritebackProgress> {
        self.with_degrade(|degraded| {
            if degraded {
                degrade::degraded_flush(self.parts(), None)?;
                let p = WritebackProgress {
                    dirty_blocks: self.state.running(&self.env)?.index.dirty_blocks(),
                    ..Default::default()
                };
                progress(&p);
                return Ok(p);
            }
            self.drain_cached(volumes, progress)
        })
    }

    fn drain_cached(
        &self,
        volumes: VolumeSet,
        progress: &mut impl FnMut(&WritebackProgress),
    ) -> EngineResult<WritebackProgress> {
        Counters::add(&self.env.counters.flushes, 1);
        self.flush_internal()?;
        self.writeback
            .drain(&self.env, &self.state, volumes, progress)
    }

    /// The last origin error while write-back to the origin is failing.
    pub fn origin_error(&self) -> Option<String> {
        self.writeback.origin_error()
    }

    // ---------------------------------------------------------- checkpoints

    /// Write a checkpoint of the index (and persist the write-back position).
    /// Degraded: nothing to checkpoint (the cache is not written again).
    pub fn checkpoint(&self) -> EngineResult<()> {
        self.with_degrade(|degraded| {
            if degraded {
                return Ok(());
            }
            checkpoint::write(&self.env, &mut *self.state.normal(&self.env)?)
        })
    }

    /// A clean shutdown has begun: from now on a pending switch to degraded
    /// mode is tried by the next request (the final flushes) without
    /// waiting for its pace, since this is the last chance to get unflushed
    /// writes held in memory to the origin. The engine serves as before.
    pub fn begin_shutdown(&self) {
        self.env.health.set_shutting_down();
    }

    /// Clean shutdown: flush, checkpoint. The engine stays usable.
    /// Degraded: flush the origin (every write is durable there already).
    /// A degrade pending is tried once more, without waiting for its pace
    /// (see [`Engine::begin_shutdown`]).
    pub fn close(&self) -> EngineResult<()> {
        self.begin_shutdown();
        self.with_degrade(|degraded| {
            if degraded {
                return degrade::degraded_flush(self.parts(), None);
            }
            checkpoint::write(&self.env, &mut *self.state.normal(&self.env)?)
        })
    }

    // ------------------------------------------------------------ integrity

    /// Is origin integrity on for this cache?
    pub fn integrity(&self) -> bool {
        self.env.integrity
    }

    /// One step of background recalculation of origin tags (of the first
    /// volume, by id, whose recalculation is not finished).
    pub fn recalc_step(&self) -> EngineResult<RecalcProgress> {
        self.with_degrade(|degraded| {
            if degraded {
                // A degraded cache keeps no tags: nothing to recalculate.
                return Ok(RecalcProgress::default());
            }
            integrity::recalc_step(self.parts())
        })
    }

    /// Recalculate until every origin block of every volume with tags has
    /// a tag (tests, offline use).
    pub fn recalc_all(&self, mut progress: impl FnMut(&RecalcProgress)) -> EngineResult<()> {
        // A step covers at least one block, and a volume's last step may
        // find it moved on (one more).
        let origins = self.env.origins.all();
        let steps_max = origins.iter().map(|v| v.blocks + 1).sum::<u64>() + 1;
        for _ in 0..steps_max {
            let p = self.recalc_step()?;
            progress(&p);
            if p.done() {
                return Ok(());
            }
        }
        Err(EngineError::Failed("recalculation did not finish".into()))
    }

    /// Verify every origin block against its tag, with an optional rate
    /// limit. Mismatching blocks with a clean, verified cached copy are
    /// rewritten from it when `opts.repair`, until one rewrite fails for
    /// good (the rest are then reported as mismatches). Safe while serving.
    pub fn scrub_origin(
        &self,
        opts: &ScrubOptions,
        mut progress: impl FnMut(u64, u64),
    ) -> EngineResult<ScrubReport> {
        self.with_degrade(|degraded| {
            if degraded && self.env.integrity {
                return Err(EngineError::CacheDegraded {
                    device: self.env.cache.name().to_string(),
                    action: "checking the origin against integrity tags".into(),
                });
            }
            integrity::scrub_origin(self.parts(), opts, &mut progress)
        })
    }

    /// Verify every live cached block against its checksum. Returns the
    /// origin addresses (in blocks) that failed.
    pub fn check(&self, mut progress: impl FnMut(u64, u64)) -> EngineResult<Vec<u64>> {
        self.flush()?;
        let slot_count = self.env.layout.log_blocks;
        let mut bad = Vec::new();
        let mut block = vec![0u8; self.env.block_size_bytes];
        for slot in 0..slot_count as u32 {
            let entry = {
                let st = self.state.running(&self.env)?;
                let in_memory = st.log.block_in_memory(slot, self.env.block_size_bytes);
                match in_memory {
                    // Not on the device yet: check the copy in memory.
                    Some(data) => {
                        let (lba, crc) = (st.index.lba(slot), st.index.crc(slot));
                        if st.index.is_live(slot) && block_checksum(lba, data) != crc {
                            bad.push(lba);
                        }
                        None
                    }
                    None => st
                        .index
                        .is_live(slot)
                        .then(|| (st.index.lba(slot), st.index.crc(slot))),
                }
            };
            if let Some((lba, crc)) = entry {
                let ok = self.env.read_slot(slot, &mut block).is_ok()
                    && block_checksum(lba, &block) == crc;
                // Only report if the mapping did not move meanwhile.
                if !ok
                    && self
                        .state
                        .running(&self.env)?
                        .index
                        .still_maps(slot, lba, crc)
                {
                    bad.push(lba);
                }
            }
            if slot % 4096 == 0 || slot as u64 + 1 == slot_count {
                progress(slot as u64 + 1, slot_count);
            }
        }
        Ok(bad)
    }

    // --------------------------------------------------------------- status

    /// Every counter, and the gauges read from the state under its lock.
    pub fn stats(&self) -> StatsSnapshot {
        let (env, writeback, policy) = (&self.env, &self.writeback, &self.policy);
        let st = self.state.unchecked();
        let mut s = StatsSnapshot::default();
        env.counters.fill(&mut s);
        s.lifetime = env.lifetime.totals(&s.counter_pairs());
        let index = &st.index;
        let log = &st.log;
        s.dirty_blocks = index.dirty_blocks();
        s.clean_blocks = index.clean_blocks();
        s.corrupt_blocks = index.corrupt_blocks();
        s.lost_blocks = index.lost_blocks();
        s.cache_blocks = log.slot_count();
        s.free_blocks = log.slot_count() - index.live_blocks().min(log.slot_count());
        s.block_size_bytes = env.block_size_bytes as u64;
        s.volume_size_bytes = env.volume_blocks * env.block_size_bytes as u64;
        s.pending_ranges = index.range_count() as u64;
        s.writeback_offset = log.writeback_position();
        s.head_offset = log.head();
        s.writeback_limit_offset = log.writeback_limit();
        s.tail_offset = log.tail();
        s.index_memory_bytes = index.memory_bytes() as u64;
        s.writeback_paused = writeback.paused();
        s.origin_failing = writeback.origin_failing()
            || env
                .origins
                .all()
                .iter()
                .any(|o| o.device().known_problem().is_some());
        s.origin_fenced = env.health.any_origin_fenced();
        s.mode = policy.mode().name();
        s.policy_memory_bytes = policy.memory_bytes() as u64;
        s.failed = env.health.is_failed();
        // A degraded cache keeps no tags (see `degrade`).
        s.integrity = env.integrity && st.tags.is_some();
        if let Some(tags) = &st.tags {
            s.tag_algorithm = "crc32c(lba_le64 || block)";
            let recalc = integrity::progress_of(&st.tags);
            s.recalc_position_blocks = recalc.position_blocks;
            s.recalc_total_blocks = recalc.total_blocks;
            s.tag_pages_dirty = tags.dirty_pages();
            s.tag_memory_bytes = tags.memory_bytes() as u64;
            if let Ok(area) = cairn_format::TagArea::of(
                st.superblock.features,
                &st.volumes,
                env.block_size_bytes as u32,
            ) {
                s.tag_area_pages = area.pages();
                s.tag_area_free_pages = area.free_pages();
            }
        }
        s.degraded = env.health.is_degraded();
        s.degrading = env.health.is_degrade_pending();
        s.origin_queue_depth = env.origin_slots.total();
        s.origin_queue_in_flight = env.origin_slots.total() - env.origin_slots.available();
        s
    }
}
