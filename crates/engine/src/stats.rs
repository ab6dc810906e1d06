//! Counters. Monotonic event counts are atomics bumped on the I/O path;
//! gauges (dirty/clean/free blocks) are read from the index under its lock
//! when a snapshot is taken, so they are always exact.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        #[derive(Default)]
        pub struct Counters { $(pub $name: AtomicU64,)* }

        /// A point-in-time copy of every counter and gauge.
        #[derive(Debug, Clone, Default, PartialEq, Eq)]
        pub struct StatsSnapshot {
            $(pub $name: u64,)*
            pub dirty_blocks: u64,
            pub clean_blocks: u64,
            pub free_blocks: u64,
            pub corrupt_blocks: u64,
            /// Dirty blocks that failed their checksum and left the log: they
            /// read as EIO until rewritten.
            pub lost_blocks: u64,
            pub cache_blocks: u64,
            pub block_size_bytes: u64,
            pub volume_size_bytes: u64,
            pub pending_ranges: u64,
            /// Logical log offsets: write-back has finished everything before
            /// `writeback_offset`; `head_offset` is where the next record goes.
            pub writeback_offset: u64,
            pub head_offset: u64,
            /// End of the last durable epoch: write-back may go this far.
            pub writeback_limit_offset: u64,
            pub tail_offset: u64,
            pub index_memory_bytes: u64,
            pub writeback_paused: bool,
            /// Write-back to the origin is failing (retrying with backoff).
            pub origin_failing: bool,
            /// An origin fenced this process: its volume takes no writes
            /// until a restart (see `Device::fenced`).
            pub origin_fenced: bool,
            pub failed: bool,
            /// A cache write failed for good and the switch to degraded
            /// mode has not completed yet (it is retried, see `degrade`).
            pub degrading: bool,
            /// Degraded mode: the cache device failed writes; every write
            /// goes straight to the origin.
            pub degraded: bool,
            pub mode: &'static str,
            pub policy_memory_bytes: u64,
            /// Origin integrity tags are kept.
            pub integrity: bool,
            pub tag_algorithm: &'static str,
            /// Recalculation has covered the origin blocks below this one.
            pub recalc_position_blocks: u64,
            pub recalc_total_blocks: u64,
            pub tag_pages_dirty: u64,
            pub tag_memory_bytes: u64,
            /// Pages (per copy) of the tag area, and those no volume holds:
            /// what `volume add --integrity` can still take.
            pub tag_area_pages: u64,
            pub tag_area_free_pages: u64,
            /// Origin reads of misses allowed in flight at once.
            pub origin_queue_depth: u64,
            /// Origin reads of misses in flight now.
            pub origin_queue_in_flight: u64,
            /// Each counter's total over every run of the cache (as of the
            /// last checkpoint plus this run).
            pub lifetime: Vec<(&'static str, u64)>,
        }

        impl Counters {
            pub fn fill(&self, s: &mut StatsSnapshot) {
                $(s.$name = self.$name.load(Ordering::Relaxed);)*
            }
        }

        impl StatsSnapshot {
            /// (name, value) for every monotonic counter, for metrics export.
            pub fn counter_pairs(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }
        }
    };
}

counters!(
    reads,
    read_bytes,
    read_hits,
    read_misses,
    read_zero_hits,
    // Prefetches (`cairn warm`, NBD CACHE): counted apart, so warming a
    // cache moves neither the client read counters nor the hit ratio.
    prefetch_reads,
    prefetch_bytes,
    prefetch_hits,
    prefetch_misses,
    prefetch_zero_hits,
    writes,
    write_bytes,
    write_hits,
    // Blocks written in part (read-modify-write), and where each one's
    // old contents came from: the cache (memory or a slot), a zeroed
    // range, or the origin; counted apart from the client reads, so a
    // client that only writes moves neither them nor the hit ratio.
    // `write_rmw_unlocked_reads`: of the origin reads, those made without
    // the engine lock (see `write::PartialReads`).
    write_rmw,
    write_rmw_hits,
    write_rmw_zero_hits,
    write_rmw_origin_reads,
    write_rmw_unlocked_reads,
    fua_writes,
    flushes,
    discards,
    write_zeroes,
    checksum_mismatches,
    hit_rereads_ok,
    repairs,
    promotions,
    promotions_skipped,
    fills_superseded,
    bypassed,
    writethrough_waits,
    evictions,
    second_chances,
    share_moves,
    cache_read_errors,
    cache_read_retries,
    cache_write_errors,
    cache_write_retries,
    origin_read_errors,
    origin_read_retries,
    origin_queue_waits,
    origin_write_errors,
    origin_write_retries,
    writeback_blocks,
    writeback_bytes,
    writeback_groups,
    writeback_skipped_corrupt,
    writeback_reads_skipped,
    lost_blocks_unrecorded,
    writeback_stalls,
    dirty_share_waits,
    writeback_requests,
    writeback_request_steps,
    no_space_refusals,
    fenced_refusals,
    cache_barriers,
    flush_barriers,
    group_commit_joins,
    overlapped_barriers,
    cache_bytes_written,
    records_sealed,
    epochs_sealed,
    checkpoints,
    superblock_writes,
    internal_flushes,
    origin_mismatches,
    origin_repairs,
    origin_unverified_reads,
    origin_verified_reads,
    tag_pages_written,
    tag_pages_lost,
    recalc_blocks,
    scrub_blocks,
    degraded_writes,
    degrade_drained_blocks,
    degrade_retries,
);

impl Counters {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}
