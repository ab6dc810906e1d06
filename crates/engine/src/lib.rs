//! The cairn engine: a log-structured, checksummed write-back cache between
//! a fast cache device and a slow origin, with ordered write-back.
//!
//! Shape (see `docs/design.md`, "Where things live"):
//! - [`Engine`] (`engine.rs`) holds the parts behind one lock, switches to
//!   degraded mode, and has the entry points.
//! - Parts that own their state: the log (`log/`: positions, the open
//!   record, sealing, flush, eviction), the sealed records in flight
//!   (`sealed/`), the index (`index/`: slots, forward map, ranges, lost
//!   blocks; plan, insert, retire), integrity tags (`tags.rs`), the read
//!   policy (`policy/`), write-back (`writeback.rs`, `group/`), the
//!   engine's health (`health.rs`).
//! - Request paths over those parts: `read/`, `write/`, `degrade/`,
//!   `integrity/`; and the steps that touch several parts at once:
//!   `space.rs`, `checkpoint/`, `recovery/`, `format.rs`, `open.rs`.
//!
//! The engine has no threads and no clocks of its own: the daemon drives
//! background write-back by calling [`Engine::writeback_step`], and tests
//! drive everything deterministically.

mod block_status;
mod checkpoint;
mod commit;
mod degrade;
mod engine;
mod env;
mod error;
mod flush_by;
mod format;
mod group;
mod health;
mod index;
mod inspection;
mod integrity;
mod lifetime;
mod log;
mod open;
mod options;
mod origin_check;
mod origin_claims;
mod origin_health;
mod origin_retry;
mod origins;
mod parts;
mod policy;
mod read;
mod read_data;
mod read_kind;
mod recovery;
mod retry;
mod retry_policy;
mod sealed;
mod space;
mod state;
mod state_lock;
mod stats;
mod superblocks;
mod sync_watch;
mod tags;
mod unopened_origin;
mod upgrade;
mod volume_admin;
mod volume_origin;
mod volume_set;
mod volume_status;
mod volume_tags;
mod want;
mod write;
mod write_lane;
mod writeback;
mod writeback_requests;

pub use block_status::{BlockState, BlockStatusRun};
pub use engine::Engine;
pub use error::{EngineError, EngineResult};
pub use inspection::Inspection;
pub use integrity::{RecalcProgress, ScrubOptions, ScrubReport};
pub use open::OriginResolver;
pub use options::{EngineConfig, FormatOptions, OpenOptions};
pub use policy::CacheMode;
pub use read_data::ReadData;
pub use stats::StatsSnapshot;
pub use volume_admin::NewVolume;
pub use volume_status::VolumeStatus;
pub use writeback::WritebackProgress;

pub use cairn_format::{
    StoredSettings, Superblock, VolumeEntry, VolumeState, VolumeTable, SETTINGS_COUNT,
};
