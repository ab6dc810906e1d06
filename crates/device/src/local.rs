//! Choosing the backend for a local file or block device.
//!
//! Policy ([`open_local`]): io_uring with O_DIRECT when it works; buffered
//! I/O through io_uring when the filesystem refuses O_DIRECT; pread/pwrite
//! ([`FileDevice`]) when io_uring itself is unavailable (old kernel, seccomp,
//! `kernel.io_uring_disabled`). Each fallback logs one warning. The
//! environment variable `CAIRN_IO_BACKEND=pread|uring|auto` forces the
//! choice (`uring` then fails instead of falling back to pread).

use std::path::Path;

use crate::file::{open_locked, OpenedFile};
use crate::uring::{OpenFileFn, RingPool, UringDevice, UringOptions};
use crate::{Device, DeviceError, DeviceResult, FileDevice, NbdDevice, OpenMode};

pub use cairn_io::{IoBackend, IO_BACKEND_ENV};

/// Options for [`open_local_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LocalOptions {
    pub backend: IoBackend,
    /// Used when the backend is io_uring.
    pub uring: UringOptions,
}

/// Open a local file or block device with the best backend available, as
/// [`IO_BACKEND_ENV`] allows. Keeps [`FileDevice::open`]'s locking: an
/// exclusive open fails with [`DeviceError::Busy`] while another holds it.
/// [`Device::backend`] tells which backend was chosen.
pub fn open_local(path: &Path, mode: OpenMode) -> DeviceResult<Box<dyn Device>> {
    let backend = IoBackend::from_env().map_err(|message| DeviceError::Unsupported {
        device: path.display().to_string(),
        message,
    })?;
    open_local_with(
        path,
        mode,
        &LocalOptions {
            backend,
            ..LocalOptions::default()
        },
    )
}

/// [`open_local`] with explicit options instead of the environment.
pub fn open_local_with(
    path: &Path,
    mode: OpenMode,
    options: &LocalOptions,
) -> DeviceResult<Box<dyn Device>> {
    open_local_impl(
        path,
        mode,
        options,
        &|uring: &UringOptions| RingPool::new(uring.ring_count, uring.queue_depth),
        &open_locked,
    )
}

/// Open an origin or cache given a local path, an NBD URI (`nbd://...`,
/// `nbd+unix://...`) or an RBD image (`rbd:POOL/IMAGE`), so front ends need
/// not tell them apart. `mode` applies to local paths (a file lock) and RBD
/// images (the image's exclusive lock); an NBD export cannot be locked from
/// here, so exclusivity there is the operator's job.
pub fn open_path_or_uri(spec: &str, mode: OpenMode) -> DeviceResult<Box<dyn Device>> {
    open_path_or_uri_with(spec, mode, None)
}

/// [`open_path_or_uri`] with at most `queue_depth` requests in flight on a
/// remote export's connection (`None`: [`crate::NbdOptions`]' default).
pub fn open_path_or_uri_with(
    spec: &str,
    mode: OpenMode,
    queue_depth: Option<usize>,
) -> DeviceResult<Box<dyn Device>> {
    if crate::RbdSpec::is_rbd(spec) {
        return Ok(Box::new(crate::RbdDevice::open(spec, mode)?));
    }
    let lower = spec.to_ascii_lowercase();
    if lower.starts_with("nbd://") || lower.starts_with("nbd+") || lower.starts_with("nbds") {
        let mut options = crate::NbdOptions::default();
        if let Some(depth) = queue_depth {
            options.max_in_flight = depth.max(1);
        }
        options.loop_connections = loop_connections_wanted();
        return Ok(Box::new(NbdDevice::open_with(spec, options)?));
    }
    if let Some(scheme) = uri_scheme(spec).filter(|_| !Path::new(spec).exists()) {
        return Err(DeviceError::Unsupported {
            device: spec.to_string(),
            message: format!(
                "{scheme}:// is not an origin cairn can open; use a local device or file, \
                 nbd://HOST[:PORT]/EXPORT, nbd+unix:///EXPORT?socket=PATH, nbds://..., or \
                 rbd:POOL/IMAGE"
            ),
        });
    }
    open_local(Path::new(spec), mode)
}

/// Environment variable that turns the event loops' own origin
/// connections off (`0`), for a server that counts connections or to
/// compare.
pub const NBD_LOOP_CONNECTIONS_ENV: &str = "CAIRN_NBD_LOOP_CONNECTIONS";

fn loop_connections_wanted() -> bool {
    match std::env::var(NBD_LOOP_CONNECTIONS_ENV) {
        Ok(value) => !matches!(value.trim(), "0" | "off" | "false" | "no"),
        Err(_) => true,
    }
}

/// The scheme of `spec` if it looks like a URI (`scheme://...`).
fn uri_scheme(spec: &str) -> Option<&str> {
    let (scheme, _) = spec.split_once("://")?;
    let mut chars = scheme.chars();
    let first = chars.next()?;
    (first.is_ascii_alphabetic()
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
    .then_some(scheme)
}

/// The spec that opens a device again from the identity it reported
/// ([`crate::Device::identity`], as a cache records its origin): a local
/// file's `file:PATH` is its path, an RBD image's `SPEC#ID` its spec (the
/// id is checked once it is open), an NBD export's identity its URI.
pub fn spec_of_identity(identity: &str) -> &str {
    if crate::RbdSpec::is_rbd(identity) {
        return identity
            .rsplit_once('#')
            .map_or(identity, |(spec, _id)| spec);
    }
    let identity = crate::identity::identity_without_inode(identity);
    identity.strip_prefix("file:").unwrap_or(identity)
}

/// True if `identity` names its device for good: a regular file by its
/// inode, a block device by a lasting id from sysfs, an RBD image by its
/// image id. A path alone, or an NBD export's URI, could name another
/// device tomorrow, so only its size would tell the two apart.
pub fn identity_is_lasting(identity: &str) -> bool {
    if crate::RbdSpec::is_rbd(identity) {
        return spec_of_identity(identity) != identity;
    }
    identity.starts_with("file:") && crate::identity::identity_without_inode(identity) != identity
}

/// The policy, with ring setup and file opening injectable so tests can
/// exercise the fallbacks on a machine where everything works.
pub(crate) fn open_local_impl(
    path: &Path,
    mode: OpenMode,
    options: &LocalOptions,
    make_rings: &dyn Fn(&UringOptions) -> std::io::Result<RingPool>,
    open_file: OpenFileFn<'_>,
) -> DeviceResult<Box<dyn Device>> {
    let pread =
        |opened: OpenedFile| -> Box<dyn Device> { Box::new(FileDevice::from_opened(opened)) };
    let device: Box<dyn Device> = match options.backend {
        IoBackend::Pread => pread(open_file(path, mode, 0)?),
        IoBackend::Auto | IoBackend::Uring => match make_rings(&options.uring) {
            Ok(rings) => Box::new(UringDevice::open_with_rings(
                path,
                mode,
                options.uring.direct_io,
                rings,
                open_file,
            )?),
            Err(err) if options.backend == IoBackend::Auto => {
                tracing::warn!(
                    device = %path.display(),
                    "io_uring is unavailable ({err}); using pread/pwrite"
                );
                pread(open_file(path, mode, 0)?)
            }
            Err(err) => {
                return Err(DeviceError::Unsupported {
                    device: path.display().to_string(),
                    message: format!(
                        "io_uring was asked for ({IO_BACKEND_ENV}=uring) but is unavailable: {err}"
                    ),
                })
            }
        },
    };
    tracing::debug!(
        device = device.name(),
        backend = device.backend(),
        "opened local device"
    );
    Ok(device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn lasting_identities_are_inodes_device_ids_and_image_ids() {
        for lasting in [
            "file:/srv/origin.img#ino=1234",
            "file:/dev/sdb#dev=wwid:naa.5000c500a1b2c3d4",
            "rbd:rbd/vol#10a2b3c4d5e6",
        ] {
            assert!(identity_is_lasting(lasting), "{lasting}");
        }
        for by_name in [
            "file:/dev/sdb",
            "file:/srv/origin.img",
            "nbd+unix:///?socket=/run/origin.sock",
            "nbd://example.net:10809/export",
            "rbd:rbd/vol",
            "sim:origin",
        ] {
            assert!(!identity_is_lasting(by_name), "{by_name}");
        }
    }

    fn temp_file(tag: &str, size_bytes: u64) -> std::path::PathBuf {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "cairn-local-{}-{}-{}",
            std::process::id(),
            tag,
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("dev.img");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(size_bytes)
            .unwrap();
        path
    }

    #[test]
    fn unknown_uri_schemes_are_named() {
        assert_eq!(uri_scheme("http://x/y"), Some("http"));
        assert_eq!(uri_scheme("iscsi+tcp://h/t"), Some("iscsi+tcp"));
        assert_eq!(uri_scheme("/srv/origin.img"), None);
        assert_eq!(uri_scheme("./odd:/name"), None);
        assert_eq!(uri_scheme("1x://y"), None);
        let err = open_path_or_uri("http://example.invalid/disk", OpenMode::Exclusive)
            .err()
            .expect("refused");
        let text = err.to_string();
        assert!(
            text.contains("http:// is not an origin") && text.contains("nbd://"),
            "{text}"
        );
    }

    #[test]
    fn identities_turn_back_into_specs() {
        assert_eq!(spec_of_identity("file:/dev/sdb"), "/dev/sdb");
        assert_eq!(spec_of_identity("file:/srv/o.img#ino=42"), "/srv/o.img");
        // A '#' in a path is not an inode mark.
        assert_eq!(spec_of_identity("file:/srv/a#b.img"), "/srv/a#b.img");
        assert_eq!(spec_of_identity("file:/srv/a#ino=x"), "/srv/a#ino=x");

        assert_eq!(
            spec_of_identity("rbd:rbd/vol?conf=/c#a1b2"),
            "rbd:rbd/vol?conf=/c"
        );
        assert_eq!(
            spec_of_identity("nbd+unix:///?socket=/s"),
            "nbd+unix:///?socket=/s"
        );
    }

    fn no_uring(_: &UringOptions) -> std::io::Result<RingPool> {
        Err(std::io::Error::from_raw_os_error(libc::ENOSYS))
    }

    fn real_rings(options: &UringOptions) -> std::io::Result<RingPool> {
        RingPool::new(options.ring_count, options.queue_depth)
    }

    fn roundtrip(device: &dyn Device) {
        let data = vec![0x5au8; 8192];
        device.write_at(4096, &data).unwrap();
        device.flush().unwrap();
        let mut back = vec![0u8; 8192];
        device.read_at(4096, &mut back).unwrap();
        assert_eq!(back, data);
    }

    #[test]
    fn parse_backend_values() {
        assert_eq!(IoBackend::parse("auto"), Some(IoBackend::Auto));
        assert_eq!(IoBackend::parse(""), Some(IoBackend::Auto));
        assert_eq!(IoBackend::parse(" PREAD "), Some(IoBackend::Pread));
        assert_eq!(IoBackend::parse("uring"), Some(IoBackend::Uring));
        assert_eq!(IoBackend::parse("io_uring"), Some(IoBackend::Uring));
        assert_eq!(IoBackend::parse("aio"), None);
    }

    #[test]
    fn auto_falls_back_to_pread_without_io_uring() {
        let path = temp_file("auto-fallback", 1 << 20);
        let options = LocalOptions::default();
        let device = open_local_impl(
            &path,
            OpenMode::Exclusive,
            &options,
            &no_uring,
            &open_locked,
        )
        .unwrap();
        assert_eq!(device.backend(), "pread");
        roundtrip(device.as_ref());
        // The fallback keeps the lock semantics.
        let again = open_local_impl(
            &path,
            OpenMode::Exclusive,
            &options,
            &no_uring,
            &open_locked,
        );
        assert!(matches!(again, Err(DeviceError::Busy { .. })));
        drop(device);
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn forced_uring_fails_without_io_uring() {
        let path = temp_file("forced-uring", 1 << 20);
        let options = LocalOptions {
            backend: IoBackend::Uring,
            ..LocalOptions::default()
        };
        let result = open_local_impl(
            &path,
            OpenMode::Exclusive,
            &options,
            &no_uring,
            &open_locked,
        );
        match result {
            Err(err @ DeviceError::Unsupported { .. }) => {
                assert!(err.to_string().contains("io_uring"), "{err}");
            }
            Err(other) => panic!("unexpected error {other}"),
            Ok(device) => panic!("opened with backend {}", device.backend()),
        }
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn refused_o_direct_falls_back_to_buffered_uring() {
        let path = temp_file("no-direct", 1 << 20);
        // A filesystem that refuses O_DIRECT at open, as tmpfs did before
        // Linux 6.6.
        let refuse_direct =
            |path: &Path, mode: OpenMode, flags: libc::c_int| -> DeviceResult<OpenedFile> {
                if flags & libc::O_DIRECT != 0 {
                    return Err(DeviceError::Open {
                        device: path.display().to_string(),
                        source: std::io::Error::from_raw_os_error(libc::EINVAL),
                    });
                }
                open_locked(path, mode, flags)
            };
        let device = open_local_impl(
            &path,
            OpenMode::Exclusive,
            &LocalOptions::default(),
            &real_rings,
            &refuse_direct,
        )
        .unwrap();
        assert_eq!(device.backend(), "uring-buffered");
        roundtrip(device.as_ref());
        // Buffered I/O takes any alignment through the ring.
        device.write_at(3, b"odd").unwrap();
        let mut back = [0u8; 3];
        device.read_at(3, &mut back).unwrap();
        assert_eq!(&back, b"odd");
        drop(device);
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn path_or_uri_dispatches_on_the_scheme() {
        let path = temp_file("dispatch", 1 << 20);
        let device = open_path_or_uri(path.to_str().unwrap(), OpenMode::Shared).unwrap();
        assert!(["pread", "uring-direct", "uring-buffered"].contains(&device.backend()));
        let missing = format!(
            "nbd+unix:///x?socket={}",
            path.with_extension("sock").display()
        );
        match open_path_or_uri(&missing, OpenMode::Shared) {
            Err(err @ DeviceError::Open { .. }) => {
                assert!(err.to_string().contains("NBD"), "{err}")
            }
            Err(other) => panic!("unexpected error {other}"),
            Ok(device) => panic!("opened {}", device.backend()),
        }
        drop(device);
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn other_open_errors_are_not_hidden_by_fallbacks() {
        let missing =
            std::env::temp_dir().join(format!("cairn-local-missing-{}", std::process::id()));
        for backend in [IoBackend::Auto, IoBackend::Pread, IoBackend::Uring] {
            let options = LocalOptions {
                backend,
                ..LocalOptions::default()
            };
            let result = open_local_with(&missing, OpenMode::Exclusive, &options);
            assert!(
                matches!(result, Err(DeviceError::Open { .. })),
                "{backend:?}"
            );
        }
    }
}
