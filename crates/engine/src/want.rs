//! What a write-back step is for: which volumes, and what its caller
//! waits for.

use crate::volume_set::VolumeSet;

/// Which volumes a write-back step is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Want {
    /// The daemon's loop: the volume furthest behind whose lane is free,
    /// except those backing off after a failure of their origin.
    Background,
    /// These volumes (a drain), backoff or not: the one furthest behind,
    /// waiting for its lane.
    Volumes(VolumeSet),
    /// A writer that needs one of these volumes to move on (a
    /// write-through write, a volume at its dirty share), backoff or not:
    /// the one furthest behind; if a step of it is running, wait for that
    /// step to end and return without one (the caller checks again).
    /// Running a second step after the running one would make the writer
    /// wait for two, and with a slow origin the lane's other takers (the
    /// volume's own writers, the background) won it again and again.
    Progress(VolumeSet),
    /// [`Want::Progress`] of a volume at the least write-back position,
    /// which pins the tail (a writer waiting for space).
    Laggards,
    /// [`Want::Progress`] of one volume for the write-through writes that
    /// wait for their origin: if none of its epochs is left to write back
    /// (theirs is still open), end one first, covering every write made so
    /// far. Write-through writes in flight together then share one epoch
    /// and one step, where an epoch per write cost a step each.
    Through(u16),
}
