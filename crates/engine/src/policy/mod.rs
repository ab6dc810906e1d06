//! Read-caching policy: the cache mode, sequential cutoff and n-hit
//! promotion. Small, fixed-size structures; their memory does not grow
//! with the cache.

mod cache_mode;
mod hit_filter;
mod sequential;

pub use cache_mode::CacheMode;

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};

use hit_filter::HitFilter;
use sequential::SequentialDetector;

use cairn_format::VOLUMES_MAX;

use crate::options::EngineConfig;

pub(crate) struct Policy {
    /// Each volume's cache mode, by volume id.
    modes: [AtomicU8; VOLUMES_MAX],
    promote_read_misses: bool,
    /// Both changeable while serving (`cairn set`).
    promote_after_misses: AtomicU32,
    sequential_cutoff_bytes: AtomicU64,
    sequential: SequentialDetector,
    hit_filter: HitFilter,
}

impl Policy {
    /// A policy whose volumes are all in `mode` until told otherwise.
    pub(crate) fn new(mode: CacheMode, config: &EngineConfig) -> Policy {
        Policy {
            modes: std::array::from_fn(|_| AtomicU8::new(mode.code())),
            promote_read_misses: config.promote_read_misses,
            promote_after_misses: AtomicU32::new(config.promote_after_misses.max(1)),
            sequential_cutoff_bytes: AtomicU64::new(config.sequential_cutoff_bytes),
            sequential: SequentialDetector::default(),
            hit_filter: HitFilter::default(),
        }
    }

    /// The first volume's mode.
    pub(crate) fn mode(&self) -> CacheMode {
        self.mode_of(0)
    }

    /// The mode of volume `volume` (ids are below `VOLUMES_MAX`).
    pub(crate) fn mode_of(&self, volume: u16) -> CacheMode {
        let code = self.modes[volume as usize].load(Ordering::Relaxed);
        CacheMode::from_code(code).unwrap_or(CacheMode::WriteBack)
    }

    pub(crate) fn set_mode_of(&self, volume: u16, mode: CacheMode) {
        self.modes[volume as usize].store(mode.code(), Ordering::SeqCst);
    }

    /// Note a client read; true if it continues a sequential stream past
    /// the cutoff (its misses are then not promoted: "bypassed").
    pub(crate) fn observe_read(&self, offset: u64, length_bytes: u64) -> bool {
        self.sequential.observe(
            offset,
            length_bytes,
            self.sequential_cutoff_bytes.load(Ordering::Relaxed),
        )
    }

    /// Are this read's misses promoted at all (mode, configuration, the
    /// sequential cutoff's verdict)?
    pub(crate) fn promotes_misses(&self, volume: u16, bypassed: bool) -> bool {
        self.promote_read_misses && self.mode_of(volume).caches_reads() && !bypassed
    }

    /// Count a miss of `lba`; true once it is due for promotion (its Nth
    /// miss with n-hit promotion, always otherwise).
    pub(crate) fn miss_due(&self, lba: u64) -> bool {
        self.hit_filter
            .miss(lba, self.promote_after_misses.load(Ordering::Relaxed))
    }

    /// Change the read policy while serving.
    pub(crate) fn set_read_policy(&self, sequential_cutoff_bytes: u64, promote_after_misses: u32) {
        self.sequential_cutoff_bytes
            .store(sequential_cutoff_bytes, Ordering::Relaxed);
        self.promote_after_misses
            .store(promote_after_misses.max(1), Ordering::Relaxed);
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.hit_filter.memory_bytes()
    }
}
