//! Opening the devices a command names: the cache, and origins by path or
//! URI. Shared by the commands and the admin requests the daemon runs.

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use cairn_device::{open_local, open_path_or_uri_with, Device, DeviceError, OpenMode};

/// "cache PATH: why", naming the device once (device errors usually start
/// with the device's name already).
fn device_error(role: &str, spec: &str, e: DeviceError) -> anyhow::Error {
    let msg = e.to_string();
    if msg.starts_with(spec) {
        anyhow::anyhow!("{role} {msg}")
    } else {
        anyhow::anyhow!("{role} {spec}: {msg}")
    }
}

/// Refuse a local origin that is the cache itself (the same file by
/// another name, a symlink or a hard link): the origin's open would only
/// say the file is locked by "another process", which is misleading.
pub fn refuse_same_file(cache: &Path, origin_spec: &str) -> Result<()> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let (Ok(c), Ok(o)) = (std::fs::metadata(cache), std::fs::metadata(origin_spec)) else {
        // Not both local paths that exist: the opens report the problem.
        return Ok(());
    };
    let same = if c.file_type().is_block_device() || o.file_type().is_block_device() {
        c.file_type().is_block_device() && o.file_type().is_block_device() && c.rdev() == o.rdev()
    } else {
        c.dev() == o.dev() && c.ino() == o.ino()
    };
    if same {
        anyhow::bail!(
            "the cache {} and the origin {origin_spec} are the same file; give the fast device as --cache and the slow one as --origin",
            cache.display()
        );
    }
    Ok(())
}

pub fn open_cache(path: &Path, mode: OpenMode) -> Result<Arc<dyn Device>> {
    let dev = open_local(path, mode)
        .map_err(|e| device_error("cache", &path.display().to_string(), e))?;
    Ok(Arc::from(dev))
}

pub fn open_origin(spec: &str) -> Result<Arc<dyn Device>> {
    open_origin_with(spec, None)
}

/// The origin, with at most `queue_depth` requests in flight on a remote
/// export (`serve --origin-queue-depth`).
pub fn open_origin_with(spec: &str, queue_depth: Option<usize>) -> Result<Arc<dyn Device>> {
    let dev = open_path_or_uri_with(spec, OpenMode::Exclusive, queue_depth)
        .map_err(|e| device_error("origin", spec, e))?;
    Ok(Arc::from(dev))
}
