//! [`AioOp`]: one librbd asynchronous call, finished by librbd's callback
//! and awaited by a thread (condvar) or a reactor task (waker).
//!
//! The callback runs on a librbd thread. It owns one reference to the op
//! (given to librbd as the callback argument), records the return value,
//! releases the completion and wakes the waiter. Memory librbd writes into
//! is either the caller's, with the caller blocked until the op is done
//! (the synchronous calls), or the op's own buffer (a reactor task's read),
//! which lives until the callback drops its reference: a task dropped
//! mid-read never frees memory librbd still writes to.

use std::ffi::c_void;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use super::library::{CompletionT, Library};

struct OpState {
    /// librbd's return value, once the callback ran.
    result: Option<isize>,
    waker: Option<Waker>,
}

/// One asynchronous librbd call (see the module documentation).
pub(super) struct AioOp {
    library: &'static Library,
    state: Mutex<OpState>,
    done: Condvar,
    /// The op's own read buffer, for reads whose caller may go away.
    buffer: Mutex<Vec<u8>>,
}

impl AioOp {
    /// An op; `buffer_bytes` of its own memory for a read into it (0 for
    /// an op that uses the caller's memory, or none).
    pub fn new(library: &'static Library, buffer_bytes: usize) -> Arc<AioOp> {
        Arc::new(AioOp {
            library,
            state: Mutex::new(OpState {
                result: None,
                waker: None,
            }),
            done: Condvar::new(),
            buffer: Mutex::new(vec![0u8; buffer_bytes]),
        })
    }

    fn lock(&self) -> MutexGuard<'_, OpState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The op's own buffer. Its address does not change: it is allocated
    /// once and never resized.
    pub fn buffer(&self) -> MutexGuard<'_, Vec<u8>> {
        self.buffer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A librbd completion whose callback finishes this op, and submit
    /// with it. `submit` returns librbd's immediate return code: when it is
    /// negative the call was refused and the callback will never run, so
    /// the callback's reference is taken back here and the op is finished
    /// with that code.
    pub fn submit(self: &Arc<Self>, submit: impl FnOnce(CompletionT) -> i32) {
        let lib = self.library;
        let arg = Arc::into_raw(Arc::clone(self)) as *mut c_void;
        let mut completion: CompletionT = std::ptr::null_mut();
        // SAFETY: `arg` is a live Arc reference that `on_complete` takes
        // over; `completion` is an out-parameter.
        let rc = unsafe { (lib.rbd_aio_create_completion)(arg, on_complete, &mut completion) };
        if rc < 0 || completion.is_null() {
            // SAFETY: the completion was not created, so nothing else will
            // ever turn `arg` back into the Arc it came from.
            drop(unsafe { Arc::from_raw(arg as *const AioOp) });
            self.finish(if rc < 0 {
                rc as isize
            } else {
                -(libc::ENOMEM as isize)
            });
            return;
        }
        let rc = submit(completion);
        if rc < 0 {
            // SAFETY: librbd refused the call, so the completion was never
            // armed and its callback will not run: release it and take
            // back the reference it held.
            unsafe { (lib.rbd_aio_release)(completion) };
            drop(unsafe { Arc::from_raw(arg as *const AioOp) });
            self.finish(rc as isize);
        }
    }

    fn finish(&self, result: isize) {
        let waker = {
            let mut state = self.lock();
            debug_assert!(state.result.is_none(), "an op finished twice");
            state.result = Some(result);
            state.waker.take()
        };
        self.done.notify_all();
        // Outside the lock: a waker may run arbitrary code.
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Block until the op is done; librbd's return value.
    pub fn wait(&self) -> isize {
        let mut state = self.lock();
        loop {
            if let Some(result) = state.result {
                return result;
            }
            state = self
                .done
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// A future of the op's return value, for a reactor task.
    pub fn done(self: &Arc<Self>) -> Done {
        Done {
            op: Arc::clone(self),
        }
    }
}

/// The result of an [`AioOp`] as a future.
pub(super) struct Done {
    op: Arc<AioOp>,
}

impl Future for Done {
    type Output = isize;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<isize> {
        let mut state = self.op.lock();
        match state.result {
            Some(result) => Poll::Ready(result),
            None => {
                state.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// librbd's completion callback (on a librbd thread).
extern "C" fn on_complete(completion: CompletionT, arg: *mut c_void) {
    // SAFETY: `arg` is the reference `AioOp::submit` gave librbd for this
    // completion, which calls back exactly once.
    let op = unsafe { Arc::from_raw(arg as *const AioOp) };
    let lib = op.library;
    // SAFETY: the completion is done; it is read once and then released,
    // as librbd asks (the callback may release it).
    let result = unsafe { (lib.rbd_aio_get_return_value)(completion) };
    // SAFETY: as above; nothing uses the completion afterwards.
    unsafe { (lib.rbd_aio_release)(completion) };
    op.finish(result);
}

/// librbd's negative errno as an I/O error.
pub(super) fn errno_error(rc: isize) -> io::Error {
    io::Error::from_raw_os_error((-rc).clamp(1, i32::MAX as isize) as i32)
}
