//! [`Handles`]: the cluster connection, pool context and open image, torn
//! down in the reverse order.

use std::ffi::{c_char, c_int, CStr, CString};
use std::io;
use std::sync::{Arc, Mutex, PoisonError};

use super::closing::Closing;
use super::completion::errno_error;
use super::library::{ImageT, IoCtxT, Library, RadosT, LOCK_MODE_EXCLUSIVE};
use super::spec::RbdSpec;
use super::update_watch::UpdateWatch;

/// librados timeouts set to the spec's request deadline before the
/// configuration file is read (which, like `CEPH_ARGS`, may override
/// them): an OSD or monitor that stops answering fails the request instead
/// of holding it forever.
const TIMEOUT_OPTIONS: [&str; 3] = [
    "rados_osd_op_timeout",
    "rados_mon_op_timeout",
    "client_mount_timeout",
];

/// How long dropping an image waits for the cluster to answer its close.
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Lock owners named in an error at most.
const MAX_LOCK_OWNERS: usize = 8;

/// An open image (see the module documentation).
pub(super) struct Handles {
    lib: &'static Library,
    cluster: RadosT,
    ioctx: IoCtxT,
    pub image: ImageT,
    lock_held: bool,
    /// Raised when another client changes the header (a resize).
    watch: Option<UpdateWatch>,
}

// SAFETY: librados clusters and librbd images are thread-safe: their C
// calls may come from any thread, concurrently (librbd serialises what it
// must internally). The handles are only closed in Drop, with `&mut self`.
unsafe impl Send for Handles {}
// SAFETY: as above.
unsafe impl Sync for Handles {}

/// Why an image could not be opened: the message, and whether the image
/// is held by another client (so the caller reports it busy).
pub(super) struct OpenFailure {
    pub error: io::Error,
    pub locked_by_another: bool,
}

impl OpenFailure {
    fn new(error: io::Error) -> OpenFailure {
        OpenFailure {
            error,
            locked_by_another: false,
        }
    }
}

fn c_string(what: &str, value: &str) -> Result<CString, OpenFailure> {
    CString::new(value).map_err(|_| {
        OpenFailure::new(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("the {what} has a NUL byte"),
        ))
    })
}

fn failed(rc: c_int, what: String) -> OpenFailure {
    let os = errno_error(rc as isize);
    OpenFailure::new(io::Error::new(os.kind(), format!("{what}: {os}")))
}

impl Handles {
    /// Connect, open the image and, when `exclusive`, take its exclusive
    /// lock.
    pub fn open(
        lib: &'static Library,
        spec: &RbdSpec,
        exclusive: bool,
    ) -> Result<Handles, OpenFailure> {
        let mut handles = Handles {
            lib,
            cluster: std::ptr::null_mut(),
            ioctx: std::ptr::null_mut(),
            image: std::ptr::null_mut(),
            lock_held: false,
            watch: None,
        };
        let cluster_name = c_string("cluster name", "ceph")?;
        let client = c_string("client id", &spec.client_name())?;
        // SAFETY: out-parameter and two NUL-terminated strings that live
        // across the call. On failure nothing was created.
        let rc = unsafe {
            (lib.rados_create2)(
                &mut handles.cluster,
                cluster_name.as_ptr(),
                client.as_ptr(),
                0,
            )
        };
        if rc < 0 {
            handles.cluster = std::ptr::null_mut();
            return Err(failed(
                rc,
                format!("cannot create a Ceph client as {}", spec.client_name()),
            ));
        }
        handles.configure_and_connect(spec)?;
        handles.open_image(spec)?;
        handles.watch = match UpdateWatch::register(lib, handles.image) {
            Ok(watch) => Some(watch),
            Err(e) => {
                tracing::warn!(image = %spec.image_name(), error = %e, "cannot watch the image's header; a resize by another client will show only as failed requests");
                None
            }
        };
        if exclusive {
            handles.lock_exclusive(spec)?;
        }
        Ok(handles)
    }

    /// Timeouts, the configuration file, `CEPH_ARGS` and the keyring, then
    /// connect to the monitors.
    fn configure_and_connect(&mut self, spec: &RbdSpec) -> Result<(), OpenFailure> {
        let lib = self.lib;
        let handles = self;
        let timeout_secs = spec.timeout().as_secs().to_string();
        for option in TIMEOUT_OPTIONS {
            handles.conf_set(option, &timeout_secs)?;
        }
        let conf = spec
            .conf
            .as_deref()
            .map(|c| c_string("conf path", c))
            .transpose()?;
        // SAFETY: the cluster handle is live; NULL asks librados to search
        // ($CEPH_CONF, /etc/ceph/ceph.conf, ~/.ceph/config, ./ceph.conf).
        let rc = unsafe {
            (lib.rados_conf_read_file)(
                handles.cluster,
                conf.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            )
        };
        if rc < 0 {
            let which = spec.conf.clone().unwrap_or_else(|| {
                "none found in $CEPH_CONF or /etc/ceph/ceph.conf; pass ?conf=PATH".into()
            });
            return Err(failed(
                rc,
                format!("cannot read the Ceph configuration ({which})"),
            ));
        }
        // SAFETY: the cluster handle is live; NULL means CEPH_ARGS.
        let rc = unsafe { (lib.rados_conf_parse_env)(handles.cluster, std::ptr::null()) };
        if rc < 0 {
            return Err(failed(rc, "cannot parse CEPH_ARGS".into()));
        }
        if let Some(keyring) = &spec.keyring {
            // librados reports a missing keyring as a bare ENOENT from the
            // connect, naming nothing: name the file here.
            if let Err(e) = std::fs::metadata(keyring) {
                return Err(OpenFailure {
                    error: io::Error::new(
                        e.kind(),
                        format!("cannot read the keyring {keyring} given as keyring=: {e}"),
                    ),
                    locked_by_another: false,
                });
            }
            handles.conf_set("keyring", keyring)?;
        }
        // SAFETY: the cluster handle is live and configured.
        let rc = unsafe { (lib.rados_connect)(handles.cluster) };
        if rc < 0 {
            return Err(failed(
                rc,
                format!(
                    "cannot connect to the Ceph cluster as {} (are its monitors up, and the key right?)",
                    spec.client_name()
                ),
            ));
        }
        Ok(())
    }

    /// The pool's context and the image in it.
    fn open_image(&mut self, spec: &RbdSpec) -> Result<(), OpenFailure> {
        let lib = self.lib;
        let handles = self;
        let pool = c_string("pool name", &spec.pool)?;
        // SAFETY: connected cluster, NUL-terminated name, out-parameter.
        let rc =
            unsafe { (lib.rados_ioctx_create)(handles.cluster, pool.as_ptr(), &mut handles.ioctx) };
        if rc < 0 {
            handles.ioctx = std::ptr::null_mut();
            return Err(failed(rc, format!("cannot open pool {:?}", spec.pool)));
        }
        if let Some(namespace) = &spec.namespace {
            let namespace = c_string("namespace name", namespace)?;
            // SAFETY: live pool context, NUL-terminated name (copied by
            // librados).
            unsafe { (lib.rados_ioctx_set_namespace)(handles.ioctx, namespace.as_ptr()) };
        }
        let image = c_string("image name", &spec.image)?;
        // SAFETY: live pool context, NUL-terminated name, out-parameter;
        // NULL snapshot: the image head, writable.
        let rc = unsafe {
            (lib.rbd_open)(
                handles.ioctx,
                image.as_ptr(),
                &mut handles.image,
                std::ptr::null(),
            )
        };
        if rc < 0 {
            handles.image = std::ptr::null_mut();
            return Err(failed(
                rc,
                match &spec.namespace {
                    Some(namespace) => format!(
                        "cannot open image {:?} in namespace {namespace:?} of pool {:?} (`rbd namespace ls {}` lists the namespaces)",
                        spec.image, spec.pool, spec.pool
                    ),
                    None => format!("cannot open image {:?} in pool {:?}", spec.image, spec.pool),
                },
            ));
        }
        Ok(())
    }

    fn conf_set(&self, option: &str, value: &str) -> Result<(), OpenFailure> {
        let o = c_string("option", option)?;
        let v = c_string("option value", value)?;
        // SAFETY: live cluster handle, two NUL-terminated strings.
        let rc = unsafe { (self.lib.rados_conf_set)(self.cluster, o.as_ptr(), v.as_ptr()) };
        if rc < 0 {
            return Err(failed(
                rc,
                format!("cannot set Ceph option {option}={value}"),
            ));
        }
        Ok(())
    }

    /// Take the image's exclusive lock, so no other client (another cairn,
    /// rbd-nbd, a VM) writes to it while cairn writes back.
    fn lock_exclusive(&mut self, spec: &RbdSpec) -> Result<(), OpenFailure> {
        // After a holder died without releasing the lock (kill -9), Ceph
        // gives it up only once the holder's watch times out (about 30 s):
        // say why nothing happens meanwhile.
        tracing::info!(
            image = %spec.image_name(),
            "taking the image's exclusive lock (if a previous holder died, Ceph releases its lock when its watch times out, about 30 s)"
        );
        // SAFETY: open image handle.
        let rc = unsafe { (self.lib.rbd_lock_acquire)(self.image, LOCK_MODE_EXCLUSIVE) };
        if rc == 0 {
            self.lock_held = true;
            return Ok(());
        }
        let name = spec.image_name();
        if rc == -libc::EROFS || rc == -libc::EBUSY {
            let owners = self.lock_owners();
            return Err(OpenFailure {
                error: io::Error::new(
                    io::ErrorKind::ResourceBusy,
                    format!(
                        "{name} is locked by another client ({}); stop it first, or if it is dead remove its lock with `rbd lock rm`",
                        if owners.is_empty() { "owner unknown".to_string() } else { owners.join(", ") }
                    ),
                ),
                locked_by_another: true,
            });
        }
        if rc == -libc::EINVAL || rc == -libc::EOPNOTSUPP {
            return Err(failed(
                rc,
                format!(
                    "cannot take the exclusive lock of {name}: enable the feature with `rbd feature enable {}/{} exclusive-lock`",
                    spec.pool, spec.image
                ),
            ));
        }
        Err(failed(
            rc,
            format!("cannot take the exclusive lock of {name}"),
        ))
    }

    /// Who holds the image's lock, as librbd names them.
    fn lock_owners(&self) -> Vec<String> {
        let mut mode: c_int = 0;
        let mut owners: [*mut c_char; MAX_LOCK_OWNERS] = [std::ptr::null_mut(); MAX_LOCK_OWNERS];
        let mut count: usize = MAX_LOCK_OWNERS;
        // SAFETY: open image; `owners` has room for `count` pointers, which
        // librbd fills with strings we free with the cleanup call.
        let rc = unsafe {
            (self.lib.rbd_lock_get_owners)(self.image, &mut mode, owners.as_mut_ptr(), &mut count)
        };
        if rc < 0 {
            return Vec::new();
        }
        let count = count.min(MAX_LOCK_OWNERS);
        let names = owners[..count]
            .iter()
            .filter(|p| !p.is_null())
            // SAFETY: librbd returned NUL-terminated strings.
            .map(|p| unsafe { CStr::from_ptr(*p) }.to_string_lossy().into_owned())
            .collect();
        // SAFETY: the strings librbd allocated in this call, freed once.
        unsafe { (self.lib.rbd_lock_get_owners_cleanup)(owners.as_mut_ptr(), count) };
        names
    }

    /// The image's metadata value under `key` (`rbd image-meta get`), or
    /// `None` if it has none.
    pub fn metadata_get(&self, key: &str) -> io::Result<Option<String>> {
        let key = CString::new(key).map_err(|_| io::Error::other("a key with a NUL byte"))?;
        let mut buf = vec![0u8; 256];
        for _ in 0..4 {
            let mut len = buf.len();
            // SAFETY: open image, NUL-terminated key; `buf` has `len`
            // writable bytes, and librbd sets `len` to the size it needs
            // when they are too few (ERANGE).
            let rc = unsafe {
                (self.lib.rbd_metadata_get)(
                    self.image,
                    key.as_ptr(),
                    buf.as_mut_ptr() as *mut c_char,
                    &mut len,
                )
            };
            if rc == -libc::ENOENT {
                return Ok(None);
            }
            if rc == -libc::ERANGE {
                buf = vec![0u8; len.clamp(buf.len() + 1, 64 << 10)];
                continue;
            }
            if rc < 0 {
                return Err(errno_error(rc as isize));
            }
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            return Ok(Some(String::from_utf8_lossy(&buf[..end]).into_owned()));
        }
        Err(io::Error::other(
            "the metadata value does not fit in 64 KiB",
        ))
    }

    /// Set the image's metadata `key` to `value` (`rbd image-meta set`).
    pub fn metadata_set(&self, key: &str, value: &str) -> io::Result<()> {
        let key = CString::new(key).map_err(|_| io::Error::other("a key with a NUL byte"))?;
        let value = CString::new(value).map_err(|_| io::Error::other("a value with a NUL byte"))?;
        // SAFETY: open image, two NUL-terminated strings.
        let rc = unsafe { (self.lib.rbd_metadata_set)(self.image, key.as_ptr(), value.as_ptr()) };
        if rc < 0 {
            return Err(errno_error(rc as isize));
        }
        Ok(())
    }

    /// Remove the image's metadata `key`; absent already is fine.
    pub fn metadata_remove(&self, key: &str) -> io::Result<()> {
        let key = CString::new(key).map_err(|_| io::Error::other("a key with a NUL byte"))?;
        // SAFETY: open image, NUL-terminated key.
        let rc = unsafe { (self.lib.rbd_metadata_remove)(self.image, key.as_ptr()) };
        if rc < 0 && rc != -libc::ENOENT {
            return Err(errno_error(rc as isize));
        }
        Ok(())
    }

    /// The header watch, if librbd gave one (see [`UpdateWatch`]).
    pub fn watch(&self) -> Option<&UpdateWatch> {
        self.watch.as_ref()
    }

    pub fn size_bytes(&self) -> io::Result<u64> {
        let mut size = 0u64;
        // SAFETY: open image, out-parameter.
        let rc = unsafe { (self.lib.rbd_get_size)(self.image, &mut size) };
        if rc < 0 {
            return Err(errno_error(rc as isize));
        }
        Ok(size)
    }

    /// The image's id: stable for its life, new if it is deleted and made
    /// again under the same name.
    pub fn id(&self) -> io::Result<String> {
        let mut buf = vec![0u8; 64];
        for _ in 0..4 {
            // SAFETY: open image; `buf` has `buf.len()` writable bytes.
            let rc = unsafe {
                (self.lib.rbd_get_id)(self.image, buf.as_mut_ptr() as *mut c_char, buf.len())
            };
            if rc == -libc::ERANGE {
                buf = vec![0u8; buf.len() * 4];
                continue;
            }
            if rc < 0 {
                return Err(errno_error(rc as isize));
            }
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            return Ok(String::from_utf8_lossy(&buf[..end]).into_owned());
        }
        Err(io::Error::other("the image id does not fit in 4 KiB"))
    }
}

impl Drop for Handles {
    /// Closing waits for the cluster (the lock release and the close talk
    /// to it), which may not answer: an OSD that hangs must not hang
    /// cairn's shutdown after its data is safe in the cache. The close
    /// runs on its own thread for at most [`CLOSE_WAIT`]; past that it is
    /// left behind (the handles leak, and Ceph frees the lock when their
    /// watch times out).
    fn drop(&mut self) {
        if self.image.is_null() && self.ioctx.is_null() && self.cluster.is_null() {
            return;
        }
        let closing = Closing {
            lib: self.lib,
            cluster: std::mem::replace(&mut self.cluster, std::ptr::null_mut()),
            ioctx: std::mem::replace(&mut self.ioctx, std::ptr::null_mut()),
            image: std::mem::replace(&mut self.image, std::ptr::null_mut()),
            lock_held: self.lock_held,
            watch: self.watch.take(),
        };
        // Shared with the thread so that, should it not start, the
        // handles come back here to be closed inline.
        let handed_over = Arc::new(Mutex::new(Some(closing)));
        // Whoever takes the handles first closes them, once.
        let close_taken = |slot: &Mutex<Option<Closing>>| {
            let taken = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
            if let Some(closing) = taken {
                closing.close();
            }
        };
        let for_thread = Arc::clone(&handed_over);
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let spawned = std::thread::Builder::new()
            .name("rbd-close".into())
            .spawn(move || {
                close_taken(&for_thread);
                let _ = done_tx.send(());
            });
        match spawned {
            Ok(_) => {
                if done_rx.recv_timeout(CLOSE_WAIT).is_err() {
                    tracing::warn!(
                        wait_secs = CLOSE_WAIT.as_secs(),
                        "the Ceph cluster did not answer the image's close; going on without it (Ceph releases the image's lock when this client's watch times out, about 30 s)"
                    );
                }
            }
            // No thread: close here, however long it takes.
            Err(e) => {
                tracing::warn!(error = %e, "cannot start a thread to close the RBD image; closing inline");
                close_taken(&handed_over);
            }
        }
    }
}
