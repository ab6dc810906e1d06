//! The admin protocol between `cairn <command>` and the daemon serving the
//! cache, over a Unix socket: one request line from the client, then reply
//! lines from the daemon, the last of them `Ok` or `Error`. Every line is
//! one JSON object.
//!
//! ```text
//! > {"version":1,"command":"warm","offset_bytes":0,"length_bytes":1048576}
//! < {"reply":"progress","done":128,"total":256}
//! < {"reply":"warmed","cached_blocks":256}
//! < {"reply":"ok"}
//! ```
//!
//! Any local user who can connect reaches the daemon, so a request is
//! decoded defensively: a bounded line, a version check, a known command
//! and typed arguments, each failure answered with an `Error` reply.

pub mod client;
mod command_error;
pub mod exec;
pub mod server;
mod settings_change;

pub use command_error::CommandError;
pub use settings_change::SettingsChange;

use std::io::{BufRead, Read as _, Write};
use std::path::{Path, PathBuf};

use cairn_engine::CacheMode;
use serde::{Deserialize, Serialize};

/// Bumped when a request or reply changes meaning; a daemon refuses a
/// request of another version instead of guessing.
pub const PROTOCOL_VERSION: u64 = 1;

/// The longest request line a daemon reads. Requests are a few dozen bytes.
pub const REQUEST_LINE_BYTES_MAX: usize = 4096;

/// The longest reply line a client reads: a status object is a few KiB.
pub const REPLY_LINE_BYTES_MAX: usize = 1 << 20;

/// The command names a daemon knows, in the order `--help` would list them.
pub const COMMANDS: [&str; 11] = [
    "status",
    "flush",
    "check",
    "check_origin",
    "mode",
    "warm",
    "set",
    "volume_add",
    "volume_set",
    "volume_list",
    "volume_remove",
];

/// What a client asks of the daemon. Each is also run offline, by the CLI
/// on devices it opened itself (see [`exec::execute`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case")]
pub enum AdminRequest {
    /// The status object (`cairn status`).
    Status,
    /// Write back every dirty block (`cairn flush`).
    Flush,
    /// Verify every cached block's checksum (`cairn check`).
    Check,
    /// Scrub the origin against its integrity tags (`cairn check --origin`).
    CheckOrigin {
        /// 0: no limit.
        rate_bytes_per_s: u64,
        repair: bool,
    },
    /// Switch the cache mode, draining first where needed (`cairn mode`).
    Mode {
        #[serde(with = "mode_name")]
        mode: CacheMode,
    },
    /// Read a range so it is promoted into the cache (`cairn warm`).
    Warm {
        offset_bytes: u64,
        length_bytes: u64,
    },
    /// Store policy settings in the cache, and apply them while serving
    /// (`cairn set`).
    Set { change: SettingsChange },
    /// Add a volume on another origin, exported under `name` at once when
    /// served (`cairn volume add`). The daemon opens `origin` itself.
    VolumeAdd {
        name: String,
        origin: String,
        #[serde(with = "mode_name")]
        mode: CacheMode,
        integrity: bool,
        /// Percent of the log its dirty data may hold while other volumes
        /// use the cache; absent for the default.
        #[serde(default)]
        dirty_share_pct: Option<u8>,
    },
    /// Change a volume's mode and/or dirty share (`cairn volume set`);
    /// `dirty_share_pct` 0 is the default share.
    VolumeSet {
        name: String,
        #[serde(default, with = "mode_name_opt")]
        mode: Option<CacheMode>,
        #[serde(default)]
        dirty_share_pct: Option<u8>,
    },
    /// The volumes (`cairn volume list`).
    VolumeList,
    /// Drain a volume, then drop it from the cache; refused while clients
    /// are connected to its export unless `force`, which disconnects them
    /// (`cairn volume remove`).
    VolumeRemove { name: String, force: bool },
}

impl AdminRequest {
    pub fn name(&self) -> &'static str {
        match self {
            AdminRequest::Status => "status",
            AdminRequest::Flush => "flush",
            AdminRequest::Check => "check",
            AdminRequest::CheckOrigin { .. } => "check_origin",
            AdminRequest::Mode { .. } => "mode",
            AdminRequest::Warm { .. } => "warm",
            AdminRequest::Set { .. } => "set",
            AdminRequest::VolumeAdd { .. } => "volume_add",
            AdminRequest::VolumeSet { .. } => "volume_set",
            AdminRequest::VolumeList => "volume_list",
            AdminRequest::VolumeRemove { .. } => "volume_remove",
        }
    }
}

/// What the daemon answers: any number of the informational replies, then
/// exactly one `Ok` or `Error`, after which the daemon closes the
/// connection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum AdminReply {
    /// Work done so far, in blocks (at most one every
    /// [`exec::PROGRESS_INTERVAL_MS`], and always the last step).
    Progress { done: u64, total: u64 },
    /// `check`: a cached block that failed its checksum.
    BadBlock { lba: u64, offset_bytes: u64 },
    /// `check_origin`: an origin block that does not match its tag and was
    /// not repaired: repair was off, or there was no clean cached copy
    /// matching the tag, or rewriting the origin failed.
    /// `volume` names the volume (absent from daemons that predate it: the
    /// first volume). `cached_copy`: repair was off and the cache holds a
    /// clean copy (not checked) that a repair would try.
    OriginMismatch {
        #[serde(default)]
        volume: String,
        lba: u64,
        offset_bytes: u64,
        #[serde(default)]
        cached_copy: bool,
    },
    /// `check_origin`: an origin block rewritten from its clean cached copy.
    OriginRepaired {
        #[serde(default)]
        volume: String,
        lba: u64,
        offset_bytes: u64,
    },
    /// `set`: the settings now (`settings` as in status), and those stored
    /// that take effect only at the next start.
    SettingsStored {
        settings: serde_json::Value,
        restart_needed: Vec<String>,
    },
    /// `status`: the status object (see `status::status_json`).
    Status { status: serde_json::Value },
    /// `flush` and `mode`: write-back finished. `unrecoverable_blocks` are
    /// dirty blocks that failed their checksum and can never reach the
    /// origin.
    Drained {
        blocks_written: u64,
        unrecoverable_blocks: u64,
    },
    /// `check_origin` totals. Every checked block is in exactly one of
    /// verified, unverified, discarded, skipped, and the repaired and
    /// mismatch replies (`blocks_discarded` is absent from daemons that
    /// predate it).
    Scrubbed {
        blocks_checked: u64,
        blocks_verified: u64,
        blocks_unverified: u64,
        #[serde(default)]
        blocks_discarded: u64,
        blocks_skipped: u64,
    },
    /// `warm`: blocks of the range that are now cached.
    Warmed { cached_blocks: u64 },
    /// `volume_add`, `volume_list`: every volume (see
    /// `status::volumes_json`).
    Volumes { volumes: serde_json::Value },
    /// The request succeeded.
    Ok,
    /// The request failed: what happened, and how to fix it where the fix
    /// is known (see `advice`).
    Error {
        message: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        advice: Option<String>,
    },
}

impl AdminReply {
    pub fn error(message: impl Into<String>) -> AdminReply {
        AdminReply::Error {
            message: message.into(),
            advice: None,
        }
    }
}

/// Why a line is not a message this side understands.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("admin message longer than {max_bytes} bytes")]
    TooLong { max_bytes: usize },
    #[error("malformed admin message: {0}")]
    Malformed(String),
    #[error("admin protocol version {got} is not supported (this cairn speaks version {PROTOCOL_VERSION}); use the same cairn binary as the daemon")]
    Version { got: String },
    #[error("unknown admin command {0:?}; known commands: {list}", list = COMMANDS.join(", "))]
    UnknownCommand(String),
    #[error("admin command {command}: {detail}")]
    BadArguments {
        command: &'static str,
        detail: String,
    },
}

/// Where the admin socket of the daemon serving `cache` lives: in
/// [`runtime_dir`], named after the cache's canonical path.
pub fn socket_path(cache: &Path) -> PathBuf {
    let canonical = std::fs::canonicalize(cache).unwrap_or_else(|_| cache.to_path_buf());
    let key = cairn_format::crc32c(canonical.to_string_lossy().as_bytes());
    runtime_dir().join(format!("cairn-admin-{key:08x}.sock"))
}

/// The directory of admin sockets: `$CAIRN_RUNTIME_DIR`; else `/run/cairn`
/// for root (what the systemd unit's `RuntimeDirectory=cairn` makes, and
/// outside the unit's private /tmp, so `cairn status` in a shell finds the
/// daemon); else `$XDG_RUNTIME_DIR/cairn`; else the temporary directory.
pub fn runtime_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CAIRN_RUNTIME_DIR") {
        return PathBuf::from(dir);
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/run/cairn");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) => PathBuf::from(dir).join("cairn"),
        None => std::env::temp_dir(),
    }
}

/// Write one message as one line.
pub fn write_message(w: &mut impl Write, message: &impl Serialize) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(message)?;
    line.push(b'\n');
    // One write per line, so replies from one connection never interleave
    // with a half-written line.
    w.write_all(&line)
}

/// Read one line of at most `max_bytes` (newline excluded); `None` at end
/// of stream. A longer line is an error, not a buffer that grows.
pub fn read_line(r: &mut impl BufRead, max_bytes: usize) -> Result<Option<String>, ProtocolError> {
    let mut buf = Vec::new();
    r.take(max_bytes as u64 + 1).read_until(b'\n', &mut buf)?;
    if buf.is_empty() {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > max_bytes {
        return Err(ProtocolError::TooLong { max_bytes });
    }
    String::from_utf8(buf)
        .map(Some)
        .map_err(|_| ProtocolError::Malformed("not UTF-8".into()))
}

/// A request as it goes on the wire: the command and its arguments, plus
/// the protocol version.
#[derive(Serialize)]
pub struct Envelope<'a> {
    pub version: u64,
    #[serde(flatten)]
    pub request: &'a AdminRequest,
}

impl<'a> Envelope<'a> {
    pub fn new(request: &'a AdminRequest) -> Envelope<'a> {
        Envelope {
            version: PROTOCOL_VERSION,
            request,
        }
    }
}

/// Decode a request line, checking the version and the command by name
/// first so each failure gets its own clear message.
pub fn decode_request(line: &str) -> Result<AdminRequest, ProtocolError> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    let serde_json::Value::Object(mut map) = value else {
        return Err(ProtocolError::Malformed("not a JSON object".into()));
    };
    match map.remove("version") {
        Some(v) if v.as_u64() == Some(PROTOCOL_VERSION) => {}
        Some(v) => return Err(ProtocolError::Version { got: v.to_string() }),
        None => return Err(ProtocolError::Version { got: "none".into() }),
    }
    let command = match map.get("command") {
        Some(serde_json::Value::String(s)) => s.clone(),
        _ => return Err(ProtocolError::Malformed("no \"command\" string".into())),
    };
    let Some(&command) = COMMANDS.iter().find(|&&c| c == command) else {
        return Err(ProtocolError::UnknownCommand(command));
    };
    serde_json::from_value(serde_json::Value::Object(map)).map_err(|e| {
        ProtocolError::BadArguments {
            command,
            detail: e.to_string(),
        }
    })
}

pub fn decode_reply(line: &str) -> Result<AdminReply, ProtocolError> {
    serde_json::from_str(line).map_err(|e| ProtocolError::Malformed(e.to_string()))
}

/// A cache mode travels as its name (`writeback`, ...).
mod mode_name {
    use cairn_engine::CacheMode;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(mode: &CacheMode, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(mode.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<CacheMode, D::Error> {
        let name = String::deserialize(d)?;
        CacheMode::parse(&name).ok_or_else(|| {
            let names: Vec<&str> = CacheMode::ALL.iter().map(|m| m.name()).collect();
            serde::de::Error::custom(format!("unknown mode {name:?}; use {}", names.join(", ")))
        })
    }
}

/// [`mode_name`] of an optional mode (absent: no change).
mod mode_name_opt {
    use cairn_engine::CacheMode;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(mode: &Option<CacheMode>, s: S) -> Result<S::Ok, S::Error> {
        match mode {
            Some(mode) => super::mode_name::serialize(mode, s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<CacheMode>, D::Error> {
        #[derive(Deserialize)]
        struct Wrapped(#[serde(with = "super::mode_name")] CacheMode);
        Ok(Option::<Wrapped>::deserialize(d)?.map(|Wrapped(mode)| mode))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_request() -> Vec<AdminRequest> {
        vec![
            AdminRequest::Status,
            AdminRequest::Flush,
            AdminRequest::Check,
            AdminRequest::CheckOrigin {
                rate_bytes_per_s: 64 << 20,
                repair: true,
            },
            AdminRequest::Mode {
                mode: CacheMode::WriteAround,
            },
            AdminRequest::Warm {
                offset_bytes: u64::MAX,
                length_bytes: 1 << 20,
            },
            AdminRequest::Set {
                change: SettingsChange {
                    sequential_cutoff_bytes: Some(8 << 20),
                    page_cache_reads: Some(false),
                    reset: vec!["writeback_rate_bytes_per_sec".into()],
                    ..Default::default()
                },
            },
            AdminRequest::VolumeAdd {
                name: "db".into(),
                origin: "nbd+unix:///x?socket=/run/a b.sock".into(),
                mode: CacheMode::WriteThrough,
                integrity: false,
                dirty_share_pct: Some(30),
            },
            AdminRequest::VolumeSet {
                name: "db".into(),
                mode: Some(CacheMode::WriteThrough),
                dirty_share_pct: Some(0),
            },
            AdminRequest::VolumeList,
            AdminRequest::VolumeRemove {
                name: "db".into(),
                force: true,
            },
        ]
    }

    #[test]
    fn a_volume_set_without_a_mode_round_trips() {
        let r = AdminRequest::VolumeSet {
            name: "".into(),
            mode: None,
            dirty_share_pct: Some(40),
        };
        let mut bytes = Vec::new();
        write_message(&mut bytes, &Envelope::new(&r)).expect("encode");
        let line = String::from_utf8(bytes).expect("utf-8");
        assert_eq!(decode_request(line.trim_end()).expect(&line), r);
    }

    #[test]
    fn every_request_round_trips_and_is_listed() {
        let requests = every_request();
        assert_eq!(requests.len(), COMMANDS.len());
        for r in requests {
            let mut bytes = Vec::new();
            write_message(&mut bytes, &Envelope::new(&r)).expect("encode");
            let line = String::from_utf8(bytes).expect("utf-8");
            let line = line.strip_suffix('\n').expect("one line");
            assert!(!line.contains('\n'));
            assert_eq!(decode_request(line).expect(line), r);
            assert!(COMMANDS.contains(&r.name()), "{} is not listed", r.name());
            assert!(line.contains(&format!("\"command\":\"{}\"", r.name())));
        }
    }

    #[test]
    fn every_reply_round_trips_on_one_line() {
        for r in [
            AdminReply::Progress { done: 1, total: 2 },
            AdminReply::BadBlock {
                lba: 3,
                offset_bytes: 12288,
            },
            AdminReply::OriginMismatch {
                volume: "db".into(),
                lba: 1,
                offset_bytes: 4096,
                cached_copy: true,
            },
            AdminReply::OriginRepaired {
                volume: String::new(),
                lba: 1,
                offset_bytes: 4096,
            },
            AdminReply::Status {
                status: serde_json::json!({"mode": "writeback", "reply": "x\ny"}),
            },
            AdminReply::Drained {
                blocks_written: 5,
                unrecoverable_blocks: 0,
            },
            AdminReply::Scrubbed {
                blocks_checked: 4,
                blocks_verified: 3,
                blocks_unverified: 1,
                blocks_discarded: 2,
                blocks_skipped: 0,
            },
            AdminReply::Warmed { cached_blocks: 9 },
            AdminReply::Volumes {
                volumes: serde_json::json!([{"name": "", "id": 0}]),
            },
            AdminReply::Ok,
            AdminReply::error("no\nway"),
            AdminReply::Error {
                message: "m".into(),
                advice: Some("run this".into()),
            },
        ] {
            let mut line = Vec::new();
            write_message(&mut line, &r).expect("encode");
            assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
            let text = std::str::from_utf8(&line).expect("utf-8");
            assert_eq!(decode_reply(text.trim_end()).expect(text), r);
        }
    }

    #[test]
    fn bad_requests_get_clear_errors() {
        let cases: [(&str, &str); 12] = [
            ("", "malformed"),
            ("status", "malformed"),
            ("[1,2]", "not a JSON object"),
            (r#"{"command":"status"}"#, "version none"),
            (r#"{"version":2,"command":"status"}"#, "version 2"),
            (r#"{"version":"1","command":"status"}"#, "version \"1\""),
            (r#"{"version":1}"#, "no \"command\""),
            (r#"{"version":1,"command":7}"#, "no \"command\""),
            (
                r#"{"version":1,"command":"format"}"#,
                "unknown admin command \"format\"",
            ),
            (
                r#"{"version":1,"command":"warm"}"#,
                "admin command warm: missing field",
            ),
            (
                r#"{"version":1,"command":"warm","offset_bytes":-1,"length_bytes":1}"#,
                "admin command warm",
            ),
            (
                r#"{"version":1,"command":"mode","mode":"bogus"}"#,
                "unknown mode \"bogus\"; use writeback, writethrough",
            ),
        ];
        for (line, needle) in cases {
            let e = decode_request(line).expect_err(line).to_string();
            assert!(e.contains(needle), "{line:?} gave {e:?}, not {needle:?}");
        }
    }

    #[test]
    fn lines_are_bounded() {
        let long = format!("{}\nnext\n", "x".repeat(100));
        let mut r = std::io::Cursor::new(long.as_bytes());
        assert!(matches!(
            read_line(&mut r, 99),
            Err(ProtocolError::TooLong { max_bytes: 99 })
        ));
        let mut r = std::io::Cursor::new(long.as_bytes());
        assert_eq!(read_line(&mut r, 100).unwrap().unwrap().len(), 100);
        assert_eq!(read_line(&mut r, 100).unwrap().unwrap(), "next");
        assert!(read_line(&mut r, 100).unwrap().is_none());
        // No newline at the end of the stream: still a line.
        let mut r = std::io::Cursor::new(&b"tail"[..]);
        assert_eq!(read_line(&mut r, 100).unwrap().unwrap(), "tail");
        let mut r = std::io::Cursor::new(&b"\xff\xfe\n"[..]);
        assert!(matches!(
            read_line(&mut r, 100),
            Err(ProtocolError::Malformed(_))
        ));
    }
}
