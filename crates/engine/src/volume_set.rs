//! A set of volume ids, as one bit per id (ids are below `VOLUMES_MAX`):
//! which volumes a write-back step serves, which of them reached their
//! origin, which a drain waits for.

use cairn_format::VOLUMES_MAX;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct VolumeSet(u32);

const _: () = assert!(VOLUMES_MAX <= u32::BITS as usize);

impl VolumeSet {
    pub(crate) const EMPTY: VolumeSet = VolumeSet(0);

    /// Every possible id.
    pub(crate) fn all() -> VolumeSet {
        VolumeSet(if VOLUMES_MAX == 32 {
            u32::MAX
        } else {
            (1u32 << VOLUMES_MAX) - 1
        })
    }

    pub(crate) fn single(id: u16) -> VolumeSet {
        let mut set = VolumeSet::EMPTY;
        set.insert(id);
        set
    }

    pub(crate) fn insert(&mut self, id: u16) {
        assert!((id as usize) < VOLUMES_MAX, "volume id {id} out of range");
        self.0 |= 1 << id;
    }

    pub(crate) fn remove(&mut self, id: u16) {
        if (id as usize) < VOLUMES_MAX {
            self.0 &= !(1 << id);
        }
    }

    pub(crate) fn contains(self, id: u16) -> bool {
        (id as usize) < VOLUMES_MAX && self.0 & (1 << id) != 0
    }

    pub(crate) fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub(crate) fn intersection(self, other: VolumeSet) -> VolumeSet {
        VolumeSet(self.0 & other.0)
    }

    pub(crate) fn without(self, other: VolumeSet) -> VolumeSet {
        VolumeSet(self.0 & !other.0)
    }

    /// The ids in the set, lowest first.
    pub(crate) fn iter(self) -> impl Iterator<Item = u16> {
        (0..VOLUMES_MAX as u16).filter(move |&id| self.contains(id))
    }
}

#[cfg(test)]
mod tests {
    use super::VolumeSet;

    #[test]
    fn set_operations_keep_exactly_their_ids() {
        let mut a = VolumeSet::single(0);
        a.insert(31);
        a.insert(5);
        assert_eq!(a.iter().collect::<Vec<_>>(), vec![0, 5, 31]);
        assert!(a.contains(31) && !a.contains(30) && !a.contains(40));
        let b = VolumeSet::single(5);
        assert_eq!(a.without(b).iter().collect::<Vec<_>>(), vec![0, 31]);
        assert_eq!(a.intersection(b), b);
        a.remove(0);
        a.remove(5);
        a.remove(31);
        assert!(a.is_empty());
        assert_eq!(VolumeSet::all().iter().count(), 32);
    }
}
