//! [`UpdateWatch`]: librbd's notice that another client changed the
//! image's header (a resize, above all).
//!
//! cairn holds the image's exclusive lock, yet `rbd resize` from another
//! client is still carried out: librbd forwards it to the lock's owner,
//! and cairn's own librbd performs it, with no way for cairn to refuse.
//! What cairn can do is notice. librbd calls the callback on one of its
//! own threads, where calling back into librbd risks a deadlock with the
//! header refresh under way, so the callback only raises a flag; the
//! device reads the new size later (see `super::size_check`).

use std::ffi::c_void;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::completion::errno_error;
use super::library::{ImageT, Library};

/// A registered watch. Not `Clone`: unregistering twice would free the
/// flag librbd was given twice; it moves to the closing thread whole.
pub(super) struct UpdateWatch {
    handle: u64,
    /// The flag the callback raises. librbd holds a second reference,
    /// given up with `into_raw` at registration and taken back once the
    /// watch is unregistered (the callback may run until then).
    changed: Arc<AtomicBool>,
}

extern "C" fn on_update(arg: *mut c_void) {
    // SAFETY: `arg` is librbd's reference to the flag, from `into_raw` in
    // `register`, alive until the watch is unregistered, which librbd does
    // not return from while a callback runs.
    let changed = unsafe { &*(arg as *const AtomicBool) };
    changed.store(true, Ordering::Release);
}

impl UpdateWatch {
    /// Watch `image`'s header.
    pub fn register(lib: &'static Library, image: ImageT) -> io::Result<UpdateWatch> {
        let changed = Arc::new(AtomicBool::new(false));
        let for_librbd = Arc::into_raw(Arc::clone(&changed));
        let mut handle = 0u64;
        // SAFETY: open image, out-parameter; the callback's argument stays
        // valid until `unregister` (librbd's reference is held until then).
        let rc = unsafe {
            (lib.rbd_update_watch)(image, &mut handle, on_update, for_librbd as *mut c_void)
        };
        if rc < 0 {
            // SAFETY: from `into_raw` above; librbd did not keep it.
            drop(unsafe { Arc::from_raw(for_librbd) });
            return Err(errno_error(rc as isize));
        }
        Ok(UpdateWatch { handle, changed })
    }

    /// Whether the header changed since the flag was last taken, leaving
    /// it raised.
    pub fn is_raised(&self) -> bool {
        self.changed.load(Ordering::Acquire)
    }

    /// Whether the header changed since the flag was last taken; lowers it.
    pub fn take(&self) -> bool {
        self.changed.swap(false, Ordering::AcqRel)
    }

    /// Raise the flag again: a change taken but not dealt with (the new
    /// size could not be read) must be seen by the next look.
    pub fn raise(&self) {
        self.changed.store(true, Ordering::Release);
    }

    /// Stop watching, then free librbd's reference to the flag.
    ///
    /// # Safety
    /// `image` is the open image this was registered on.
    pub unsafe fn unregister(self, lib: &'static Library, image: ImageT) {
        // SAFETY: the caller's contract; librbd waits for a callback in
        // progress before it returns.
        let rc = unsafe { (lib.rbd_update_unwatch)(image, self.handle) };
        if rc < 0 {
            // librbd may still call back: its reference stays (leaked).
            tracing::warn!(error = %errno_error(rc as isize), "cannot stop watching the RBD image's header");
            return;
        }
        // SAFETY: librbd's reference, from `into_raw` in `register`; it
        // no longer has it, and this runs once (`self` is consumed).
        drop(unsafe { Arc::from_raw(Arc::as_ptr(&self.changed)) });
    }
}
