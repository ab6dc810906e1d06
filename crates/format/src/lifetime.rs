//! Lifetime counters: the engine's event counters summed over every run of
//! a cache, kept in the checkpoint header's block after the header proper
//! (which a checkpoint written before them leaves zero: no counters).
//!
//! Layout (from byte 0 of the region): magic `CAIRNLTC` (u64), version
//! (u32), count (u32), `count` pairs of (name key u32 = crc32c of the
//! counter's name, zero u32, value u64), then a crc32c (u32) of everything
//! before it. Keys, not positions, so counters added or removed by later
//! builds keep the others' values.

use crate::codec::{check_magic, check_version, Reader, Writer};
use crate::{crc32c, DecodeError, STRUCTURE_VERSION};

pub const LIFETIME_MAGIC: u64 = u64::from_le_bytes(*b"CAIRNLTC");

const FIXED_BYTES: usize = 8 + 4 + 4 + 4;
const PAIR_BYTES: usize = 16;

/// The key a counter's value is stored under.
pub fn lifetime_key(name: &str) -> u32 {
    crc32c(name.as_bytes())
}

/// How many pairs fit in a region of `region_bytes`.
pub fn lifetime_pairs_max(region_bytes: usize) -> usize {
    region_bytes.saturating_sub(FIXED_BYTES) / PAIR_BYTES
}

/// Write `pairs` (key, value) into `region`; at most
/// [`lifetime_pairs_max`] of them (the rest are left out).
pub fn encode_lifetime(region: &mut [u8], pairs: &[(u32, u64)]) {
    let pairs = &pairs[..pairs.len().min(lifetime_pairs_max(region.len()))];
    let used = FIXED_BYTES - 4 + pairs.len() * PAIR_BYTES;
    let mut w = Writer::new(region);
    w.u64(LIFETIME_MAGIC);
    w.u32(STRUCTURE_VERSION);
    w.u32(pairs.len() as u32);
    for &(key, value) in pairs {
        w.u32(key);
        w.u32(0);
        w.u64(value);
    }
    let crc = crc32c(&region[..used]);
    region[used..used + 4].copy_from_slice(&crc.to_le_bytes());
}

/// The pairs stored in `region`: `None` if it holds none (all zero, as a
/// checkpoint written before lifetime counters leaves it); an error if it
/// holds damaged ones.
pub fn decode_lifetime(region: &[u8]) -> Result<Option<Vec<(u32, u64)>>, DecodeError> {
    if region.len() < FIXED_BYTES || region[..8].iter().all(|&b| b == 0) {
        return Ok(None);
    }
    let mut r = Reader::new(region);
    check_magic(r.u64()?, LIFETIME_MAGIC)?;
    check_version(r.u32()?)?;
    let count = r.u32()? as usize;
    if count > lifetime_pairs_max(region.len()) {
        return Err(DecodeError::OutOfRange {
            field: "lifetime_count",
            value: count as u64,
        });
    }
    let used = FIXED_BYTES - 4 + count * PAIR_BYTES;
    let stored = u32::from_le_bytes(region[used..used + 4].try_into().expect("4 bytes"));
    let computed = crc32c(&region[..used]);
    if stored != computed {
        return Err(DecodeError::BadChecksum { stored, computed });
    }
    let mut pairs = Vec::with_capacity(count);
    for _ in 0..count {
        let key = r.u32()?;
        let _zero = r.u32()?;
        pairs.push((key, r.u64()?));
    }
    Ok(Some(pairs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifetime_counters_round_trip_and_damage_is_an_error() {
        let mut region = vec![0u8; 3968];
        assert_eq!(decode_lifetime(&region), Ok(None));
        let pairs = vec![
            (lifetime_key("reads"), 7),
            (lifetime_key("writes"), 1 << 40),
        ];
        encode_lifetime(&mut region, &pairs);
        assert_eq!(decode_lifetime(&region), Ok(Some(pairs)));
        region[30] ^= 1;
        assert!(decode_lifetime(&region).is_err());
        let mut region = vec![0u8; 3968];
        encode_lifetime(&mut region, &[(1, 2)]);
        region[12] = 0xFF; // a count far past the region
        assert!(decode_lifetime(&region).is_err());
    }
}
