//! [`UpdateWatch`]: librbd's notice that another client changed the
//! image's header (a resize, above all).
//!
//! cairn holds the image's exclusive lock, yet `rbd resize` from another
//! client is still carried out: librbd forwards it to the lock's owner,
//! and cairn's own librbd performs it, with no way for cairn to refuse.
//! What cairn can do is notice. librbd calls the callback on one of its
//! own threads, where calling back into librbd risks a deadlock with the
//! header refresh under way, so the callback only raises a flag; the
//! device reads the new size on its next request.

use std::ffi::c_void;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::completion::errno_error;
use super::library::{ImageT, Library};

/// A registered watch. `Copy` so that it travels with the other raw
/// handles to the closing thread; exactly one copy is unregistered.
#[derive(Clone, Copy)]
pub(super) struct UpdateWatch {
    handle: u64,
    /// The flag the callback raises: an `Arc` given up to librbd with
    /// `into_raw`, taken back after the watch is unregistered (the
    /// callback may run until then).
    changed: *const AtomicBool,
}

extern "C" fn on_update(arg: *mut c_void) {
    // SAFETY: `arg` is the flag `register` gave librbd, alive until the
    // watch is unregistered, which librbd does not return from while a
    // callback runs.
    let changed = unsafe { &*(arg as *const AtomicBool) };
    changed.store(true, Ordering::Release);
}

impl UpdateWatch {
    /// Watch `image`'s header.
    pub fn register(lib: &'static Library, image: ImageT) -> io::Result<UpdateWatch> {
        let changed = Arc::into_raw(Arc::new(AtomicBool::new(false)));
        let mut handle = 0u64;
        // SAFETY: open image, out-parameter; the callback and its argument
        // stay valid until `unregister` (the flag is leaked until then).
        let rc = unsafe {
            (lib.rbd_update_watch)(image, &mut handle, on_update, changed as *mut c_void)
        };
        if rc < 0 {
            // SAFETY: the pointer came from `into_raw` above and librbd
            // did not keep it.
            drop(unsafe { Arc::from_raw(changed) });
            return Err(errno_error(rc as isize));
        }
        Ok(UpdateWatch { handle, changed })
    }

    /// Whether the header changed since the last call (and clears it).
    pub fn take_changed(&self) -> bool {
        // SAFETY: the flag lives until `unregister`, which only the
        // closing of the handles calls, after every request is done.
        let changed = unsafe { &*self.changed };
        changed.swap(false, Ordering::AcqRel)
    }

    /// Stop watching, then free the flag.
    ///
    /// # Safety
    /// `image` is the open image this was registered on, and no other
    /// copy of this watch is used afterwards.
    pub unsafe fn unregister(self, lib: &'static Library, image: ImageT) {
        // SAFETY: the caller's contract; librbd waits for a callback in
        // progress before it returns.
        let rc = unsafe { (lib.rbd_update_unwatch)(image, self.handle) };
        if rc < 0 {
            // librbd may still call back: leave the flag to it.
            tracing::warn!(error = %errno_error(rc as isize), "cannot stop watching the RBD image's header");
            return;
        }
        // SAFETY: from `into_raw` in `register`; librbd no longer has it.
        drop(unsafe { Arc::from_raw(self.changed) });
    }
}
