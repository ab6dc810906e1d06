//! Whole-volume integrity beyond the read path: recalculating tags over
//! data that predates the format, and scrubbing the origin (with repair
//! from clean cached copies).
//!
//! Every path that changes the origin holds the write-back lock
//! (write-back, origin repair) and every path here that reads the origin
//! to set or judge a tag holds it too, so a tag and the origin block it
//! describes are never seen half updated.

mod recalc;
mod scrub;

pub use recalc::RecalcProgress;
pub(crate) use recalc::{progress_of, recalc_step};
pub(crate) use scrub::scrub_origin;
pub use scrub::{ScrubOptions, ScrubReport};

/// Blocks read from the origin per recalculation or scrub step.
pub const INTEGRITY_STEP_BYTES: u64 = 1 << 20;
