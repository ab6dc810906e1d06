//! [`Closing`]: an image's handles on their way out, closed from any
//! thread (see [`super::handles::Handles`]' Drop).

use super::library::{ImageT, IoCtxT, Library, RadosT};
use super::update_watch::UpdateWatch;

/// The raw handles, taken out of a dropped `Handles`, without a Drop of
/// their own: `close` (which consumes them) releases them, once.
pub(super) struct Closing {
    pub lib: &'static Library,
    pub cluster: RadosT,
    pub ioctx: IoCtxT,
    pub image: ImageT,
    pub lock_held: bool,
    pub watch: Option<UpdateWatch>,
}

// SAFETY: librados and librbd handles may be used and closed from any
// thread; the `Handles` they came from gave them up (set its own to null,
// took its watch). The watch's flag is an atomic, shared with librbd's
// callback thread by design.
unsafe impl Send for Closing {}

impl Closing {
    /// Release everything, image before pool before cluster, each only if
    /// it was created.
    pub fn close(self) {
        // SAFETY: each handle is live or null, owned by this value alone,
        // released once in the order above. rbd_close waits for the
        // image's ops still in flight (a read whose task was dropped: its
        // buffer is the op's own).
        unsafe {
            if !self.image.is_null() {
                if let Some(watch) = self.watch {
                    watch.unregister(self.lib, self.image);
                }
                if self.lock_held {
                    let _ = (self.lib.rbd_lock_release)(self.image);
                }
                let _ = (self.lib.rbd_close)(self.image);
            }
            if !self.ioctx.is_null() {
                (self.lib.rados_ioctx_destroy)(self.ioctx);
            }
            if !self.cluster.is_null() {
                (self.lib.rados_shutdown)(self.cluster);
            }
        }
    }
}
