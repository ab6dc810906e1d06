//! What the engine lock protects: the superblock and the volume table as
//! last written, the log, the index and the integrity tags. Each part owns its fields; the few
//! steps that must change several of them together live here.

use cairn_format::{Superblock, SuperblockVolumes, VolumeTable};

use crate::env::Env;
use crate::error::EngineResult;
use crate::index::{Index, Plan};
use crate::log::Log;
use crate::read_kind::ReadKind;
use crate::retry::retrying_cache_write;
use crate::superblocks;
use crate::tags::TagTable;

pub(crate) struct State {
    pub(crate) superblock: Superblock,
    /// The volumes (format 2: the table the superblock names; a degraded
    /// format 1 cache: its origin, in memory only).
    pub(crate) volumes: VolumeTable,
    pub(crate) log: Log,
    pub(crate) index: Index,
    /// Origin integrity tags, with integrity on (dropped once degraded).
    pub(crate) tags: Option<TagTable>,
}

impl State {
    /// How to serve a read of `lba` (see [`Plan`]), counted as `kind`'s.
    pub(crate) fn plan(
        &mut self,
        env: &Env,
        lba: u64,
        kind: ReadKind,
        block: &mut [u8],
    ) -> EngineResult<Plan> {
        let log = &self.log;
        let in_memory = |slot| log.block_in_memory(slot, env.block_size_bytes);
        self.index
            .plan(env, in_memory, self.tags.as_ref(), lba, kind, block)
    }

    /// Seal and make durable everything acknowledged so far.
    pub(crate) fn flush(&mut self, env: &Env) -> EngineResult<()> {
        self.log.flush(env, &mut self.index)
    }

    /// Write the superblock durably, integrity tag pages first: a
    /// superblock never advances the write-back or recalculation position
    /// past tags that are not durable.
    pub(crate) fn write_superblock(&mut self, env: &Env) -> EngineResult<()> {
        // Retrying is safe only if no sealed record waits for a barrier.
        let retry_safe = self.log.unsynced_blocks() == 0;
        if let Some(tags) = self.tags.as_mut() {
            // A failed persist changes nothing, so it is retried whole.
            // Watched whole (retries included), so only a final failure
            // counts against the barriers beside it.
            env.syncs
                .watch(|| {
                    retrying_cache_write(env, "writing integrity tag pages", retry_safe, || {
                        tags.persist(env.cache.as_ref(), &env.layout, &env.counters)
                    })
                })
                .map_err(|e| {
                    env.health
                        .cache_write_failed("writing integrity tag pages", e)
                })?;
            for volume in tags.volumes() {
                let (id, at) = (volume.volume_id, volume.recalc_pos);
                superblocks::set_recalc_position(&mut self.superblock, id, at);
            }
        }
        // Every superblock carries each volume's write-back position as
        // memory has it: each is true (its groups are on the origin,
        // flushed), and a later one lets the tail move on sooner.
        superblocks::set_writeback_positions(&mut self.superblock, self.log.writeback_cursors());
        superblocks::write_next(env, &mut self.superblock, retry_safe)
            .map_err(|e| env.health.cache_write_failed("writing the superblock", e))?;
        self.log.writeback_position_persisted();
        Ok(())
    }

    /// Make `table` the volume table: written into the copy the current
    /// superblock does not name, durably, then named by the next
    /// superblock. A crash before that superblock is durable leaves the
    /// current pair (superblock and table) in charge.
    pub(crate) fn write_volume_table(
        &mut self,
        env: &Env,
        mut table: VolumeTable,
    ) -> EngineResult<()> {
        let SuperblockVolumes::V2 { table_sequence, .. } = &mut self.superblock.volumes else {
            // Only a degraded format 1 cache keeps a v1 superblock, and
            // degraded mode never writes the cache.
            unreachable!("the volume table of a format 1 cache is never written");
        };
        table.sequence = *table_sequence + 1;
        let retry_safe = self.log.unsynced_blocks() == 0;
        env.syncs
            .watch(|| {
                retrying_cache_write(env, "writing the volume table", retry_safe, || {
                    superblocks::write_table(env.cache.as_ref(), &table)
                })
            })
            .map_err(|e| env.health.cache_write_failed("writing the volume table", e))?;
        let named = std::mem::replace(table_sequence, table.sequence);
        if let Err(e) = self.write_superblock(env) {
            // The superblock on the device may name either table; both are
            // intact (the new one went into the other copy), and the next
            // superblock names the old one again, as memory does.
            if let SuperblockVolumes::V2 { table_sequence, .. } = &mut self.superblock.volumes {
                *table_sequence = named;
            }
            return Err(e);
        }
        self.volumes = table;
        Ok(())
    }

    /// Persist the write-back position, so the tail may move past it.
    pub(crate) fn persist_writeback(&mut self, env: &Env) -> EngineResult<()> {
        self.write_superblock(env)
    }
}
