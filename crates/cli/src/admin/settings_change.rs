//! A `cairn set` request: settings to store, and stored ones to forget.

use cairn_engine::StoredSettings;
use serde::{Deserialize, Serialize};

use crate::settings::EffectiveSettings;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettingsChange {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequential_cutoff_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promote_after_misses: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writeback_high_pct: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writeback_low_pct: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writeback_max_age_secs: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writeback_rate_bytes_per_sec: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_cache_reads: Option<bool>,
    /// Stored settings to forget (back to the default), by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reset: Vec<String>,
}

impl SettingsChange {
    fn as_stored(&self) -> StoredSettings {
        StoredSettings {
            sequential_cutoff_bytes: self.sequential_cutoff_bytes,
            promote_after_misses: self.promote_after_misses,
            writeback_high_pct: self.writeback_high_pct,
            writeback_low_pct: self.writeback_low_pct,
            writeback_max_age_secs: self.writeback_max_age_secs,
            writeback_rate_bytes_per_sec: self.writeback_rate_bytes_per_sec,
            page_cache_reads: self.page_cache_reads,
        }
    }

    /// The names this change sets or resets.
    pub fn names(&self) -> Vec<&str> {
        let set = self.as_stored().to_array();
        EffectiveSettings::NAMES
            .iter()
            .zip(set)
            .filter(|(name, v)| v.is_some() || self.reset.iter().any(|r| r == *name))
            .map(|(name, _)| *name)
            .collect()
    }

    /// `stored` with this change applied; an error names a bad request.
    pub fn apply(&self, stored: &StoredSettings) -> Result<StoredSettings, String> {
        if self.as_stored().is_empty() && self.reset.is_empty() {
            return Err("nothing to set: name at least one setting".into());
        }
        let mut values = stored.merged(&self.as_stored()).to_array();
        for name in &self.reset {
            let Some(i) = EffectiveSettings::NAMES.iter().position(|n| n == name) else {
                return Err(format!(
                    "no setting {name:?} to reset; the settings are {}",
                    EffectiveSettings::NAMES.join(", ")
                ));
            };
            values[i] = None;
        }
        let out = StoredSettings::from_array(values);
        if out.promote_after_misses == Some(0) {
            return Err("promote-after must be at least 1".into());
        }
        for pct in [out.writeback_high_pct, out.writeback_low_pct]
            .into_iter()
            .flatten()
        {
            if pct > 100 {
                return Err(format!("a watermark of {pct}% is more than 100%"));
            }
        }
        EffectiveSettings::resolve(&StoredSettings::default(), &out).check()?;
        Ok(out)
    }
}
