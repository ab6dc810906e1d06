//! What the engine lock protects: the superblock as last written, the log,
//! the index and the integrity tags. Each part owns its fields; the few
//! steps that must change several of them together live here.

use cairn_format::Superblock;

use crate::env::Env;
use crate::error::EngineResult;
use crate::index::{Index, Plan};
use crate::log::Log;
use crate::retry::retrying_cache_write;
use crate::superblocks;
use crate::tags::TagTable;

pub(crate) struct State {
    pub(crate) superblock: Superblock,
    pub(crate) log: Log,
    pub(crate) index: Index,
    /// Origin integrity tags, with integrity on (dropped once degraded).
    pub(crate) tags: Option<TagTable>,
}

impl State {
    /// How to serve a read of `lba` (see [`Plan`]).
    pub(crate) fn plan(&mut self, env: &Env, lba: u64, block: &mut [u8]) -> EngineResult<Plan> {
        let log = &self.log;
        let in_memory = |slot| log.block_in_memory(slot, env.block_size_bytes);
        self.index
            .plan(env, in_memory, self.tags.as_ref(), lba, block)
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
            retrying_cache_write(env, "writing integrity tag pages", retry_safe, || {
                tags.persist(env.cache.as_ref(), &env.layout, &env.counters)
            })
            .map_err(|e| {
                env.health
                    .cache_write_failed("writing integrity tag pages", e)
            })?;
            self.superblock.recalc_position_blocks = tags.recalc_pos;
        }
        superblocks::write_next(env, &mut self.superblock, retry_safe)
            .map_err(|e| env.health.cache_write_failed("writing the superblock", e))
    }

    /// Persist the write-back position, so the tail may move past it.
    pub(crate) fn persist_writeback(&mut self, env: &Env) -> EngineResult<()> {
        self.superblock.writeback_offset = self.log.writeback_position();
        self.write_superblock(env)?;
        self.log.writeback_position_persisted();
        Ok(())
    }
}
