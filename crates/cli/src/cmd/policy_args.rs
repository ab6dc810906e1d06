//! The policy settings as command-line options, shared by `serve` (for one
//! run) and `set` (stored in the cache): the same names in both.

use cairn_engine::StoredSettings;

use crate::args::parse_size;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct PolicyArgs {
    /// Reads continuing a sequential stream longer than this bypass the cache
    /// (not promoted, counted as bypassed). 0 disables. Suffixes K, M, G.
    /// [default: stored with `cairn set`, else 4M]
    #[arg(long, value_parser = parse_size)]
    pub sequential_cutoff: Option<u64>,
    /// Promote a missed block on its Nth miss (1 = always; Open CAS "nhit").
    /// [default: stored, else 1]
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=u32::MAX as u64))]
    pub promote_after: Option<u64>,
    /// Start cleaning when dirty data exceeds this share of the cache
    /// (percent). [default: stored, else 50]
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=100))]
    pub writeback_high_pct: Option<u64>,
    /// Stop cleaning (while busy) once dirty data is below this share
    /// (percent). [default: stored, else 10]
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=100))]
    pub writeback_low_pct: Option<u64>,
    /// Write back dirty data older than this even while foreground I/O is
    /// busy. [default: stored, else 30]
    #[arg(long)]
    pub writeback_max_age_secs: Option<u64>,
    /// Cap write-back bandwidth (bytes per second, suffixes K, M, G; 0 = no
    /// cap). [default: stored, else 0]
    #[arg(long, value_parser = parse_size)]
    pub writeback_rate: Option<u64>,
}

impl PolicyArgs {
    /// The settings these options give (`page_cache_reads` is each
    /// command's own option).
    pub fn settings(&self, page_cache_reads: Option<bool>) -> StoredSettings {
        StoredSettings {
            sequential_cutoff_bytes: self.sequential_cutoff,
            promote_after_misses: self.promote_after,
            writeback_high_pct: self.writeback_high_pct,
            writeback_low_pct: self.writeback_low_pct,
            writeback_max_age_secs: self.writeback_max_age_secs,
            writeback_rate_bytes_per_sec: self.writeback_rate,
            page_cache_reads,
        }
    }
}
