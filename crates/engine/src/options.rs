//! What a caller chooses when formatting and opening a cache.

/// How to format a cache.
#[derive(Debug, Clone)]
pub struct FormatOptions {
    pub block_size_bytes: u32,
    /// Overwrite an existing cairn cache.
    pub force: bool,
    /// Keep an integrity tag for every origin block (`FEATURE_INTEGRITY`).
    pub integrity: bool,
    /// Origin bytes' worth of tag pages to reserve for volumes added later
    /// with integrity (0: none; the tag area is then the first volume's
    /// alone, as format 1 had it).
    pub integrity_reserve_bytes: u64,
    /// The first volume's name: its NBD export name. `""` (the default) is
    /// what clients that name no export ask for.
    pub volume_name: String,
}

impl Default for FormatOptions {
    fn default() -> Self {
        FormatOptions {
            block_size_bytes: 4096,
            force: false,
            integrity: false,
            integrity_reserve_bytes: 0,
            volume_name: String::new(),
        }
    }
}

/// How long a writer waits for write-back that keeps failing before its
/// write fails with ENOSPC: long enough for an origin to restart or a link
/// to come back, short of the I/O timeouts of common clients (the Linux
/// NBD driver's default is 30 s).
pub const SPACE_WAIT_FOR_WRITEBACK_MS: u64 = 10_000;

/// How an opened engine behaves.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Insert blocks read from the origin into the cache as clean.
    pub promote_read_misses: bool,
    /// Force an internal flush once this many sealed blocks are waiting for
    /// a barrier. Bounds how far recovery must look for records that prove
    /// a damaged one was acknowledged, and gives write-back epoch boundaries
    /// during long streams without client flushes.
    pub unsynced_blocks_max: u64,
    /// Promote a missed block on its Nth miss (Open CAS nhit); 1 = always.
    pub promote_after_misses: u32,
    /// Reads continuing a sequential stream longer than this are not
    /// promoted (counted as bypassed); 0 disables the cutoff.
    pub sequential_cutoff_bytes: u64,
    /// A failed cache write is tried this many times in all (when retrying
    /// it is safe, see `docs/design.md`) before the engine goes degraded.
    pub cache_write_attempts: u32,
    /// A failed cache read of a block the engine must have (a dirty block,
    /// a record write-back copies) is tried this many times in all before
    /// its request fails. A read error never makes a block corrupt.
    pub cache_read_attempts: u32,
    /// Wait before the first retry of a failed cache write or read, doubled
    /// before each further one; write-back's retries of an origin write
    /// wait the same. Zero in the simulation tests.
    pub cache_write_backoff_us: u64,
    /// Write-back over an origin that fails some writes: a batch of a
    /// group's runs that the origin fails with an error worth trying again
    /// (EIO, EAGAIN, ...: not a lost connection) is written again in
    /// halves, down to the lone failing run, which is then tried this many
    /// times in all before its group fails (the group is then retried
    /// whole, with write-back's growing backoff). 1 still halves batches,
    /// but never writes a lone run twice. Without any of it, one failed
    /// write in a group of hundreds failed the group, and an origin that
    /// fails 5% of its writes never took a group (`group::write_runs`).
    pub origin_write_attempts: u32,
    /// A client's read miss that the origin fails with an error worth
    /// trying again (as for writes) is asked again at once, this many
    /// times in all, before its request fails with EIO. A read changes
    /// nothing; without it, an origin failing 5% of its reads failed 5%
    /// of the misses.
    pub origin_read_attempts: u32,
    /// Read cache hits through the host's page cache
    /// (`Device::read_many_cacheable`), so the hottest blocks are served
    /// from RAM the kernel can take back under memory pressure. Every read
    /// is still verified against its checksum, and a mismatch is re-read
    /// from the device itself before anything is called corrupt.
    pub page_cache_reads: bool,
    /// Most origin reads of client misses in flight at once; more wait
    /// for one to finish (they never fail for it).
    pub origin_queue_depth: usize,
    /// How long a writer waits, retrying, for write-back that fails (an
    /// origin that fails holds the dirty data that must go before the
    /// write fits) before the write fails with ENOSPC. Zero in the
    /// simulation tests.
    pub space_wait_for_writeback_ms: u64,
    /// Barriers (flushes' fdatasyncs) in progress at once, each through a
    /// flush lane of its own when the cache device has them. 1 (the
    /// default): a flush that arrives during a barrier waits for it and
    /// shares the next. 2 lets the next one start its sync at once; since
    /// a barrier must then wait for the syncs beside its own before it
    /// answers (`sync_watch.rs`), that measured no gain on 2 cores
    /// (`docs/design.md`, "Barriers that overlap"). The tests run 2, so
    /// the overlapping paths stay correct. Clamped to 1..=4.
    pub barriers_in_flight_max: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            promote_read_misses: true,
            unsynced_blocks_max: 4096,
            promote_after_misses: 1,
            sequential_cutoff_bytes: 4 << 20,
            cache_write_attempts: 4,
            cache_read_attempts: 4,
            cache_write_backoff_us: 5_000,
            origin_write_attempts: 4,
            origin_read_attempts: 3,
            page_cache_reads: true,
            origin_queue_depth: 64,
            space_wait_for_writeback_ms: SPACE_WAIT_FOR_WRITEBACK_MS,
            barriers_in_flight_max: 1,
        }
    }
}

/// How to open a formatted cache.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Open even if the origin's identity differs from the recorded one
    /// (the new identity is recorded).
    pub force_origin: bool,
    pub config: EngineConfig,
}
