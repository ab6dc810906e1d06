use cairn_device::DeviceError;
use cairn_format::{DecodeError, LayoutError};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    #[error("{device} is not a cairn cache (no valid superblock)")]
    NotFormatted { device: String },
    #[error(
        "{device} already holds a cairn cache (formatted for origin {origin}); refusing to format over it"
    )]
    AlreadyFormatted { device: String, origin: String },
    #[error("{device} has no cairn superblock left, but holds the other structures of a cairn cache (volume table, checkpoints or log records): its superblocks were overwritten. The cache cannot be opened")]
    SuperblocksMissing { device: String },
    #[error("the mode is now {mode} (new writes follow it), but the dirty data written before could not all be written back yet ({dirty_blocks} dirty blocks left in the cache): {source}")]
    ModeSetNotDrained {
        mode: &'static str,
        dirty_blocks: u64,
        #[source]
        source: Box<EngineError>,
    },
    #[error("{device} holds {what}; refusing to format over it")]
    HoldsData {
        device: String,
        what: cairn_format::ExistingContents,
    },
    #[error("{device}: both superblock copies are damaged (copy A: {copy_a}; copy B: {copy_b}). The cache cannot be opened")]
    SuperblockDamaged {
        device: String,
        copy_a: DecodeError,
        copy_b: DecodeError,
    },
    #[error(
        "this cache was formatted for origin {recorded}, but it is being opened with origin {given}"
    )]
    WrongOrigin { recorded: String, given: String },
    #[error(
        "origin {origin} is {given_bytes} bytes, but the cache recorded {recorded_bytes} bytes: the origin changed size"
    )]
    OriginSizeChanged {
        origin: String,
        recorded_bytes: u64,
        given_bytes: u64,
    },
    #[error("origin {origin} is too large: {size_bytes} bytes exceeds the {max_bytes}-byte limit for block size {block_size_bytes}")]
    OriginTooLarge {
        origin: String,
        size_bytes: u64,
        max_bytes: u64,
        block_size_bytes: u32,
    },
    #[error("origin {origin} is {size_bytes} bytes; it must be a non-zero multiple of the block size {block_size_bytes}")]
    OriginSizeUnaligned {
        origin: String,
        size_bytes: u64,
        block_size_bytes: u32,
    },
    #[error("cache {device}: {layout}")]
    Layout {
        device: String,
        // Shown in the message, so not also chained as a source (error
        // reporters would print it twice).
        layout: LayoutError,
    },
    #[error("cache {device} is {size_bytes} bytes but the superblock records {recorded_bytes}; it was truncated or is the wrong device")]
    CacheShrunk {
        device: String,
        size_bytes: u64,
        recorded_bytes: u64,
    },
    #[error("volume {name:?} (origin {origin}) was not given its origin device")]
    VolumeOriginMissing { name: String, origin: String },
    #[error("volume {name:?}: its origin {origin} cannot be opened: {detail}")]
    VolumeOriginOpen {
        name: String,
        origin: String,
        detail: String,
    },
    #[error("no volume is named {name:?}")]
    VolumeNotFound { name: String },
    #[error("volume {name:?} is the cache's first volume (the one format made, which clients that name no export get, and which integrity tags cover); it stays as long as the cache")]
    FirstVolumeKept { name: String },
    #[error("volume {name:?} still has {dirty_blocks} dirty blocks after write-back (its origin failed?); it was not removed")]
    VolumeNotDrained { name: String, dirty_blocks: u64 },
    #[error("volume {name:?} has {blocks} blocks whose dirty data failed its checksum in the cache (they read as EIO until rewritten); removing it would leave the origin's older data in their place, so it was not removed")]
    VolumeHasLostBlocks { name: String, blocks: u64 },
    #[error("a volume named {name:?} exists already")]
    VolumeExists { name: String },
    #[error("origin {origin} is volume {name:?}'s already: two volumes writing back to one origin would overwrite each other")]
    OriginInUse { origin: String, name: String },
    #[error("the cache's integrity tag area has no room for this origin's tags: they take {needed_pages} pages, and {free_pages} of the area's {area_pages} are free (the largest free run is what counts)")]
    NoTagRoom {
        needed_pages: u64,
        free_pages: u64,
        area_pages: u64,
    },
    #[error("the cache serves {max} volumes already, the most it can")]
    TooManyVolumes { max: usize },
    #[error("volume {volume_id} is not served by this cache (it was removed, or never added)")]
    NoSuchVolume { volume_id: u16 },
    #[error("cache {device}: the volume cannot be made: {detail}")]
    InvalidVolume { device: String, detail: String },
    #[error("cache {device}: superblock invalid: {detail}. The cache cannot be opened safely")]
    SuperblockInvalid { device: String, detail: String },
    /// `detail` names the checkpoint (its slot and where it lies) and
    /// the check it failed.
    #[error("cache {device}: checkpoint damaged: {detail}. The cache cannot be opened safely: the checkpoint maps the cached blocks, among them data not yet written back to the origin, and the older checkpoint in the other slot may describe log space written over since, so it is not used instead")]
    CheckpointDamaged { device: String, detail: String },
    /// The cache device failed a read of the active checkpoint (an I/O
    /// error, not a failed check): the read's bytes are
    /// `offset_bytes..offset_bytes + length_bytes` of `slot`.
    #[error(
        "cache {device}: reading the newest checkpoint (number {checkpoint_sequence} in slot {slot}) failed: the device did not deliver bytes {offset_bytes}..{} ({length_bytes} bytes at byte offset {offset_bytes}): {source}. The cache cannot be opened without it: the checkpoint maps the cached blocks, among them data not yet written back to the origin",
        offset_bytes + length_bytes
    )]
    CheckpointUnreadable {
        device: String,
        checkpoint_sequence: u64,
        slot: u8,
        offset_bytes: u64,
        length_bytes: u64,
        #[source]
        source: DeviceError,
    },
    #[error("cache {device}: log damaged: {detail}. Refusing to open, because acknowledged writes would be missing")]
    LogDamaged { device: String, detail: String },
    #[error("cache device: {0}")]
    Cache(DeviceError),
    #[error("origin: {0}")]
    Origin(DeviceError),
    /// `lba` is the block's key (`cairn_format::block_key`).
    #[error(
        "block {} of volume {} is dirty in the cache and failed its checksum; its data is lost",
        cairn_format::key_lba(*lba),
        cairn_format::key_volume(*lba)
    )]
    DirtyBlockCorrupt { lba: u64 },
    #[error("origin block {lba} (byte offset {offset_bytes}) of volume {volume_id} does not match its integrity tag: the origin returned corrupt or misplaced data")]
    OriginCorrupt {
        volume_id: u16,
        lba: u64,
        offset_bytes: u64,
    },
    #[error("request at offset {offset} length {length_bytes} is past the end of the {size_bytes}-byte volume")]
    OutOfRange {
        offset: u64,
        length_bytes: u64,
        size_bytes: u64,
    },
    #[error("the engine stopped after an earlier cache device failure ({0}); restart to recover")]
    Failed(String),
    /// Internal: a cache write failed for good, or the engine went degraded,
    /// while this request was on the normal path. `Engine::with_degrade`
    /// switches to degraded mode and re-runs the request; clients never see
    /// this (if one did, it would get EIO).
    #[error("the cache device is switching to degraded mode")]
    DegradeRequired,
    #[error("a cache write failed for good, and the switch to degraded mode failed too ({failure}); it is tried again in {retry_in_ms} ms (the cache is not written meanwhile)")]
    DegradeDelayed { failure: String, retry_in_ms: u64 },
    #[error("{0}. Refusing to touch the cache: report this CPU (see /proc/cpuinfo) as a bug")]
    ChecksumImplementation(String),
    #[error("cache {device} is degraded (a cache write failed for good; every write goes straight to the origin), so {action} is not possible")]
    CacheDegraded { device: String, action: String },
    /// A write-back step this request waited for, run once for it and for
    /// every other request waiting for the same step, failed: that
    /// step's error, as its errno and message.
    #[error("{message}")]
    WritebackStep {
        errno: i32,
        message: String,
        /// The step failed because an origin did.
        origin_failed: bool,
    },
    /// A write found no room in the cache, and the write-back that must
    /// make some kept failing for as long as writers wait.
    #[error("volume {volume_id}'s origin fenced this cairn (another client took it over): new writes are refused until cairn is restarted; the writes acknowledged before stay in the cache")]
    OriginFenced { volume_id: u16 },
    #[error("no room in the cache for this write: the write-back that must make room keeps failing ({cause}); writes go on once the origin takes data again")]
    NoSpace { cause: String },
}

impl EngineError {
    /// The errno a client should see.
    pub fn errno(&self) -> i32 {
        match self {
            EngineError::OutOfRange { .. } => libc::EINVAL,
            EngineError::Cache(e) | EngineError::Origin(e) => e.errno(),
            EngineError::CheckpointUnreadable { source, .. } => source.errno(),
            EngineError::WritebackStep { errno, .. } => *errno,
            EngineError::NoSpace { .. } => libc::ENOSPC,
            _ => libc::EIO,
        }
    }
}

impl EngineError {
    /// Did an origin fail (directly, or in a write-back step run for this
    /// request)?
    pub(crate) fn is_origin_failure(&self) -> bool {
        matches!(
            self,
            EngineError::Origin(_)
                | EngineError::WritebackStep {
                    origin_failed: true,
                    ..
                }
        )
    }
}

pub type EngineResult<T> = Result<T, EngineError>;
