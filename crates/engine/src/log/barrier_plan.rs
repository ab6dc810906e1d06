//! What one group-commit barrier covers.

use std::sync::Arc;

use crate::sealed::SealedRecord;

pub(crate) struct BarrierPlan {
    /// Every record up to this sequence is durable once the barrier ends.
    pub(crate) target: u64,
    /// Sealed records nobody is writing: the barrier's caller writes them.
    pub(crate) to_write: Vec<Arc<SealedRecord>>,
    /// Records another call is writing: the barrier waits for them.
    pub(crate) in_flight: Vec<Arc<SealedRecord>>,
    /// Blocks sealed since the last completed barrier, these included: if
    /// they are all in `to_write`, one write plus fdatasync may be retried.
    pub(crate) unsynced_blocks: u64,
}
