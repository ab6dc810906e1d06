//! The write entry points: writes, zeroes and discards, into the log (or,
//! degraded, to the origin), through to the origin in the modes other
//! than write-back, and refused for a volume whose origin fenced cairn.

use cairn_format::RangeKind;
use cairn_io::Reactor;

use super::Engine;
use crate::degrade;
use crate::error::{EngineError, EngineResult};
use crate::policy::CacheMode;
use crate::read;
use crate::stats::Counters;
use crate::write::{self, Waits, WriteStep};

impl Engine {
    /// Write `data` at `offset`. With `fua`, the data is durable on return.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> EngineResult<()> {
        self.write_in(0, offset, data, fua)
    }

    /// [`Engine::write`] to `volume`.
    pub fn write_in(&self, volume: u16, offset: u64, data: &[u8], fua: bool) -> EngineResult<()> {
        cairn_io::block_on(self.write_async_in(volume, offset, data, fua))
    }

    /// [`Engine::write`] as a task: a FUA write waits for its barrier
    /// without holding a thread.
    pub async fn write_async(&self, offset: u64, data: &[u8], fua: bool) -> EngineResult<()> {
        self.write_async_in(0, offset, data, fua).await
    }

    /// [`Engine::write_async`] to `volume`.
    pub async fn write_async_in(
        &self,
        volume: u16,
        offset: u64,
        data: &[u8],
        fua: bool,
    ) -> EngineResult<()> {
        let offset = self.key_offset(volume, offset, data.len() as u64)?;
        self.refuse_if_fenced(volume)?;
        let c = &self.env.counters;
        Counters::add(&c.writes, 1);
        Counters::add(&c.write_bytes, data.len() as u64);
        if fua {
            Counters::add(&c.fua_writes, 1);
        }
        self.write_at_key(volume, offset, data, fua).await
    }

    /// A write of `data` at byte `offset` of the key space (in `volume`),
    /// counted by the caller: into the log (or, degraded, to the origin),
    /// through to the origin in the modes other than write-back, durable
    /// first if `fua`.
    async fn write_at_key(
        &self,
        volume: u16,
        offset: u64,
        data: &[u8],
        fua: bool,
    ) -> EngineResult<()> {
        let logged_to = if self.is_degraded() {
            degrade::degraded_write(self.parts(), offset, data)?;
            None
        } else {
            match self.write_logged(offset, data).await {
                Ok(end_position) => Some(end_position),
                Err(e) => {
                    // A cache write failed for good: the data is still in
                    // memory, and the degraded path writes the origin.
                    if !self.env.health.wants_degraded_path()? {
                        return Err(e);
                    }
                    degrade::enter(self.parts())?;
                    tracing::debug!("re-running a write on the degraded path after: {e}");
                    degrade::degraded_write(self.parts(), offset, data)?;
                    None
                }
            }
        };
        let mode = self.policy.mode_of(volume);
        // A write in the log, to the position given (else degraded: on the
        // origin already, durable).
        let Some(end_position) = logged_to else {
            return Ok(());
        };
        if mode != CacheMode::WriteBack {
            let block_bytes = self.env.block_size_bytes as u64;
            let (first, end) = (
                offset / block_bytes,
                (offset + data.len() as u64).div_ceil(block_bytes),
            );
            let through = write::write_through_async(self.parts(), mode, first, end, end_position);
            if let Err(e) = through.await {
                // The switch to degraded mode (made here, or by another
                // request meanwhile) writes every acknowledged write to
                // the origin, this one included.
                if !self.env.health.wants_degraded_path()? {
                    return Err(e);
                }
                degrade::enter(self.parts())?;
            }
        }
        if fua {
            self.flush_cached(crate::flush_by::FlushBy::Client).await?;
        }
        Ok(())
    }

    /// Put a write into the log; returns the log position past its data. where it must wait for write-back (space,
    /// its dirty share), it waits as a task, then goes on where it stopped.
    async fn write_logged(&self, offset: u64, data: &[u8]) -> EngineResult<u64> {
        let mut rounds = write::WaitRounds::default();
        let mut from = offset;
        // Bounded: every wait is a round `write_from` counts, and it fails
        // the write after `SPACE_RETRIES_MAX` of each kind.
        loop {
            let parts = self.parts();
            match write::write_from(parts, offset, data, from, Waits::Caller, &mut rounds)? {
                WriteStep::Done {
                    sealed,
                    end_position,
                } => {
                    crate::sealed::write_claimed(&self.env, sealed).await?;
                    return Ok(end_position);
                }
                WriteStep::NeedsWriteback {
                    resume_at,
                    want,
                    sealed,
                } => {
                    crate::sealed::write_claimed(&self.env, sealed).await?;
                    let step = self.writeback.step_for(&self.env, &self.state, want).await;
                    if let Err(e) = step {
                        let retry_in = rounds.step_failed(&self.env, e)?;
                        match Reactor::current() {
                            Some(reactor) => reactor.sleep(retry_in).await,
                            None => std::thread::sleep(retry_in),
                        }
                    }
                    from = resume_at;
                }
                WriteStep::NeedsOriginBlock {
                    resume_at,
                    key,
                    stamp,
                    sealed,
                } => {
                    crate::sealed::write_claimed(&self.env, sealed).await?;
                    // The lock is not held: other requests go on while the
                    // origin answers, within its queue depth.
                    let data = read::read_origin_block(&self.env, key).await?;
                    rounds
                        .partial
                        .fetched(write::OriginBlock { key, stamp, data });
                    from = resume_at;
                }
            }
        }
    }

    /// Zero a range. Whole blocks become a logged zero range (no data is
    /// written); partial blocks at the edges are zeroed by read-modify-write.
    pub fn write_zeroes(&self, offset: u64, length_bytes: u64) -> EngineResult<()> {
        self.write_zeroes_in(0, offset, length_bytes)
    }

    /// [`Engine::write_zeroes`] of `volume`.
    pub fn write_zeroes_in(&self, volume: u16, offset: u64, length_bytes: u64) -> EngineResult<()> {
        Counters::add(&self.env.counters.write_zeroes, 1);
        self.zero_range(volume, offset, length_bytes, RangeKind::Zero)
    }

    /// Discard a range: cached copies are dropped and the origin is sent a
    /// discard, in order. Whole blocks read back as zeroes afterwards;
    /// partial blocks at the edges are left alone (discard is a hint).
    pub fn discard(&self, offset: u64, length_bytes: u64) -> EngineResult<()> {
        self.discard_in(0, offset, length_bytes)
    }

    /// [`Engine::discard`] of `volume`.
    pub fn discard_in(&self, volume: u16, offset: u64, length_bytes: u64) -> EngineResult<()> {
        Counters::add(&self.env.counters.discards, 1);
        self.zero_range(volume, offset, length_bytes, RangeKind::Discard)
    }

    /// [`Engine::write_zeroes_in`] as a task: in the modes other than
    /// write-back, the wait for the origin is the task's.
    pub async fn write_zeroes_async_in(
        &self,
        volume: u16,
        offset: u64,
        length_bytes: u64,
    ) -> EngineResult<()> {
        Counters::add(&self.env.counters.write_zeroes, 1);
        self.zero_range_async(volume, offset, length_bytes, RangeKind::Zero)
            .await
    }

    /// [`Engine::discard_in`] as a task.
    pub async fn discard_async_in(
        &self,
        volume: u16,
        offset: u64,
        length_bytes: u64,
    ) -> EngineResult<()> {
        Counters::add(&self.env.counters.discards, 1);
        self.zero_range_async(volume, offset, length_bytes, RangeKind::Discard)
            .await
    }

    async fn zero_range_async(
        &self,
        volume: u16,
        offset: u64,
        length_bytes: u64,
        kind: RangeKind,
    ) -> EngineResult<()> {
        let mut offset = self.key_offset(volume, offset, length_bytes)?;
        self.refuse_if_fenced(volume)?;
        let mut length_bytes = length_bytes;
        if length_bytes == 0 {
            return Ok(());
        }
        let block_bytes = self.env.block_size_bytes as u64;
        if kind == RangeKind::Zero && !self.is_degraded() {
            // The blocks zeroed in part are written as zeroes here, as
            // tasks: one that is not cached reads the rest from the origin
            // without the engine lock (see `write::write_from`). The whole
            // blocks between stay a logged range.
            let end = offset + length_bytes;
            let zeroes = vec![0u8; block_bytes as usize];
            for (lba, within, n) in write::partial_edges(offset, end, block_bytes) {
                let at = lba * block_bytes + within as u64;
                self.write_at_key(volume, at, &zeroes[..n], false).await?;
            }
            let (first_full, end_full) = (offset.div_ceil(block_bytes), end / block_bytes);
            if first_full >= end_full {
                return Ok(());
            }
            offset = first_full * block_bytes;
            length_bytes = (end_full - first_full) * block_bytes;
        }
        let parts = self.parts();
        let logged = self.with_degrade(|degraded| {
            if degraded {
                degrade::degraded_zero_range(parts, offset, length_bytes, kind).map(|()| None)
            } else {
                write::zero_range_logged(parts, offset, length_bytes, kind).map(Some)
            }
        })?;
        // Degraded: on the origin already.
        let Some(end_position) = logged else {
            return Ok(());
        };
        let mode = self.policy.mode_of(volume);
        if mode == CacheMode::WriteBack {
            return Ok(());
        }
        let (first, end) = (
            offset / block_bytes,
            (offset + length_bytes).div_ceil(block_bytes),
        );
        let through = write::write_through_async(parts, mode, first, end, end_position);
        if let Err(e) = through.await {
            // The switch to degraded mode writes every acknowledged change
            // to the origin, this one included.
            if !self.env.health.wants_degraded_path()? {
                return Err(e);
            }
            degrade::enter(parts)?;
        }
        Ok(())
    }

    fn zero_range(
        &self,
        volume: u16,
        offset: u64,
        length_bytes: u64,
        kind: RangeKind,
    ) -> EngineResult<()> {
        let offset = self.key_offset(volume, offset, length_bytes)?;
        self.refuse_if_fenced(volume)?;
        if length_bytes == 0 {
            return Ok(());
        }
        self.with_degrade(|degraded| {
            if degraded {
                degrade::degraded_zero_range(self.parts(), offset, length_bytes, kind)
            } else {
                write::zero_range(self.parts(), offset, length_bytes, kind)
            }
        })
    }

    /// A volume whose origin fenced this process takes no new data: it
    /// would be acknowledged while another client writes the origin, and
    /// written over that client's data after a restart. Reads go on.
    fn refuse_if_fenced(&self, volume: u16) -> EngineResult<()> {
        if self.env.health.origin_fenced(volume) {
            Counters::add(&self.env.counters.fenced_refusals, 1);
            return Err(EngineError::OriginFenced { volume_id: volume });
        }
        Ok(())
    }
}
