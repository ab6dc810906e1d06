//! Each volume's write-back position in the shared log. Volume `v`'s
//! origin holds every block of `v` sealed before its position (and was
//! flushed after them), so each origin alone is its volume as of some past
//! flush; a volume whose origin is slow or failing lags without holding
//! the others back. The least position is the cache's write-back
//! position: every slot before it is clean, whichever volume it holds, so
//! only the tail waits for the laggard.

use cairn_format::VOLUMES_MAX;

use crate::volume_set::VolumeSet;

#[derive(Debug, Clone)]
pub(crate) struct WritebackCursors {
    /// By volume id; meaningful only for ids in `present`.
    positions: [u64; VOLUMES_MAX],
    present: VolumeSet,
}

impl WritebackCursors {
    /// The cursors of `volumes` (id, position); at least one volume.
    pub(crate) fn new(volumes: &[(u16, u64)]) -> WritebackCursors {
        let mut cursors = WritebackCursors {
            positions: [0; VOLUMES_MAX],
            present: VolumeSet::EMPTY,
        };
        for &(id, position) in volumes {
            cursors.insert(id, position);
        }
        assert!(!cursors.present.is_empty(), "a cache serves a volume");
        cursors
    }

    pub(crate) fn volumes(&self) -> VolumeSet {
        self.present
    }

    pub(crate) fn get(&self, id: u16) -> Option<u64> {
        self.present
            .contains(id)
            .then(|| self.positions[id as usize])
    }

    /// The least position: the cache's write-back position.
    pub(crate) fn least(&self) -> u64 {
        self.present
            .iter()
            .map(|id| self.positions[id as usize])
            .min()
            .expect("a cache serves a volume")
    }

    /// The volumes of `among` whose cursor stands at `position`.
    pub(crate) fn at(&self, position: u64, among: VolumeSet) -> VolumeSet {
        let mut set = VolumeSet::EMPTY;
        for id in self.present.intersection(among).iter() {
            if self.positions[id as usize] == position {
                set.insert(id);
            }
        }
        set
    }

    /// Each volume and its position, by id.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u16, u64)> + '_ {
        self.present
            .iter()
            .map(|id| (id, self.positions[id as usize]))
    }

    /// A volume joins (added: it has nothing in the log before `position`).
    pub(crate) fn insert(&mut self, id: u16, position: u64) {
        assert!(!self.present.contains(id), "volume {id} has a cursor");
        self.present.insert(id);
        self.positions[id as usize] = position;
    }

    /// A volume leaves (removed). The last one never does.
    pub(crate) fn remove(&mut self, id: u16) {
        self.present.remove(id);
        assert!(!self.present.is_empty(), "a cache serves a volume");
    }

    /// Volume `id`'s blocks before `position` are on its origin.
    pub(crate) fn advance(&mut self, id: u16, position: u64) {
        let at = self.get(id).expect("advance a volume that has a cursor");
        assert!(position > at, "write-back of volume {id} moves forward");
        self.positions[id as usize] = position;
    }

    /// Every volume is written back to `position` (degraded mode drained
    /// the whole log). Never moves a cursor back.
    pub(crate) fn raise_all(&mut self, position: u64) {
        for id in self.present.iter() {
            let at = &mut self.positions[id as usize];
            assert!(*at <= position, "write-back never moves back");
            *at = position;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::WritebackCursors;
    use crate::volume_set::VolumeSet;

    #[test]
    fn the_least_cursor_is_the_caches_position() {
        let mut c = WritebackCursors::new(&[(0, 10), (3, 4), (7, 10)]);
        assert_eq!(c.least(), 4);
        assert_eq!(
            c.at(10, VolumeSet::all()).iter().collect::<Vec<_>>(),
            vec![0, 7]
        );
        assert_eq!(c.at(10, VolumeSet::single(7)), VolumeSet::single(7));
        c.advance(3, 12);
        assert_eq!(c.least(), 10);
        c.remove(0);
        c.remove(7);
        assert_eq!(c.least(), 12);
        assert_eq!(c.get(0), None);
        c.insert(0, 12);
        c.raise_all(20);
        assert_eq!(c.iter().collect::<Vec<_>>(), vec![(0, 20), (3, 20)]);
    }

    #[test]
    #[should_panic(expected = "moves forward")]
    fn a_cursor_never_moves_back() {
        let mut c = WritebackCursors::new(&[(0, 10)]);
        c.advance(0, 10);
    }
}
