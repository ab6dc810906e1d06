//! One volume of a cache that serves several (format v2): its id, its NBD
//! export name, its origin and its settings. The volume table
//! (`volume_table`) holds up to [`crate::VOLUMES_MAX`] of them.
//!
//! Fixed 768-byte entry, little endian:
//!
//! ```text
//! 0    id u16              the high 16 bits of every key of this volume
//! 2    state u8            1 active, 2 removing
//! 3    mode u8             cache mode (engine-defined code, as the superblock's)
//! 4    flags u8            bit 0: origin integrity tags
//! 5    dirty_share_pct u8  0 = the default share, else 1..=100
//! 6    name_len u16, then name (VOLUME_NAME_MAX_BYTES, zero padded)
//! 136  identity_len u16, then origin identity (ORIGIN_IDENTITY_MAX_BYTES)
//! 650  origin_size_bytes u64
//! 658  stored settings (STORED_SETTINGS_BYTES)
//! 718  tag_first_page u64  with integrity and tag extents: the volume's
//!                          first page in the tag area (else zero)
//! 726  reserved, zero
//! ```

use crate::codec::{Reader, Writer};
use crate::settings::StoredSettings;
use crate::{DecodeError, ORIGIN_IDENTITY_MAX_BYTES, STORED_SETTINGS_BYTES};

/// Bytes of one entry in the table.
pub const VOLUME_ENTRY_BYTES: usize = 768;
/// An NBD export name is at most this many bytes of UTF-8.
pub const VOLUME_NAME_MAX_BYTES: usize = 128;

const FLAG_INTEGRITY: u8 = 1;
const FLAGS_KNOWN: u8 = FLAG_INTEGRITY;
const NAME_OFFSET: usize = 6;
const IDENTITY_OFFSET: usize = NAME_OFFSET + 2 + VOLUME_NAME_MAX_BYTES;
const ORIGIN_SIZE_OFFSET: usize = IDENTITY_OFFSET + 2 + ORIGIN_IDENTITY_MAX_BYTES;
const SETTINGS_OFFSET: usize = ORIGIN_SIZE_OFFSET + 8;
const TAG_FIRST_PAGE_OFFSET: usize = SETTINGS_OFFSET + STORED_SETTINGS_BYTES;
const RESERVED_OFFSET: usize = TAG_FIRST_PAGE_OFFSET + 8;
const _: () = assert!(RESERVED_OFFSET <= VOLUME_ENTRY_BYTES);

/// Where a volume is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VolumeState {
    /// Served: an NBD export, written back to its origin.
    Active,
    /// `volume remove` began: no longer served; its dirty blocks are being
    /// written back and its slots freed. The entry (and so its id) stays
    /// until no block of the volume is left in the cache.
    Removing,
}

impl VolumeState {
    fn code(self) -> u8 {
        match self {
            VolumeState::Active => 1,
            VolumeState::Removing => 2,
        }
    }

    fn from_code(code: u8) -> Option<VolumeState> {
        match code {
            1 => Some(VolumeState::Active),
            2 => Some(VolumeState::Removing),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeEntry {
    pub id: u16,
    pub state: VolumeState,
    /// The NBD export name (the first volume's is `""`, so clients that
    /// name no export keep working).
    pub name: String,
    /// Opaque text naming the origin, as the v1 superblock's.
    pub origin_identity: String,
    pub origin_size_bytes: u64,
    pub mode: u8,
    pub integrity: bool,
    /// The most of the cache this volume's dirty data may hold, in percent
    /// (`None`: the engine's default for the number of volumes).
    pub dirty_share_pct: Option<u8>,
    pub settings: StoredSettings,
    /// With integrity on a cache whose tag area is shared out in extents
    /// (`FEATURE_TAG_EXTENTS`): the first tag page of this volume's
    /// extent. Zero otherwise (the first volume of a cache without extents
    /// starts at page 0 by the layout).
    pub tag_first_page: u64,
}

impl VolumeEntry {
    /// Is this entry one the table can hold? The CLI checks names and
    /// identities a user typed with this before anything is written; the
    /// decoder checks what it read with the same rules.
    pub fn check(&self) -> Result<(), DecodeError> {
        // Keys hold the id in the 5 bits above the address (`KEY_MAX`).
        if self.id as usize >= crate::VOLUMES_MAX {
            return Err(DecodeError::OutOfRange {
                field: "volume_id",
                value: self.id as u64,
            });
        }
        if self.name.len() > VOLUME_NAME_MAX_BYTES {
            return Err(DecodeError::OutOfRange {
                field: "volume_name_len",
                value: self.name.len() as u64,
            });
        }
        if self.origin_identity.len() > ORIGIN_IDENTITY_MAX_BYTES {
            return Err(DecodeError::OutOfRange {
                field: "volume_origin_identity_len",
                value: self.origin_identity.len() as u64,
            });
        }
        if let Some(pct) = self.dirty_share_pct {
            if !(1..=100).contains(&pct) {
                return Err(DecodeError::OutOfRange {
                    field: "volume_dirty_share_pct",
                    value: pct as u64,
                });
            }
        }
        if !self.integrity && self.tag_first_page != 0 {
            return Err(DecodeError::OutOfRange {
                field: "volume_tag_first_page",
                value: self.tag_first_page,
            });
        }
        Ok(())
    }

    /// Write the entry into `buf` (exactly [`VOLUME_ENTRY_BYTES`]).
    pub fn encode(&self, buf: &mut [u8]) {
        assert_eq!(buf.len(), VOLUME_ENTRY_BYTES);
        // Entries reach the encoder only after `check` (the table's
        // constructor runs it), so a bad one here is a programming error.
        assert!(self.check().is_ok(), "volume entry not checked: {self:?}");
        buf.fill(0);
        let mut w = Writer::new(buf);
        w.u16(self.id);
        w.u8(self.state.code());
        w.u8(self.mode);
        w.u8(if self.integrity { FLAG_INTEGRITY } else { 0 });
        w.u8(self.dirty_share_pct.unwrap_or(0));
        w.u16(self.name.len() as u16);
        w.bytes(self.name.as_bytes());
        w.skip(VOLUME_NAME_MAX_BYTES - self.name.len());
        w.u16(self.origin_identity.len() as u16);
        w.bytes(self.origin_identity.as_bytes());
        w.skip(ORIGIN_IDENTITY_MAX_BYTES - self.origin_identity.len());
        debug_assert_eq!(w.position(), ORIGIN_SIZE_OFFSET);
        w.u64(self.origin_size_bytes);
        self.settings.encode(&mut w);
        debug_assert_eq!(w.position(), TAG_FIRST_PAGE_OFFSET);
        w.u64(self.tag_first_page);
        debug_assert_eq!(w.position(), RESERVED_OFFSET);
    }

    /// Read and check one entry (device contents: anything impossible is
    /// an error).
    pub fn decode(buf: &[u8]) -> Result<VolumeEntry, DecodeError> {
        let buf = crate::codec::prefix(buf, VOLUME_ENTRY_BYTES)?;
        let mut r = Reader::new(buf);
        let id = r.u16()?;
        let state_code = r.u8()?;
        let state = VolumeState::from_code(state_code).ok_or(DecodeError::OutOfRange {
            field: "volume_state",
            value: state_code as u64,
        })?;
        let mode = r.u8()?;
        let flags = r.u8()?;
        if flags & !FLAGS_KNOWN != 0 {
            return Err(DecodeError::OutOfRange {
                field: "volume_flags",
                value: flags as u64,
            });
        }
        let share = r.u8()?;
        let name = padded_text(&mut r, VOLUME_NAME_MAX_BYTES, "volume_name")?;
        let origin_identity =
            padded_text(&mut r, ORIGIN_IDENTITY_MAX_BYTES, "volume_origin_identity")?;
        let origin_size_bytes = r.u64()?;
        let settings = StoredSettings::decode(&mut r)?;
        let tag_first_page = r.u64()?;
        if buf[RESERVED_OFFSET..].iter().any(|&b| b != 0) {
            return Err(DecodeError::OutOfRange {
                field: "volume_entry_reserved",
                value: 0,
            });
        }
        let entry = VolumeEntry {
            id,
            state,
            name,
            origin_identity,
            origin_size_bytes,
            mode,
            integrity: flags & FLAG_INTEGRITY != 0,
            dirty_share_pct: (share != 0).then_some(share),
            settings,
            tag_first_page,
        };
        entry.check()?;
        Ok(entry)
    }
}

/// A length-prefixed UTF-8 field padded with zeroes to `max` bytes; the
/// padding must be zero, so a stray write into it is seen as damage.
fn padded_text(r: &mut Reader, max: usize, field: &'static str) -> Result<String, DecodeError> {
    let len = r.u16()? as usize;
    if len > max {
        return Err(DecodeError::OutOfRange {
            field,
            value: len as u64,
        });
    }
    let text = r.bytes(max)?;
    if text[len..].iter().any(|&b| b != 0) {
        return Err(DecodeError::OutOfRange {
            field,
            value: len as u64,
        });
    }
    String::from_utf8(text[..len].to_vec()).map_err(|_| DecodeError::OutOfRange {
        field,
        value: len as u64,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample(id: u16, name: &str) -> VolumeEntry {
        VolumeEntry {
            id,
            state: VolumeState::Active,
            name: name.into(),
            origin_identity: format!("file:/srv/origin-{id}.img"),
            origin_size_bytes: 1 << 30,
            mode: 0,
            integrity: id % 2 == 1,
            dirty_share_pct: Some(40),
            settings: StoredSettings {
                writeback_high_pct: Some(70),
                ..Default::default()
            },
            tag_first_page: if id % 2 == 1 { 3 * id as u64 } else { 0 },
        }
    }

    fn encoded(entry: &VolumeEntry) -> Vec<u8> {
        let mut buf = vec![0u8; VOLUME_ENTRY_BYTES];
        entry.encode(&mut buf);
        buf
    }

    #[test]
    fn an_entry_round_trips_with_its_longest_fields() {
        let mut e = sample(7, &"n".repeat(VOLUME_NAME_MAX_BYTES));
        e.origin_identity = "é".repeat(ORIGIN_IDENTITY_MAX_BYTES / 2);
        e.state = VolumeState::Removing;
        e.dirty_share_pct = None;
        assert_eq!(VolumeEntry::decode(&encoded(&e)), Ok(e));
    }

    #[test]
    fn impossible_entries_are_refused() {
        let good = encoded(&sample(1, "a"));
        // (byte offset, value) pairs that each make the entry impossible.
        let damage: [(usize, u8); 7] = [
            (2, 0),                      // state 0
            (2, 3),                      // state 3
            (4, 0x80),                   // an unknown flag
            (5, 101),                    // a share over 100%
            (NAME_OFFSET, 200),          // name longer than its field
            (NAME_OFFSET + 2 + 5, 1),    // a byte in the name's padding
            (VOLUME_ENTRY_BYTES - 1, 1), // a reserved byte
        ];
        for (at, value) in damage {
            let mut bad = good.clone();
            bad[at] = value;
            assert!(VolumeEntry::decode(&bad).is_err(), "byte {at} = {value}");
        }
        let mut not_utf8 = good.clone();
        not_utf8[NAME_OFFSET + 2] = 0xff;
        assert!(VolumeEntry::decode(&not_utf8).is_err());
        assert!(VolumeEntry::decode(&good[..VOLUME_ENTRY_BYTES - 1]).is_err());
        assert!(VolumeEntry::decode(&good).is_ok());
    }

    #[test]
    fn check_refuses_what_a_user_could_type() {
        assert!(sample(0, &"x".repeat(VOLUME_NAME_MAX_BYTES + 1))
            .check()
            .is_err());
        let mut e = sample(0, "");
        e.origin_identity = "y".repeat(ORIGIN_IDENTITY_MAX_BYTES + 1);
        assert!(e.check().is_err());
        e = sample(0, "");
        e.dirty_share_pct = Some(0);
        assert!(e.check().is_err());
        // A tag extent without integrity is impossible.
        e = sample(0, "");
        e.tag_first_page = 1;
        assert!(e.check().is_err());
        assert!(sample(0, "").check().is_ok());
        assert!(sample(crate::VOLUMES_MAX as u16 - 1, "").check().is_ok());
        assert!(sample(crate::VOLUMES_MAX as u16, "").check().is_err());
    }
}
