//! Glue between the NBD server and the engine, plus per-operation latency
//! histograms for the metrics endpoint.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use cairn_engine::{BlockState, BlockStatusRun, Engine, EngineError};
use cairn_nbd::{Export, ExportError, ExportFuture, Extent, ExtentKind, ReadBuffer};

/// Upper bounds of the latency buckets, in microseconds.
pub const LATENCY_BUCKETS_US: [u64; 14] = [
    50,
    100,
    250,
    500,
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    1_000_000,
    u64::MAX,
];

#[derive(Default)]
pub struct Histogram {
    pub buckets: [AtomicU64; 14],
    pub sum_us: AtomicU64,
    pub count: AtomicU64,
}

impl Histogram {
    fn record(&self, started: Instant) {
        let us = started.elapsed().as_micros() as u64;
        let i = LATENCY_BUCKETS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(LATENCY_BUCKETS_US.len() - 1);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Default)]
pub struct Latencies {
    pub read: Histogram,
    pub write: Histogram,
    pub flush: Histogram,
    pub trim: Histogram,
    pub zero: Histogram,
    pub cache: Histogram,
}

impl Latencies {
    /// Per operation: the bucket bounds (`le_us`; the last is open), the
    /// count in each, and the totals, for `status --json` (`latency`) and
    /// `cairn top`, which takes percentiles over the difference of two.
    pub fn to_json(&self) -> serde_json::Value {
        let bounds: Vec<serde_json::Value> = LATENCY_BUCKETS_US
            .iter()
            .map(|&b| {
                if b == u64::MAX {
                    serde_json::Value::Null
                } else {
                    b.into()
                }
            })
            .collect();
        let mut ops = serde_json::Map::new();
        for (name, h) in self.all() {
            let counts: Vec<u64> = h
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect();
            ops.insert(
                name.into(),
                serde_json::json!({
                    "le_us": bounds,
                    "counts": counts,
                    "count": h.count.load(Ordering::Relaxed),
                    "sum_us": h.sum_us.load(Ordering::Relaxed),
                }),
            );
        }
        serde_json::Value::Object(ops)
    }

    pub fn all(&self) -> [(&'static str, &Histogram); 6] {
        [
            ("read", &self.read),
            ("write", &self.write),
            ("flush", &self.flush),
            ("trim", &self.trim),
            ("write_zeroes", &self.zero),
            ("cache", &self.cache),
        ]
    }
}

/// One volume of the engine as an NBD export.
pub struct EngineExport {
    pub engine: Arc<Engine>,
    /// The volume's id.
    pub volume: u16,
    /// Fixed while the volume is served.
    pub size_bytes: u64,
    pub latencies: Arc<Latencies>,
}

impl EngineExport {
    pub fn new(
        engine: Arc<Engine>,
        volume: u16,
        latencies: Arc<Latencies>,
    ) -> Result<Self, EngineError> {
        let size_bytes = engine.volume_size_bytes(volume)?;
        Ok(EngineExport {
            engine,
            volume,
            size_bytes,
            latencies,
        })
    }
}

fn map_err(e: EngineError) -> ExportError {
    ExportError::new(e.errno(), e.to_string())
}

impl Export for EngineExport {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        let t = Instant::now();
        let r = self
            .engine
            .read_in(self.volume, offset, buf)
            .map_err(map_err);
        self.latencies.read.record(t);
        r
    }

    fn read_async(&self, offset: u64, length: u64) -> ExportFuture<'_, ReadBuffer> {
        Box::pin(async move {
            let t = Instant::now();
            let r = self
                .engine
                .read_async_in(self.volume, offset, length as usize, false)
                .await;
            self.latencies.read.record(t);
            r.map(|data| Box::new(data) as ReadBuffer).map_err(map_err)
        })
    }

    fn write_async<'a>(&'a self, offset: u64, data: &'a [u8], fua: bool) -> ExportFuture<'a, ()> {
        Box::pin(async move {
            let t = Instant::now();
            let r = self
                .engine
                .write_async_in(self.volume, offset, data, fua)
                .await
                .map_err(map_err);
            self.latencies.write.record(t);
            r
        })
    }

    fn trim_async(&self, offset: u64, length: u64) -> ExportFuture<'_, ()> {
        Box::pin(async move {
            let t = Instant::now();
            let r = self
                .engine
                .discard_async_in(self.volume, offset, length)
                .await
                .map_err(map_err);
            self.latencies.trim.record(t);
            r
        })
    }

    fn write_zeroes_async(
        &self,
        offset: u64,
        length: u64,
        _may_trim: bool,
        _fast_only: bool,
    ) -> ExportFuture<'_, ()> {
        // Zeroing whole blocks is a logged range: always fast, no data I/O.
        Box::pin(async move {
            let t = Instant::now();
            let r = self
                .engine
                .write_zeroes_async_in(self.volume, offset, length)
                .await
                .map_err(map_err);
            self.latencies.zero.record(t);
            r
        })
    }

    fn cache_async(&self, offset: u64, length: u64) -> ExportFuture<'_, ()> {
        Box::pin(async move {
            let t = Instant::now();
            let r = prefetch_async(&self.engine, self.volume, offset, length)
                .await
                .map_err(map_err);
            self.latencies.cache.record(t);
            r
        })
    }

    fn flush_async(&self) -> ExportFuture<'_, ()> {
        Box::pin(async move {
            let t = Instant::now();
            let r = self
                .engine
                .flush_async_in(self.volume)
                .await
                .map_err(map_err);
            self.latencies.flush.record(t);
            r
        })
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
        let t = Instant::now();
        let r = self
            .engine
            .write_in(self.volume, offset, data, fua)
            .map_err(map_err);
        self.latencies.write.record(t);
        r
    }

    fn flush(&self) -> Result<(), ExportError> {
        let t = Instant::now();
        let r = self.engine.flush_in(self.volume).map_err(map_err);
        self.latencies.flush.record(t);
        r
    }

    fn trim(&self, offset: u64, length: u64) -> Result<(), ExportError> {
        let t = Instant::now();
        let r = self
            .engine
            .discard_in(self.volume, offset, length)
            .map_err(map_err);
        self.latencies.trim.record(t);
        r
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        _may_trim: bool,
        _fast_only: bool,
    ) -> Result<(), ExportError> {
        // Zeroing whole blocks is a logged range: always fast, no data I/O.
        let t = Instant::now();
        let r = self
            .engine
            .write_zeroes_in(self.volume, offset, length)
            .map_err(map_err);
        self.latencies.zero.record(t);
        r
    }

    fn cache(&self, offset: u64, length: u64) -> Result<(), ExportError> {
        // Prefetch: reading the range promotes its blocks as clean copies.
        let t = Instant::now();
        let r = prefetch(&self.engine, self.volume, offset, length).map_err(map_err);
        self.latencies.cache.record(t);
        r
    }

    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, ExportError> {
        let runs = self
            .engine
            .block_status_in(self.volume, offset, length)
            .map_err(map_err)?;
        Ok(extents_of(runs))
    }

    fn block_status_async(&self, offset: u64, length: u64) -> ExportFuture<'_, Vec<Extent>> {
        Box::pin(async move {
            let runs = self
                .engine
                .block_status_async_in(self.volume, offset, length)
                .await
                .map_err(map_err)?;
            Ok(extents_of(runs))
        })
    }
}

/// The engine's block status runs as NBD extents.
fn extents_of(runs: Vec<BlockStatusRun>) -> Vec<Extent> {
    runs.into_iter()
        .map(|run| Extent {
            length: run.length_bytes,
            kind: match run.state {
                BlockState::Data => ExtentKind::Data,
                BlockState::Zero => ExtentKind::Zero,
                BlockState::Hole => ExtentKind::Hole,
            },
        })
        .collect()
}

/// [`prefetch`] as a task: the NBD CACHE command, whose misses are origin
/// reads its connection's loop does not wait for.
pub async fn prefetch_async(
    engine: &Engine,
    volume: u16,
    offset: u64,
    length: u64,
) -> Result<(), EngineError> {
    const CHUNK_BYTES: u64 = 1 << 20;
    let end = offset
        .saturating_add(length)
        .min(engine.volume_size_bytes(volume)?);
    let mut at = offset;
    while at < end {
        let n = CHUNK_BYTES.min(end - at) as usize;
        engine.read_async_in(volume, at, n, true).await?;
        at += n as u64;
    }
    Ok(())
}

/// Read a range (clipped to the volume) so its blocks are promoted as
/// clean copies: `cairn warm`.
pub fn prefetch(engine: &Engine, volume: u16, offset: u64, length: u64) -> Result<(), EngineError> {
    const CHUNK_BYTES: u64 = 1 << 20;
    let end = offset
        .saturating_add(length)
        .min(engine.volume_size_bytes(volume)?);
    let mut buf = vec![0u8; CHUNK_BYTES.min(end.saturating_sub(offset)) as usize];
    let mut at = offset;
    while at < end {
        let n = CHUNK_BYTES.min(end - at) as usize;
        engine.read_uncut_in(volume, at, &mut buf[..n])?;
        at += n as u64;
    }
    Ok(())
}
