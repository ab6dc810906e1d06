//! librados and librbd, loaded at run time.
//!
//! cairn does not link Ceph's libraries: a cairn built on a machine without
//! them still builds and runs every other origin, and one with `librbd1`
//! installed (Debian's package, which pulls in `librados2`) gains RBD
//! origins without a rebuild. The functions are the C API of librbd 1.x
//! (`rbd/librbd.h`, `rados/librados.h`), declared here by hand: a dozen
//! stable calls do not justify bindgen and a build-time libclang.

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

pub(super) type RadosT = *mut c_void;
pub(super) type IoCtxT = *mut c_void;
pub(super) type ImageT = *mut c_void;
pub(super) type CompletionT = *mut c_void;
pub(super) type CallbackT = extern "C" fn(completion: CompletionT, arg: *mut c_void);
pub(super) type UpdateCallbackT = extern "C" fn(arg: *mut c_void);
pub(super) type DiffCallbackT =
    extern "C" fn(offset: u64, length: usize, exists: c_int, arg: *mut c_void) -> c_int;

/// `RBD_LOCK_MODE_EXCLUSIVE` of `rbd_lock_mode_t`.
pub(super) const LOCK_MODE_EXCLUSIVE: c_int = 0;

/// The shared objects, by their Debian sonames.
const LIBRADOS: &str = "librados.so.2";
const LIBRBD: &str = "librbd.so.1";

/// The C functions cairn calls. The libraries stay loaded for the life of
/// the process (the table lives in a static), so the pointers stay valid.
pub(super) struct Library {
    _rados: libloading::Library,
    _rbd: libloading::Library,
    pub rados_create2:
        unsafe extern "C" fn(*mut RadosT, *const c_char, *const c_char, u64) -> c_int,
    pub rados_conf_read_file: unsafe extern "C" fn(RadosT, *const c_char) -> c_int,
    pub rados_conf_set: unsafe extern "C" fn(RadosT, *const c_char, *const c_char) -> c_int,
    pub rados_conf_parse_env: unsafe extern "C" fn(RadosT, *const c_char) -> c_int,
    pub rados_connect: unsafe extern "C" fn(RadosT) -> c_int,
    pub rados_shutdown: unsafe extern "C" fn(RadosT),
    pub rados_ioctx_create: unsafe extern "C" fn(RadosT, *const c_char, *mut IoCtxT) -> c_int,
    pub rados_ioctx_destroy: unsafe extern "C" fn(IoCtxT),
    pub rados_ioctx_set_namespace: unsafe extern "C" fn(IoCtxT, *const c_char),
    pub rbd_open: unsafe extern "C" fn(IoCtxT, *const c_char, *mut ImageT, *const c_char) -> c_int,
    pub rbd_close: unsafe extern "C" fn(ImageT) -> c_int,
    pub rbd_get_size: unsafe extern "C" fn(ImageT, *mut u64) -> c_int,
    pub rbd_get_id: unsafe extern "C" fn(ImageT, *mut c_char, usize) -> c_int,
    pub rbd_lock_acquire: unsafe extern "C" fn(ImageT, c_int) -> c_int,
    pub rbd_lock_release: unsafe extern "C" fn(ImageT) -> c_int,
    pub rbd_lock_get_owners:
        unsafe extern "C" fn(ImageT, *mut c_int, *mut *mut c_char, *mut usize) -> c_int,
    pub rbd_lock_get_owners_cleanup: unsafe extern "C" fn(*mut *mut c_char, usize),
    pub rbd_metadata_get:
        unsafe extern "C" fn(ImageT, *const c_char, *mut c_char, *mut usize) -> c_int,
    pub rbd_metadata_set: unsafe extern "C" fn(ImageT, *const c_char, *const c_char) -> c_int,
    pub rbd_metadata_remove: unsafe extern "C" fn(ImageT, *const c_char) -> c_int,
    pub rbd_update_watch:
        unsafe extern "C" fn(ImageT, *mut u64, UpdateCallbackT, *mut c_void) -> c_int,
    pub rbd_update_unwatch: unsafe extern "C" fn(ImageT, u64) -> c_int,
    pub rbd_aio_create_completion:
        unsafe extern "C" fn(*mut c_void, CallbackT, *mut CompletionT) -> c_int,
    pub rbd_aio_get_return_value: unsafe extern "C" fn(CompletionT) -> isize,
    pub rbd_aio_release: unsafe extern "C" fn(CompletionT),
    pub rbd_aio_read: unsafe extern "C" fn(ImageT, u64, usize, *mut c_char, CompletionT) -> c_int,
    pub rbd_aio_write:
        unsafe extern "C" fn(ImageT, u64, usize, *const c_char, CompletionT) -> c_int,
    pub rbd_aio_flush: unsafe extern "C" fn(ImageT, CompletionT) -> c_int,
    pub rbd_aio_discard: unsafe extern "C" fn(ImageT, u64, u64, CompletionT) -> c_int,
    pub rbd_aio_write_zeroes:
        unsafe extern "C" fn(ImageT, u64, usize, CompletionT, c_int, c_int) -> c_int,
    pub rbd_diff_iterate2: unsafe extern "C" fn(
        ImageT,
        *const c_char,
        u64,
        u64,
        u8,
        u8,
        DiffCallbackT,
        *mut c_void,
    ) -> c_int,
}

static LIBRARY: OnceLock<Result<Library, String>> = OnceLock::new();

/// The loaded table, or why it cannot be loaded (the message names the
/// package to install).
pub(super) fn library() -> Result<&'static Library, String> {
    LIBRARY.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Library, String> {
    let missing = |name: &str, err: libloading::Error| {
        format!("cannot load {name} ({err}); RBD origins need Ceph's client libraries: apt-get install librbd1")
    };
    // SAFETY: loading Ceph's client libraries runs their initialisers,
    // which only set up their own state.
    let rados = unsafe { libloading::Library::new(LIBRADOS) }.map_err(|e| missing(LIBRADOS, e))?;
    // SAFETY: as above.
    let rbd = unsafe { libloading::Library::new(LIBRBD) }.map_err(|e| missing(LIBRBD, e))?;
    macro_rules! symbol {
        ($lib:expr, $libname:expr, $name:ident) => {{
            // SAFETY: the symbol is the C function of that name in the
            // library's documented API, and the field's type is its C
            // signature; the library outlives the copied pointer (both live
            // in the static table).
            let symbol =
                unsafe { $lib.get(concat!(stringify!($name), "\0").as_bytes()) }.map_err(|e| {
                    format!(
                        "{} has no {} ({e}); librbd 1.12 or newer is needed",
                        $libname,
                        stringify!($name)
                    )
                })?;
            *symbol
        }};
    }
    Ok(Library {
        rados_create2: symbol!(rados, LIBRADOS, rados_create2),
        rados_conf_read_file: symbol!(rados, LIBRADOS, rados_conf_read_file),
        rados_conf_set: symbol!(rados, LIBRADOS, rados_conf_set),
        rados_conf_parse_env: symbol!(rados, LIBRADOS, rados_conf_parse_env),
        rados_connect: symbol!(rados, LIBRADOS, rados_connect),
        rados_shutdown: symbol!(rados, LIBRADOS, rados_shutdown),
        rados_ioctx_create: symbol!(rados, LIBRADOS, rados_ioctx_create),
        rados_ioctx_destroy: symbol!(rados, LIBRADOS, rados_ioctx_destroy),
        rados_ioctx_set_namespace: symbol!(rados, LIBRADOS, rados_ioctx_set_namespace),
        rbd_open: symbol!(rbd, LIBRBD, rbd_open),
        rbd_close: symbol!(rbd, LIBRBD, rbd_close),
        rbd_get_size: symbol!(rbd, LIBRBD, rbd_get_size),
        rbd_get_id: symbol!(rbd, LIBRBD, rbd_get_id),
        rbd_lock_acquire: symbol!(rbd, LIBRBD, rbd_lock_acquire),
        rbd_lock_release: symbol!(rbd, LIBRBD, rbd_lock_release),
        rbd_lock_get_owners: symbol!(rbd, LIBRBD, rbd_lock_get_owners),
        rbd_lock_get_owners_cleanup: symbol!(rbd, LIBRBD, rbd_lock_get_owners_cleanup),
        rbd_metadata_get: symbol!(rbd, LIBRBD, rbd_metadata_get),
        rbd_metadata_set: symbol!(rbd, LIBRBD, rbd_metadata_set),
        rbd_metadata_remove: symbol!(rbd, LIBRBD, rbd_metadata_remove),
        rbd_update_watch: symbol!(rbd, LIBRBD, rbd_update_watch),
        rbd_update_unwatch: symbol!(rbd, LIBRBD, rbd_update_unwatch),
        rbd_aio_create_completion: symbol!(rbd, LIBRBD, rbd_aio_create_completion),
        rbd_aio_get_return_value: symbol!(rbd, LIBRBD, rbd_aio_get_return_value),
        rbd_aio_release: symbol!(rbd, LIBRBD, rbd_aio_release),
        rbd_aio_read: symbol!(rbd, LIBRBD, rbd_aio_read),
        rbd_aio_write: symbol!(rbd, LIBRBD, rbd_aio_write),
        rbd_aio_flush: symbol!(rbd, LIBRBD, rbd_aio_flush),
        rbd_aio_discard: symbol!(rbd, LIBRBD, rbd_aio_discard),
        rbd_aio_write_zeroes: symbol!(rbd, LIBRBD, rbd_aio_write_zeroes),
        rbd_diff_iterate2: symbol!(rbd, LIBRBD, rbd_diff_iterate2),
        _rados: rados,
        _rbd: rbd,
    })
}
