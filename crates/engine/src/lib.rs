//! The cairn engine: a log-structured, checksummed write-back cache between
//! a fast cache device and a slow origin, with ordered write-back.
//!
//! Shape (see `docs/design.md`):
//! - Writes are appended to an in-memory *open record*; a client FLUSH (or a
//!   FUA write) seals it into the circular log with one vectored write and
//!   costs one device barrier.
//! - The index maps origin blocks to log slots (15 bytes per slot).
//! - Write-back copies sealed records to the origin in log order, one epoch
//!   group (the records between two flushes) at a time, flushing the origin
//!   after each group, so the origin alone is always the volume as of some
//!   past flush.
//! - Recovery loads the newest checkpoint and replays the log after it.
//!
//! The engine has no threads and no clocks of its own: the daemon drives
//! background write-back by calling [`Engine::writeback_step`], and tests
//! drive everything deterministically.

mod degrade;
mod engine;
mod error;
mod index;
mod inflight;
mod integrity;
mod log;
mod policy;
mod ranges;
mod read;
mod read_batch;
mod recovery;
mod stats;
mod tags;
mod write;
mod writeback;

pub use engine::{Engine, EngineConfig, FormatOptions, OpenOptions, WritebackProgress};
pub use error::{EngineError, EngineResult};
pub use integrity::{RecalcProgress, ScrubOptions, ScrubReport};
pub use policy::CacheMode;
pub use stats::StatsSnapshot;

pub use cairn_format::Superblock;
