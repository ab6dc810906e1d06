//! Requests on a degraded cache: writes, zeroes and discards go straight
//! to the origin and are flushed there before the reply, after the cached
//! copies of the blocks they change are dropped.

use cairn_format::RangeKind;

use crate::error::{EngineError, EngineResult};
use crate::origin_retry::write_retrying;
use crate::parts::Parts;
use crate::read::{self, Scope};
use crate::read_kind::ReadKind;
use crate::stats::Counters;
use crate::write::partial_edges;

/// A degraded write: patch partial blocks at the edges (read from a
/// verified cached copy or the origin), drop cached copies, write the
/// origin and flush it. Durable on return.
pub(crate) fn degraded_write(p: Parts<'_>, offset: u64, data: &[u8]) -> EngineResult<()> {
    if data.is_empty() {
        return Ok(());
    }
    let _serial = p.degraded_writes.lock().unwrap_or_else(|e| e.into_inner());
    let block_bytes = p.env.block_size_bytes as u64;
    let end = offset + data.len() as u64;
    let edges = patched_edges(p, offset, end, |lo, hi| {
        &data[(lo - offset) as usize..(hi - offset) as usize]
    })?;
    let full_first = offset.div_ceil(block_bytes);
    let full_end = end / block_bytes;
    // Key-space offsets less `base` are the volume's origin offsets.
    let (origin, at) = p.env.origin_of_offset(offset)?;
    let base = offset - at;
    let mut writes: Vec<(u64, &[u8])> = edges
        .iter()
        .map(|(lba, b)| (lba * block_bytes - base, b.as_slice()))
        .collect();
    if full_first < full_end {
        let from = (full_first * block_bytes - offset) as usize;
        let to = (full_end * block_bytes - offset) as usize;
        writes.push((full_first * block_bytes - base, &data[from..to]));
    }
    forget_cached(p, offset / block_bytes, end.div_ceil(block_bytes))?;
    Counters::add(&p.env.counters.degraded_writes, 1);
    let device = origin.device();
    // The writes and the flush that vouches for them, repeated together,
    // at once: every degraded write waits on this one's lock.
    write_retrying(p.env, "a degraded write to the origin", 0, || {
        device.write_many_and_flush(&writes)
    })
    .map_err(origin_write_failed)
}

/// A degraded zero or discard: whole blocks become an origin zero or
/// discard, partial edge blocks of a zero are patched and written whole
/// (a discard leaves them alone), then the origin is flushed.
pub(crate) fn degraded_zero_range(
    p: Parts<'_>,
    offset: u64,
    length_bytes: u64,
    kind: RangeKind,
) -> EngineResult<()> {
    let _serial = p.degraded_writes.lock().unwrap_or_else(|e| e.into_inner());
    let block_bytes = p.env.block_size_bytes as u64;
    let end = offset + length_bytes;
    let zeroes = vec![0u8; block_bytes as usize];
    let edges = if kind == RangeKind::Zero {
        patched_edges(p, offset, end, |lo, hi| &zeroes[..(hi - lo) as usize])?
    } else {
        Vec::new()
    };
    let full_first = offset.div_ceil(block_bytes);
    let full_end = end / block_bytes;
    {
        let mut st = p.state.running(p.env)?;
        for (lba, _) in &edges {
            st.index.forget_range(*lba, *lba + 1);
        }
        if full_first < full_end {
            st.index.forget_range(full_first, full_end);
        }
    }
    Counters::add(&p.env.counters.degraded_writes, 1);
    let (volume, at) = p.env.origin_of_offset(offset)?;
    let base = offset - at;
    let origin = volume.device();
    let writes: Vec<(u64, &[u8])> = edges
        .iter()
        .map(|(lba, b)| (lba * block_bytes - base, b.as_slice()))
        .collect();
    let range = (full_first < full_end).then(|| {
        (
            full_first * block_bytes - base,
            (full_end - full_first) * block_bytes,
        )
    });
    if writes.is_empty() && range.is_none() {
        // A discard of part of one block: nothing reaches the origin, so
        // there is nothing to flush (and a flush alone is never retried).
        return Ok(());
    }
    // The edges, the range and the flush that vouches for them, repeated
    // together (zeroing or discarding again is harmless), at once: every
    // degraded write waits on this one's lock.
    write_retrying(p.env, "a degraded zero or discard on the origin", 0, || {
        origin.write_many(&writes)?;
        if let Some((at, len)) = range {
            match kind {
                RangeKind::Zero => origin.write_zeroes(at, len)?,
                RangeKind::Discard => origin.discard(at, len)?,
            }
        }
        origin.flush()
    })
    .map_err(origin_write_failed)
}

/// Degraded: every acknowledged write is durable on the origin already;
/// flush the origins anyway, so a FLUSH means what it says whatever
/// happened.
/// `volume`: that volume's origin only; `None`: every volume's.
pub(crate) fn degraded_flush(p: Parts<'_>, volume: Option<u16>) -> EngineResult<()> {
    // A stopped engine answers with its error, as every request does.
    p.env.health.check_running()?;
    // Not beside a degraded write: a buffered origin reports a failed
    // write-back to one fsync of its descriptor only, and this flush must
    // not take that report from the write's own flush.
    let _serial = p.degraded_writes.lock().unwrap_or_else(|e| e.into_inner());
    let origins = match volume {
        Some(id) => vec![p
            .env
            .origins
            .get(id)
            .ok_or(EngineError::NoSuchVolume { volume_id: id })?],
        None => p.env.origins.all(),
    };
    for volume in origins {
        // A flush alone is not asked again (`origin_retry::write_again`).
        volume.device().flush().map_err(|e| {
            Counters::add(&p.env.counters.origin_write_errors, 1);
            origin_write_failed(e)
        })?;
    }
    Ok(())
}

/// The blocks of `[offset, end)` that the request covers only in part:
/// their current content with `patch(lo, hi)` copied over the covered
/// bytes `[lo, hi)`. Read through the normal read path (a verified cached
/// copy, or the origin) under the degraded write lock, counted as a
/// partial write's (`write_rmw_*`), not as a client read.
fn patched_edges<'a>(
    p: Parts<'_>,
    offset: u64,
    end: u64,
    patch: impl Fn(u64, u64) -> &'a [u8],
) -> EngineResult<Vec<(u64, Vec<u8>)>> {
    let block_bytes = p.env.block_size_bytes as u64;
    let mut edges = Vec::new();
    for (lba, within, n) in partial_edges(offset, end, block_bytes) {
        Counters::add(&p.env.counters.write_rmw, 1);
        let scope = Scope::All {
            promote: false,
            bypassed: false,
            kind: ReadKind::WriteBase,
        };
        let mut buf = p.env.read_bufs.lend(block_bytes as usize);
        buf.set_len(block_bytes as usize);
        let (result, buf) = cairn_io::block_on(read::read_blocks(p, lba * block_bytes, buf, scope));
        result.expect("a read of every scope is served")?;
        let mut block = buf.to_vec();
        let lo = lba * block_bytes + within as u64;
        let src = patch(lo, lo + n as u64);
        assert_eq!(src.len(), n);
        block[within..within + n].copy_from_slice(src);
        edges.push((lba, block));
    }
    Ok(edges)
}

/// Drop the cached copies of blocks `[first, end)` before the origin gets
/// their new content: a read that starts after the reply must not find the
/// old copy.
fn forget_cached(p: Parts<'_>, first: u64, end: u64) -> EngineResult<()> {
    let mut st = p.state.running(p.env)?;
    st.index.forget_range(first, end);
    Ok(())
}

/// An origin write or flush that failed for good (its failures already
/// counted).
fn origin_write_failed(e: cairn_device::DeviceError) -> EngineError {
    tracing::error!("degraded mode: a write or flush to the origin failed: {e}");
    EngineError::Origin(e)
}
