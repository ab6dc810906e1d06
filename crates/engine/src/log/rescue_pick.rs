//! A clean block the tail picked to move forward rather than evict, and
//! how the picks of one eviction pass are read: in runs of adjacent slots
//! (a working set moved forward lies in long runs), each block checked
//! against its checksum after the read.

use cairn_format::block_checksum;

use crate::env::Env;

/// Adjacent slots read at once, at most (bounds the run buffer).
const RUN_BLOCKS_MAX: usize = 256;

#[derive(Debug, Clone, Copy)]
pub(crate) struct RescuePick {
    pub(crate) slot: u32,
    pub(crate) lba: u64,
    pub(crate) crc: u32,
    /// Picked for its volume's share of the cache, not for a recent hit.
    pub(crate) for_share: bool,
}

impl RescuePick {
    /// Read the picked blocks (their slots are retired but not yet
    /// overwritten: nothing is appended during an eviction pass). Returns
    /// `(lba, block, for_share)` for each one that read back intact; a
    /// block that does not is evicted like the others.
    pub(crate) fn read_all(env: &Env, picks: &[RescuePick]) -> Vec<(u64, Vec<u8>, bool)> {
        let bs = env.block_size_bytes;
        let mut rescued = Vec::with_capacity(picks.len());
        let mut run_buf = Vec::new();
        let mut start = 0;
        while start < picks.len() {
            let mut end = start + 1;
            while end < picks.len()
                && end - start < RUN_BLOCKS_MAX
                && picks[end].slot == picks[end - 1].slot + 1
            {
                end += 1;
            }
            let run = &picks[start..end];
            run_buf.resize(run.len() * bs, 0);
            let mut read_ok = vec![true; run.len()];
            if env.read_slot(run[0].slot, &mut run_buf).is_err() {
                // One bad sector should not cost the whole run: read the
                // run's blocks one by one.
                for ((pick, block), ok) in run.iter().zip(run_buf.chunks_mut(bs)).zip(&mut read_ok)
                {
                    *ok = env.read_slot(pick.slot, block).is_ok();
                }
            }
            for ((pick, block), ok) in run.iter().zip(run_buf.chunks(bs)).zip(read_ok) {
                // Check data after reading it: only a verified copy moves.
                if ok && block_checksum(pick.lba, block) == pick.crc {
                    rescued.push((pick.lba, block.to_vec(), pick.for_share));
                }
            }
            start = end;
        }
        assert!(rescued.len() <= picks.len());
        rescued
    }
}
