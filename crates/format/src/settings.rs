//! The policy settings an operator stored in the cache (`cairn set`), so a
//! restart keeps them. Each is either stored or not (then `serve`'s default
//! applies); a `serve` flag overrides a stored value for that run only.
//!
//! Encoded in the superblock after the fields of the first release: a
//! presence mask (u32, bit per setting), then every value as a u64 (zero
//! when absent). A superblock written before settings existed decodes as
//! "nothing stored".

use crate::codec::{Reader, Writer};
use crate::DecodeError;

/// Bytes the settings take in the superblock.
pub const STORED_SETTINGS_BYTES: usize = 4 + SETTINGS_COUNT * 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoredSettings {
    pub sequential_cutoff_bytes: Option<u64>,
    pub promote_after_misses: Option<u64>,
    pub writeback_high_pct: Option<u64>,
    pub writeback_low_pct: Option<u64>,
    pub writeback_max_age_secs: Option<u64>,
    pub writeback_rate_bytes_per_sec: Option<u64>,
    pub page_cache_reads: Option<bool>,
}

const SETTINGS_KNOWN: u32 = (1 << SETTINGS_COUNT) - 1;

/// How many settings there are (the order of [`StoredSettings::to_array`]).
pub const SETTINGS_COUNT: usize = 7;

impl StoredSettings {
    /// The settings in their fixed order (page-cache reads as 0/1).
    pub fn to_array(&self) -> [Option<u64>; SETTINGS_COUNT] {
        [
            self.sequential_cutoff_bytes,
            self.promote_after_misses,
            self.writeback_high_pct,
            self.writeback_low_pct,
            self.writeback_max_age_secs,
            self.writeback_rate_bytes_per_sec,
            self.page_cache_reads.map(u64::from),
        ]
    }

    /// The inverse of [`StoredSettings::to_array`] (any non-zero
    /// page-cache value is on).
    pub fn from_array(v: [Option<u64>; SETTINGS_COUNT]) -> StoredSettings {
        StoredSettings {
            sequential_cutoff_bytes: v[0],
            promote_after_misses: v[1],
            writeback_high_pct: v[2],
            writeback_low_pct: v[3],
            writeback_max_age_secs: v[4],
            writeback_rate_bytes_per_sec: v[5],
            page_cache_reads: v[6].map(|x| x != 0),
        }
    }

    pub fn encode(&self, w: &mut Writer) {
        let values = self.to_array();
        let mask = values
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_some())
            .fold(0u32, |m, (i, _)| m | (1 << i));
        w.u32(mask);
        for v in values {
            w.u64(v.unwrap_or(0));
        }
    }

    /// Decode and check: the values are device contents, so impossible ones
    /// are an error, not a setting.
    pub fn decode(r: &mut Reader) -> Result<StoredSettings, DecodeError> {
        let mask = r.u32()?;
        if mask & !SETTINGS_KNOWN != 0 {
            return Err(DecodeError::OutOfRange {
                field: "settings_mask",
                value: mask as u64,
            });
        }
        let mut values = [None; SETTINGS_COUNT];
        for (i, slot) in values.iter_mut().enumerate() {
            let v = r.u64()?;
            if mask & (1 << i) != 0 {
                *slot = Some(v);
            } else if v != 0 {
                return Err(DecodeError::OutOfRange {
                    field: "settings_absent_value",
                    value: v,
                });
            }
        }
        let check = |field: &'static str, v: Option<u64>, ok: fn(u64) -> bool| match v {
            Some(v) if !ok(v) => Err(DecodeError::OutOfRange { field, value: v }),
            _ => Ok(v),
        };
        Ok(StoredSettings {
            sequential_cutoff_bytes: values[0],
            promote_after_misses: check("promote_after_misses", values[1], |v| {
                (1..=u32::MAX as u64).contains(&v)
            })?,
            writeback_high_pct: check("writeback_high_pct", values[2], |v| v <= 100)?,
            writeback_low_pct: check("writeback_low_pct", values[3], |v| v <= 100)?,
            writeback_max_age_secs: values[4],
            writeback_rate_bytes_per_sec: values[5],
            page_cache_reads: check("page_cache_reads", values[6], |v| v <= 1)?.map(|v| v == 1),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.to_array().iter().all(Option::is_none)
    }

    /// `self` with every setting `other` stores replacing this one's.
    pub fn merged(&self, other: &StoredSettings) -> StoredSettings {
        let (mine, theirs) = (self.to_array(), other.to_array());
        StoredSettings::from_array(std::array::from_fn(|i| theirs[i].or(mine[i])))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(s: StoredSettings) -> Result<StoredSettings, DecodeError> {
        let mut buf = vec![0u8; STORED_SETTINGS_BYTES];
        s.encode(&mut Writer::new(&mut buf));
        StoredSettings::decode(&mut Reader::new(&buf))
    }

    #[test]
    fn settings_round_trip_and_nothing_stored_is_all_zero() {
        let s = StoredSettings {
            sequential_cutoff_bytes: Some(8 << 20),
            promote_after_misses: Some(2),
            writeback_low_pct: Some(0),
            page_cache_reads: Some(false),
            ..Default::default()
        };
        assert_eq!(roundtrip(s), Ok(s));
        let zeroes = vec![0u8; STORED_SETTINGS_BYTES];
        assert_eq!(
            StoredSettings::decode(&mut Reader::new(&zeroes)),
            Ok(StoredSettings::default())
        );
    }

    #[test]
    fn impossible_stored_values_are_errors() {
        for bad in [
            StoredSettings {
                writeback_high_pct: Some(101),
                ..Default::default()
            },
            StoredSettings {
                promote_after_misses: Some(0),
                ..Default::default()
            },
        ] {
            assert!(roundtrip(bad).is_err(), "{bad:?}");
        }
        let mut buf = vec![0u8; STORED_SETTINGS_BYTES];
        buf[0] = 0x80; // an unknown setting
        assert!(StoredSettings::decode(&mut Reader::new(&buf)).is_err());
        let mut buf = vec![0u8; STORED_SETTINGS_BYTES];
        buf[4] = 1; // a value without its bit
        assert!(StoredSettings::decode(&mut Reader::new(&buf)).is_err());
    }
}
