//! Counters. Monotonic event counts are atomics bumped on the I/O path;
//! gauges (dirty/clean/free blocks) are read from the index under its lock
//! when a snapshot is taken, so they are always exact.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::env::Env;
use crate::policy::Policy;
use crate::state::State;
use crate::writeback::Writeback;

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
            pub failed: bool,
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
    writes,
    write_bytes,
    write_hits,
    write_rmw,
    fua_writes,
    flushes,
    discards,
    write_zeroes,
    checksum_mismatches,
    hit_rereads_ok,
    repairs,
    promotions,
    promotions_skipped,
    bypassed,
    writethrough_waits,
    evictions,
    second_chances,
    cache_read_errors,
    cache_write_errors,
    cache_write_retries,
    origin_read_errors,
    origin_write_errors,
    writeback_blocks,
    writeback_bytes,
    writeback_groups,
    writeback_skipped_corrupt,
    writeback_stalls,
    cache_barriers,
    flush_barriers,
    group_commit_joins,
    cache_bytes_written,
    records_sealed,
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
);

impl Counters {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

impl StatsSnapshot {
    /// Every counter, and the gauges read from the state under its lock.
    pub(crate) fn collect(env: &Env, st: &State, writeback: &Writeback, policy: &Policy) -> Self {
        let mut s = StatsSnapshot::default();
        env.counters.fill(&mut s);
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
        s.origin_failing = writeback.origin_failing();
        s.mode = policy.mode().name();
        s.policy_memory_bytes = policy.memory_bytes() as u64;
        s.failed = env.health.is_failed();
        // A degraded cache keeps no tags (see `degrade`).
        s.integrity = env.integrity && st.tags.is_some();
        if let Some(tags) = &st.tags {
            s.tag_algorithm = "crc32c(lba_le64 || block)";
            s.recalc_position_blocks = tags.recalc_pos;
            s.recalc_total_blocks = tags.origin_blocks();
            s.tag_pages_dirty = tags.dirty_pages();
            s.tag_memory_bytes = tags.memory_bytes() as u64;
        }
        s.degraded = env.health.is_degraded();
        s
    }
}
