//! [`OriginClaim`]: a cache's mark on its origin, so a second cache never
//! writes back to it.
//!
//! A lock held while serving is not enough: after its holder crashes, a
//! shared origin's lock goes to the next client (Ceph hands an RBD image's
//! exclusive lock over once the dead holder's watch times out), and when
//! the first cache comes back it replays its older dirty blocks over what
//! the second wrote. A claim is stored on the origin itself, from format
//! until the volume is removed, and checked at every open.

use crate::{ClaimDecision, ClaimMode};

/// Who claims an origin, and how (see [`crate::Device::claim`]).
#[derive(Clone, Debug)]
pub struct OriginClaim {
    /// The cache's uuid, as hex: what the origin records.
    pub cache_uuid: String,
    /// Where that cache lives (host and device), for the messages another
    /// cache or an operator reads.
    pub description: String,
    pub mode: ClaimMode,
}

impl OriginClaim {
    /// The value an origin stores: the uuid first (what is compared), then
    /// the description.
    pub fn stored_value(&self) -> String {
        format!("{} {}", self.cache_uuid, self.description)
    }

    /// The uuid in a stored value: its first word (so a value an operator
    /// set by hand to the bare uuid works too).
    pub fn uuid_of_stored(value: &str) -> &str {
        value.split_whitespace().next().unwrap_or("")
    }

    /// Whether `stored` was made by a cache at the same host and device as
    /// this claim's (an earlier format of the device this cache is on).
    pub fn same_place_as(&self, stored: &str) -> bool {
        let stored = stored.trim_start();
        let uuid = OriginClaim::uuid_of_stored(stored);
        stored[uuid.len()..].trim() == self.description.trim()
    }

    /// What to do about the claim `stored` on the origin (its value, if
    /// any): record this one, leave it, or refuse.
    pub fn decide(&self, stored: Option<&str>) -> ClaimDecision {
        let holder = stored.map(OriginClaim::uuid_of_stored);
        if holder == Some(self.cache_uuid.as_str()) {
            return ClaimDecision::AlreadyOurs;
        }
        match (&self.mode, holder) {
            (ClaimMode::Format { .. } | ClaimMode::AddVolume, None) => ClaimDecision::Record,
            (
                ClaimMode::Format {
                    replaces: Some(previous),
                },
                Some(holder),
            ) if holder == previous => ClaimDecision::Record,
            (ClaimMode::Open { adopt: true }, None) => ClaimDecision::Record,
            (ClaimMode::Open { adopt: false }, None) => ClaimDecision::RefuseUnclaimed,
            (_, Some(_)) => ClaimDecision::RefuseOther,
        }
    }

    /// A cache uuid as stored and shown: 8-4-4-4-12 hex digits.
    pub fn format_uuid(uuid: &[u8; 16]) -> String {
        let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
        format!(
            "{}-{}-{}-{}-{}",
            &hex[0..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..32]
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(uuid: &str, mode: ClaimMode) -> OriginClaim {
        OriginClaim {
            cache_uuid: uuid.into(),
            description: "host=h cache=c".into(),
            mode,
        }
    }

    #[test]
    fn each_mode_accepts_only_its_cases() {
        use ClaimDecision::*;
        let format = claim("a", ClaimMode::Format { replaces: None });
        let reformat = claim(
            "a",
            ClaimMode::Format {
                replaces: Some("old".into()),
            },
        );
        let add = claim("a", ClaimMode::AddVolume);
        let open = claim("a", ClaimMode::Open { adopt: false });
        let adopt = claim("a", ClaimMode::Open { adopt: true });
        for c in [&format, &reformat, &add, &open, &adopt] {
            assert_eq!(c.decide(Some("a host=h")), AlreadyOurs, "{c:?}");
            assert_eq!(c.decide(Some("b host=h")), RefuseOther, "{c:?}");
            // A prefix of the uuid is not the uuid.
            assert_eq!(c.decide(Some("ab")), RefuseOther, "{c:?}");
        }
        assert_eq!(format.decide(None), Record);
        assert_eq!(format.decide(Some("old")), RefuseOther);
        assert_eq!(reformat.decide(None), Record);
        assert_eq!(reformat.decide(Some("old cache=x")), Record);
        assert_eq!(add.decide(None), Record);
        assert_eq!(add.decide(Some("old")), RefuseOther);
        assert_eq!(open.decide(None), RefuseUnclaimed);
        assert_eq!(adopt.decide(None), Record);
        assert_eq!(adopt.decide(Some("old")), RefuseOther);
    }

    #[test]
    fn a_claim_from_the_same_host_and_device_is_told_apart() {
        let c = claim("a", ClaimMode::Format { replaces: None });
        assert!(c.same_place_as("old host=h cache=c"));
        assert!(c.same_place_as("  old   host=h cache=c "));
        assert!(!c.same_place_as("old host=h cache=d"));
        assert!(!c.same_place_as("old host=g cache=c"));
        assert!(!c.same_place_as("old"), "a bare uuid names no place");
    }

    #[test]
    fn the_uuid_is_the_first_word_of_a_stored_value() {
        let claim = OriginClaim {
            cache_uuid: OriginClaim::format_uuid(&[0xab; 16]),
            description: "host=h cache=/dev/nvme0n1".into(),
            mode: ClaimMode::Open { adopt: false },
        };
        assert_eq!(claim.cache_uuid, "abababab-abab-abab-abab-abababababab");
        let stored = claim.stored_value();
        assert_eq!(OriginClaim::uuid_of_stored(&stored), claim.cache_uuid);
        assert_eq!(OriginClaim::uuid_of_stored("  u1  "), "u1");
        assert_eq!(OriginClaim::uuid_of_stored(""), "");
        assert_ne!(
            OriginClaim::format_uuid(&[1; 16]),
            OriginClaim::format_uuid(&[2; 16])
        );
    }
}
