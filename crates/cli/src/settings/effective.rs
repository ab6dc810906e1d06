//! Every policy setting as this run uses it, and where its value came from.

use cairn_engine::{StoredSettings, SETTINGS_COUNT};
use serde_json::{json, Map, Value};

use crate::writeback::WritebackPolicy;

/// Where a setting's value comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A `serve` flag: this run only.
    Flag,
    /// Stored in the cache (`cairn set`).
    Stored,
    /// Nothing said: `serve`'s default.
    Default,
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Source::Flag => "flag",
            Source::Stored => "stored",
            Source::Default => "default",
        }
    }
}

/// The defaults, as `serve --help` documents them.
pub const DEFAULT_SEQUENTIAL_CUTOFF_BYTES: u64 = 4 << 20;
pub const DEFAULT_PROMOTE_AFTER_MISSES: u64 = 1;
pub const DEFAULT_WRITEBACK_HIGH_PCT: u64 = 50;
pub const DEFAULT_WRITEBACK_LOW_PCT: u64 = 10;
pub const DEFAULT_WRITEBACK_MAX_AGE_SECS: u64 = 30;
pub const DEFAULT_WRITEBACK_RATE_BYTES_PER_SEC: u64 = 0;
pub const DEFAULT_PAGE_CACHE_READS: bool = true;

/// The defaults in [`EffectiveSettings::NAMES`] order.
const DEFAULTS: [u64; SETTINGS_COUNT] = [
    DEFAULT_SEQUENTIAL_CUTOFF_BYTES,
    DEFAULT_PROMOTE_AFTER_MISSES,
    DEFAULT_WRITEBACK_HIGH_PCT,
    DEFAULT_WRITEBACK_LOW_PCT,
    DEFAULT_WRITEBACK_MAX_AGE_SECS,
    DEFAULT_WRITEBACK_RATE_BYTES_PER_SEC,
    DEFAULT_PAGE_CACHE_READS as u64,
];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EffectiveSettings {
    pub values: StoredSettings,
    /// By setting, in [`EffectiveSettings::NAMES`] order.
    pub sources: [Source; SETTINGS_COUNT],
}

impl EffectiveSettings {
    /// The settings' names, as `status --json` and `cairn set` spell them.
    pub const NAMES: [&'static str; SETTINGS_COUNT] = [
        "sequential_cutoff_bytes",
        "promote_after_misses",
        "writeback_high_pct",
        "writeback_low_pct",
        "writeback_max_age_secs",
        "writeback_rate_bytes_per_sec",
        "page_cache_reads",
    ];

    /// Each setting from `flags` if given there, else from `stored`, else
    /// the default.
    pub fn resolve(flags: &StoredSettings, stored: &StoredSettings) -> EffectiveSettings {
        let (flags, stored) = (flags.to_array(), stored.to_array());
        let mut sources = [Source::Default; SETTINGS_COUNT];
        let values = std::array::from_fn(|i| match (flags[i], stored[i]) {
            (Some(v), _) => {
                sources[i] = Source::Flag;
                Some(v)
            }
            (None, Some(v)) => {
                sources[i] = Source::Stored;
                Some(v)
            }
            (None, None) => Some(DEFAULTS[i]),
        });
        EffectiveSettings {
            values: StoredSettings::from_array(values),
            sources,
        }
    }

    /// This run's flag values, but for the settings `named`: what stays a
    /// flag when `cairn set` changes those while serving.
    pub fn flags_except(&self, named: &[&str]) -> StoredSettings {
        let values = self.values.to_array();
        StoredSettings::from_array(std::array::from_fn(|i| {
            let kept = self.sources[i] == Source::Flag && !named.contains(&Self::NAMES[i]);
            values[i].filter(|_| kept)
        }))
    }

    fn value(&self, i: usize) -> Value {
        match (i, self.values.to_array()[i]) {
            (6, v) => json!(v.map(|x| x != 0)),
            (_, v) => json!(v),
        }
    }

    /// `{"name": {"value": V, "source": "flag|stored|default"}, ...}`.
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        for (i, name) in Self::NAMES.iter().enumerate() {
            m.insert(
                (*name).into(),
                json!({"value": self.value(i), "source": self.sources[i].name()}),
            );
        }
        Value::Object(m)
    }

    pub fn sequential_cutoff_bytes(&self) -> u64 {
        self.values
            .sequential_cutoff_bytes
            .unwrap_or(DEFAULT_SEQUENTIAL_CUTOFF_BYTES)
    }

    pub fn promote_after_misses(&self) -> u32 {
        self.values
            .promote_after_misses
            .unwrap_or(DEFAULT_PROMOTE_AFTER_MISSES)
            .clamp(1, u32::MAX as u64) as u32
    }

    pub fn page_cache_reads(&self) -> bool {
        self.values
            .page_cache_reads
            .unwrap_or(DEFAULT_PAGE_CACHE_READS)
    }

    pub fn writeback_policy(&self) -> WritebackPolicy {
        let v = &self.values;
        WritebackPolicy {
            high_watermark_pct: v.writeback_high_pct.unwrap_or(DEFAULT_WRITEBACK_HIGH_PCT),
            low_watermark_pct: v.writeback_low_pct.unwrap_or(DEFAULT_WRITEBACK_LOW_PCT),
            max_age_ms: v
                .writeback_max_age_secs
                .unwrap_or(DEFAULT_WRITEBACK_MAX_AGE_SECS)
                .saturating_mul(1000),
            rate_limit_bytes_per_sec: v
                .writeback_rate_bytes_per_sec
                .unwrap_or(DEFAULT_WRITEBACK_RATE_BYTES_PER_SEC),
            ..WritebackPolicy::default()
        }
    }

    /// The watermarks must be ordered: low <= high <= 100.
    pub fn check(&self) -> Result<(), String> {
        let p = self.writeback_policy();
        let (low, high) = (p.low_watermark_pct, p.high_watermark_pct);
        if low > high || high > 100 {
            return Err(format!(
                "writeback low watermark ({low}%) must not exceed the high one ({high}%), which must be at most 100%"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_beat_stored_values_which_beat_defaults() {
        let stored = StoredSettings {
            sequential_cutoff_bytes: Some(8 << 20),
            writeback_high_pct: Some(70),
            ..Default::default()
        };
        let flags = StoredSettings {
            writeback_high_pct: Some(60),
            ..Default::default()
        };
        let e = EffectiveSettings::resolve(&flags, &stored);
        assert_eq!(e.sequential_cutoff_bytes(), 8 << 20);
        assert_eq!(e.sources[0], Source::Stored);
        assert_eq!(e.writeback_policy().high_watermark_pct, 60);
        assert_eq!(e.sources[2], Source::Flag);
        assert_eq!(
            e.writeback_policy().low_watermark_pct,
            DEFAULT_WRITEBACK_LOW_PCT
        );
        assert_eq!(e.sources[3], Source::Default);
        assert_eq!(e.to_json()["writeback_high_pct"]["source"], "flag");
        assert!(e.check().is_ok());
        let bad = StoredSettings {
            writeback_low_pct: Some(80),
            ..Default::default()
        };
        assert!(EffectiveSettings::resolve(&bad, &stored).check().is_err());
    }
}
