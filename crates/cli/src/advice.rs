//! The fix for an error, in terms of `cairn` commands. The engine says
//! what happened; only the CLI knows its own commands and flags, so the
//! advice is added here, printed after the error (`cairn: hint: ...`).

use cairn_engine::EngineError;

use crate::admin::client::ClientError;
use crate::admin::CommandError;

/// The advice for an engine error, if there is a command that fixes it.
pub fn for_engine(e: &EngineError) -> Option<String> {
    match e {
        EngineError::NotFormatted { device } => Some(format!(
            "format it first: cairn format --cache {device} --origin ORIGIN"
        )),
        EngineError::AlreadyFormatted { device, .. } => Some(format!(
            "formatting would destroy it; if that is what you want, pass --force: cairn format --force --cache {device} --origin ORIGIN"
        )),
        EngineError::HoldsData {
            device,
            what: cairn_format::ExistingContents::CairnCache,
        } => Some(format!(
            "it may hold data not yet written back to its origin, which formatting destroys; format it only if that data is not wanted: cairn format --force --cache {device} --origin ORIGIN"
        )),
        EngineError::SuperblocksMissing { device } => Some(format!(
            "its data not yet written back cannot be reached without them: restore the first 8 KiB of {device} if you have a copy; `cairn format --force` would discard it"
        )),
        EngineError::HoldsData { device, .. } => Some(format!(
            "check that {device} is the device you mean (`blkid {device}`, `lsblk`); formatting destroys what it holds. If it is, pass --force: cairn format --force --cache {device} --origin ORIGIN"
        )),
        EngineError::WrongOrigin { recorded, given }
            if cairn_device::device_id_of_identity(recorded).is_some() =>
        {
            Some(wrong_disk_advice(recorded, given))
        }
        EngineError::WrongOrigin { recorded, given }
            if cairn_device::identity_without_inode(recorded)
                == cairn_device::identity_without_inode(given) =>
        {
            Some(format!(
                "the file at {} is not the one this cache was formatted for (another inode: it was replaced, restored or copied since). If it holds the same data, pass --force to adopt it (dirty data would be written to it); otherwise put the original back",
                cairn_device::spec_of_identity(given)
            ))
        }
        EngineError::WrongOrigin { given, .. } => Some(format!(
            "use the origin it was formatted for (leave out --origin), or pass --force to adopt {given} (dirty data would be written to it)"
        )),
        EngineError::OriginSizeChanged {
            origin,
            recorded_bytes,
            given_bytes,
        } => Some(origin_size_advice(origin, *recorded_bytes, *given_bytes)),
        EngineError::ModeSetNotDrained { .. } => Some(
            "cairn writes them back once the origin takes writes again (`cairn status` shows origin_state); `cairn flush` tries now".into(),
        ),
        EngineError::VolumeNotFound { .. } => {
            Some("`cairn volume list --cache CACHE` shows the volumes".into())
        }
        EngineError::VolumeHasLostBlocks { .. } => Some(
            "`cairn check --cache CACHE` lists them; rewrite them (or accept the loss by writing zeroes over them), then remove the volume".into(),
        ),
        EngineError::VolumeNotDrained { .. } => Some(
            "make its origin reachable (see `cairn status`), then run `cairn volume remove` again".into(),
        ),
        EngineError::VolumeExists { name } => Some(format!(
            "pick another name; `cairn volume list --cache CACHE` shows the volumes (the name {name:?} is taken)"
        )),
        EngineError::Layout {
            layout: cairn_format::LayoutError::CacheTooSmallForTags { .. },
            ..
        } => Some(
            "format without --integrity, with a smaller --integrity-reserve, or with a larger --block-size (one tag per block)".into(),
        ),
        EngineError::NoTagRoom { .. } => Some(
            "add the volume without --integrity, remove a volume with integrity to free its pages, or format the cache with a larger --integrity-reserve (which erases it: flush and drain first)".into(),
        ),
        EngineError::OriginInUse { name, .. } => Some(format!(
            "each origin belongs to one volume; volume {name:?} serves it already"
        )),
        EngineError::VolumeOriginMissing { name, origin }
        | EngineError::VolumeOriginOpen { name, origin, .. } => Some(format!(
            "volume {name:?} needs its origin {origin}: make it reachable again, then start cairn"
        )),
        EngineError::SuperblockDamaged { device, .. } => Some(superblock_advice(
            device,
            &format!("both superblock copies (bytes 0..4096 and 4096..8192 of {device}) failed their checks, so neither is usable"),
        )),
        EngineError::SuperblockInvalid { device, .. } => Some(superblock_advice(
            device,
            &format!("the superblock copy cairn reads (the newest that passed its checksum, at byte 0 or 4096 of {device}) holds a value cairn refuses, or names a damaged volume table; the error does not tell whether the other copy is usable, and cairn does not fall back to an older copy on its own"),
        )),
        EngineError::CheckpointUnreadable { device, .. } => Some(failing_device_advice(device)),
        EngineError::CheckpointDamaged { device, .. } => Some(damaged_cache_advice(device, "checkpoint")),
        EngineError::LogDamaged { device, .. } => Some(damaged_cache_advice(device, "log")),
        EngineError::CacheDegraded { device, .. } => Some(format!(
            "fix or replace the cache device, stop cairn and run `cairn format --force` on it: cairn format --force --cache {device} --origin ORIGIN"
        )),
        _ => None,
    }
}

/// What to do about a cache that went degraded (a cache write failed for
/// good): logged when the daemon starts on one and when one goes degraded
/// while serving.
pub fn degraded_cache(cache: &std::path::Path, origin: &str) -> String {
    format!(
        "to cache again, fix or replace the cache device, stop cairn and run: cairn format --force --cache {} --origin {origin}",
        cache.display()
    )
}

/// The advice for a failed admin request, online or offline.
pub fn for_command(e: &CommandError) -> Option<String> {
    match e {
        CommandError::Engine(e) => for_engine(e),
        CommandError::NoIntegrity { .. } => Some(
            "to protect the origin, reformat with `cairn format --integrity` (after `cairn flush`)"
                .into(),
        ),
        CommandError::RangePastEnd {
            offset_bytes,
            size_bytes,
            ..
        } => Some(if offset_bytes < size_bytes {
            format!(
                "to warm up to the end of the volume, give {offset_bytes}:{}",
                size_bytes - offset_bytes
            )
        } else {
            format!("give a range within the volume, e.g. 0:{size_bytes}")
        }),
        CommandError::VolumeInUse { name, .. } => Some(format!(
            "disconnect them first, or pass --force to cut them off: cairn volume remove --cache CACHE --name {name} --force"
        )),
        CommandError::VolumeOrigin(_) => {
            Some("give the new volume's origin as a path or an nbd:// / rbd: URI that this host can open".into())
        }
        CommandError::Export(_) => {
            Some("the volume is in the cache and is exported at the next start of `cairn serve`".into())
        }
        CommandError::BadSettings(_) => {
            Some("see `cairn set --help` for the settings and their ranges".into())
        }
    }
}

/// The advice for whatever error reached the CLI's edge: the first typed
/// error in the chain that has one. A daemon's error carries the advice the
/// daemon found for it.
pub fn for_error(e: &anyhow::Error) -> Option<String> {
    e.chain().find_map(|cause| {
        if let Some(e) = cause.downcast_ref::<EngineError>() {
            for_engine(e)
        } else if let Some(e) = cause.downcast_ref::<CommandError>() {
            for_command(e)
        } else if let Some(ClientError::Daemon { advice, .. }) = cause.downcast_ref() {
            advice.clone()
        } else {
            None
        }
    })
}

/// A cache whose checkpoint or log is damaged: cairn does not guess, so
/// keep the device as it is; the origin alone is the volume as of an
/// earlier flush, and reformatting (which gives up the writes since) comes
/// last.
fn damaged_cache_advice(device: &str, what: &str) -> String {
    format!(
        "the writes not yet written back to the origin are reachable only through the cache's {what}, so keep {device} as it is (if it reports I/O errors, see dmesg or smartctl, copy it off first and keep the copy). The origin alone holds the volume as of an earlier flush; to serve that, giving up the writes since, reformat the cache: cairn format --force --cache {device} --origin ORIGIN (and add any other volume again with `cairn volume add`)"
    )
}

/// A cache whose superblock cannot be used (`copies` says which copies and
/// why): the data not yet written back is still on the device, so it is
/// copied before anything else, and never formatted.
fn superblock_advice(device: &str, copies: &str) -> String {
    format!(
        "{copies}. The data not yet written back to the origin is still on {device} (its checkpoint and log): do not format it (`cairn format --force` would discard that data). Before trying anything, keep a copy of the whole device on another disk: dd if={device} of=BACKUP bs=1M conv=fsync (ddrescue instead if it reports read errors). No cairn command can open the cache until a superblock is usable again (`cairn check` opens it as `cairn serve` does, so it fails the same way); if you kept a copy of the first 8 KiB of {device}, restoring it is the way back, and `cairn check --cache {device}` then verifies every cached block"
    )
}

/// A cache device that failed a read of what opening needs (an I/O error,
/// not a failed check): the device is failing, so its contents are copied
/// off, around the bad spots, before anything else.
fn failing_device_advice(device: &str) -> String {
    format!(
        "{device} failed a read: the device, or its link, is failing (see dmesg and `smartctl -a {device}`; a passing fault, such as a path failover, may be gone if you try again). The data not yet written back to the origin is reachable only through the cache's checkpoint and log, so do not format it: first copy the whole device off, around the bad spots, and keep the copy: ddrescue {device} BACKUP BACKUP.map; then serve the cache from a sound device holding that copy. The origin alone holds the volume as of an earlier flush; to serve that, giving up the writes since, reformat the cache: cairn format --force --cache {device} --origin ORIGIN"
    )
}

/// The block device a cache knows by its id is not the one at the path
/// given: disks are renamed at boot, loop devices re-attached.
fn wrong_disk_advice(recorded: &str, given: &str) -> String {
    let wanted = cairn_device::device_id_of_identity(recorded).unwrap_or_default();
    let found = cairn_device::device_id_of_identity(given).unwrap_or("none");
    if found == wanted {
        return format!(
            "{} has the id this cache recorded ({wanted}): it is the same disk under another name. Pass --force once to record its new path: cairn serve --origin {} --force",
            cairn_device::spec_of_identity(given),
            cairn_device::spec_of_identity(given)
        );
    }
    format!(
        "the block device at {} is not the disk this cache was formatted for: the cache recorded the id {wanted}, this device has {found}. Disk names follow probe order and can change at a reboot, and a loop device can be attached to another file. Find the device with id {wanted} (`lsblk -o NAME,SIZE,SERIAL,WWN`, `ls -l /dev/disk/by-id/`, `losetup -l`) and give it: cairn serve --origin DEVICE --force (--force records its new path); pass --force with this device only if it holds the same data (dirty data would be written to it)",
        cairn_device::spec_of_identity(given)
    )
}

/// The cache's unwritten data needs the origin at the size it recorded:
/// give it that size back first (for an RBD image, the `rbd resize` that
/// does it); reformatting, which drops that data, comes last.
fn origin_size_advice(origin: &str, recorded_bytes: u64, given_bytes: u64) -> String {
    if given_bytes > recorded_bytes {
        // Refused only where nothing but the size says which device this is
        // (an NBD export, a path without a lasting id).
        return format!(
            "if {origin} is the origin this cache was formatted for, grown, start cairn with --force: it serves the {recorded_bytes} bytes it was formatted for (to use the new size, `cairn flush`, stop cairn, then `cairn format --force` the cache). If another export or disk now answers to that name, use the original"
        );
    }
    let restore = match origin.strip_prefix("rbd:") {
        Some(rest) => {
            let image = rest.split(['?', '#']).next().unwrap_or(rest);
            format!("give the image its recorded size back, then start cairn again: `rbd resize --size {recorded_bytes}B {image}`")
        }
        None => format!(
            "give the origin its recorded size back ({recorded_bytes} bytes), or use the original device"
        ),
    };
    format!(
        "{restore}. Only if the data on the cache that is not yet on the origin is not wanted, reformat the cache for the origin as it is now (that data is lost): cairn format --force --cache CACHE --origin {origin}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advice_names_the_command_and_survives_anyhow_context() {
        let e = anyhow::Error::new(EngineError::NotFormatted {
            device: "/dev/x".into(),
        })
        .context("opening");
        assert_eq!(
            for_error(&e).as_deref(),
            Some("format it first: cairn format --cache /dev/x --origin ORIGIN")
        );
        let e = anyhow::Error::new(CommandError::Engine(EngineError::CacheDegraded {
            device: "/dev/x".into(),
            action: "a mode change".into(),
        }));
        assert!(for_error(&e)
            .unwrap()
            .contains("cairn format --force --cache /dev/x"));
        let e = anyhow::Error::new(ClientError::Daemon {
            message: "m".into(),
            advice: Some("do this".into()),
        });
        assert_eq!(for_error(&e).as_deref(), Some("do this"));
        assert_eq!(for_error(&anyhow::anyhow!("plain")), None);
    }

    /// The engine's own messages no longer name CLI flags or commands;
    /// the advice does.
    #[test]
    fn a_resized_origin_is_restored_before_anything_is_reformatted() {
        let shrunk = for_engine(&EngineError::OriginSizeChanged {
            origin: "rbd:rbd/vol4?conf=/c#1025".into(),
            recorded_bytes: 268_435_456,
            given_bytes: 67_108_864,
        })
        .unwrap_or_default();
        assert!(
            shrunk.starts_with("give the image its recorded size back")
                && shrunk.contains("`rbd resize --size 268435456B rbd/vol4`"),
            "{shrunk}"
        );
        // A grown origin is refused only where nothing but its size tells
        // which device it is: never advised to shrink it.
        let grown = for_engine(&EngineError::OriginSizeChanged {
            origin: "nbd+unix:///?socket=/run/o.sock".into(),
            recorded_bytes: 268_435_456,
            given_bytes: 314_572_800,
        })
        .unwrap_or_default();
        assert!(
            grown.contains("start cairn with --force")
                && grown.contains("serves the 268435456 bytes")
                && !grown.contains("shrink"),
            "{grown}"
        );
        let file = for_engine(&EngineError::OriginSizeChanged {
            origin: "/dev/sdb".into(),
            recorded_bytes: 8192,
            given_bytes: 4096,
        })
        .unwrap_or_default();
        assert!(
            file.starts_with("give the origin its recorded size back (8192 bytes)")
                && file.find("format --force") > file.find("recorded size"),
            "{file}"
        );
    }

    fn checkpoint_unreadable() -> EngineError {
        EngineError::CheckpointUnreadable {
            device: "/dev/sdc".into(),
            checkpoint_sequence: 9,
            slot: 1,
            offset_bytes: 1_114_112,
            length_bytes: 4096,
            source: cairn_device::DeviceError::Io {
                device: "/dev/sdc".into(),
                offset: 1_114_112,
                len: 4096,
                source: std::io::Error::from_raw_os_error(libc::EIO),
            },
        }
    }

    /// A checkpoint the device failed to read: the error names the device,
    /// the checkpoint's slot and the byte offset; the hint says the device
    /// is failing, to copy it off before anything, and not to format it
    /// first. (It was "cache device: ... I/O error", with no hint.)
    #[test]
    fn a_checkpoint_read_error_says_the_device_is_failing() {
        let e = checkpoint_unreadable();
        let msg = e.to_string();
        assert!(
            msg.starts_with("cache /dev/sdc: reading the newest checkpoint (number 9 in slot 1) failed: the device did not deliver bytes 1114112..1118208 (4096 bytes at byte offset 1114112)"),
            "{msg}"
        );
        let hint = for_engine(&e).unwrap_or_default();
        for needle in [
            "/dev/sdc failed a read: the device, or its link, is failing",
            "smartctl -a /dev/sdc",
            "do not format it",
            "ddrescue /dev/sdc BACKUP",
        ] {
            assert!(hint.contains(needle), "{needle:?} not in: {hint}");
        }
        assert!(
            hint.find("ddrescue") < hint.find("cairn format --force"),
            "copying comes before reformatting: {hint}"
        );
        assert_eq!(e.errno(), libc::EIO);
    }

    #[test]
    fn engine_messages_say_what_happened_only() {
        let errors = [
            EngineError::NotFormatted { device: "D".into() },
            EngineError::AlreadyFormatted {
                device: "D".into(),
                origin: "O".into(),
            },
            EngineError::WrongOrigin {
                recorded: "R".into(),
                given: "G".into(),
            },
            EngineError::OriginSizeChanged {
                origin: "O".into(),
                recorded_bytes: 1,
                given_bytes: 2,
            },
            EngineError::CacheDegraded {
                device: "D".into(),
                action: "a mode change".into(),
            },
            EngineError::CheckpointDamaged {
                device: "D".into(),
                detail: "the newest checkpoint (number 1 in slot 0, bytes 65536..98304 of the device): header: checksum mismatch".into(),
            },
            EngineError::LogDamaged {
                device: "D".into(),
                detail: "record 7 missing".into(),
            },
            EngineError::SuperblockInvalid {
                device: "D".into(),
                detail: "sequence 4611686018427387904 is out of range".into(),
            },
            EngineError::SuperblockDamaged {
                device: "D".into(),
                copy_a: cairn_format::DecodeError::Short { need: 1, have: 0 },
                copy_b: cairn_format::DecodeError::Short { need: 1, have: 0 },
            },
            checkpoint_unreadable(),
        ];
        for e in errors {
            let msg = e.to_string();
            assert!(
                !msg.contains("--") && !msg.contains("cairn format"),
                "the engine names a CLI command: {msg}"
            );
            assert!(for_engine(&e).is_some(), "no advice for: {msg}");
        }
    }
}
