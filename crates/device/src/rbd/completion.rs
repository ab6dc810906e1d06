//! [`AioOp`]: one librbd asynchronous call, finished by librbd's callback
//! and awaited, within a deadline, by a thread (condvar) or a reactor task
//! (waker).
//!
//! The callback runs on a librbd thread. It owns one reference to the op
//! (given to librbd as the callback argument), records the return value,
//! releases the completion and wakes the waiter. The memory librbd reads
//! or writes is always the op's own buffer, never the caller's: a caller
//! that gives up on an op (its deadline passed, its task was dropped)
//! returns at once, and the op with its buffer lives on until librbd is
//! done with it. Such abandoned ops are counted in [`Stuck`], so the
//! device can refuse new work instead of piling memory up behind a dead
//! OSD.

use std::ffi::c_void;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use super::blocklisted::Blocklisted;
use super::library::{CompletionT, Library};

/// Ops given up on whose librbd call has not finished yet.
#[derive(Debug, Default)]
pub(super) struct Stuck {
    pub ops: AtomicU64,
    pub bytes: AtomicU64,
}

struct OpState {
    /// librbd's return value, once the callback ran.
    result: Option<isize>,
    waker: Option<Waker>,
    /// The caller gave up; the callback settles [`Stuck`].
    abandoned: bool,
    /// A thread waits on the condvar. Only then is it notified: on Linux a
    /// notify is a futex syscall whether anyone waits or not, and the
    /// callback runs on librbd's one completion thread.
    thread_waiting: bool,
}

/// One asynchronous librbd call (see the module documentation).
pub(super) struct AioOp {
    library: &'static Library,
    state: Mutex<OpState>,
    done: Condvar,
    /// What librbd reads (a write) or fills (a read); allocated once and
    /// never reallocated, so its address is stable while librbd uses it.
    /// A read's buffer is empty with room for `io_bytes` until librbd
    /// filled all of it: it is never zeroed first (that memset was 2% of a
    /// connection's CPU on cold reads) and never seen uninitialised.
    buffer: Mutex<Vec<u8>>,
    /// The bytes librbd reads from or writes into `buffer`.
    io_bytes: usize,
    /// A read: `buffer` is filled by librbd, its length set on success.
    fills: bool,
    stuck: Arc<Stuck>,
}

impl AioOp {
    /// An op that librbd reads `buffer` for (a write; empty for flush,
    /// discard, zeroes).
    pub fn new(library: &'static Library, buffer: Vec<u8>, stuck: &Arc<Stuck>) -> Arc<AioOp> {
        let io_bytes = buffer.len();
        Self::with_buffer(library, buffer, io_bytes, false, stuck)
    }

    /// An op that librbd fills with `len` bytes (a read).
    pub fn new_read(library: &'static Library, len: usize, stuck: &Arc<Stuck>) -> Arc<AioOp> {
        Self::with_buffer(library, Vec::with_capacity(len), len, true, stuck)
    }

    fn with_buffer(
        library: &'static Library,
        buffer: Vec<u8>,
        io_bytes: usize,
        fills: bool,
        stuck: &Arc<Stuck>,
    ) -> Arc<AioOp> {
        debug_assert!(buffer.capacity() >= io_bytes);
        Arc::new(AioOp {
            library,
            state: Mutex::new(OpState {
                result: None,
                waker: None,
                abandoned: false,
                thread_waiting: false,
            }),
            done: Condvar::new(),
            buffer: Mutex::new(buffer),
            io_bytes,
            fills,
            stuck: Arc::clone(stuck),
        })
    }

    fn lock(&self) -> MutexGuard<'_, OpState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The op's buffer: a read's holds its data once it succeeded, and
    /// nothing before. Touch it only before `submit` or after the op is
    /// done: librbd uses it in between.
    pub fn buffer(&self) -> MutexGuard<'_, Vec<u8>> {
        self.buffer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Create a librbd completion whose callback finishes this op, and
    /// submit with it: `submit` gets the completion and the buffer's
    /// address and length, and returns librbd's immediate return code.
    /// When that is negative the call was refused and the callback will
    /// never run, so its reference is taken back here and the op is
    /// finished with that code.
    pub fn submit(self: &Arc<Self>, submit: impl FnOnce(CompletionT, *mut u8, usize) -> i32) {
        let lib = self.library;
        let (address, len) = {
            let mut buffer = self.buffer();
            debug_assert!(buffer.capacity() >= self.io_bytes);
            (buffer.as_mut_ptr(), self.io_bytes)
        };
        let arg = Arc::into_raw(Arc::clone(self)) as *mut c_void;
        let mut completion: CompletionT = std::ptr::null_mut();
        // SAFETY: `arg` is a live Arc reference that `on_complete` takes
        // over; `completion` is an out-parameter.
        let rc = unsafe { (lib.rbd_aio_create_completion)(arg, on_complete, &mut completion) };
        if rc < 0 || completion.is_null() {
            // SAFETY: no completion exists, so nothing else will ever turn
            // `arg` back into the Arc it came from.
            drop(unsafe { Arc::from_raw(arg as *const AioOp) });
            self.finish(if rc < 0 {
                rc as isize
            } else {
                -(libc::ENOMEM as isize)
            });
            return;
        }
        let rc = submit(completion, address, len);
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
        let (waker, thread_waiting) = {
            let mut state = self.lock();
            debug_assert!(state.result.is_none(), "an op finished twice");
            state.result = Some(result);
            if self.fills && result >= 0 && result as usize == self.io_bytes {
                let mut buffer = self.buffer();
                // SAFETY: librbd reported the whole read done, so it wrote
                // all `io_bytes` bytes into the buffer's allocation, which
                // has that capacity (checked at `submit`) and did not move.
                unsafe { buffer.set_len(self.io_bytes) };
            }
            if state.abandoned {
                let bytes = self.io_bytes as u64;
                self.stuck.ops.fetch_sub(1, Ordering::AcqRel);
                self.stuck.bytes.fetch_sub(bytes, Ordering::AcqRel);
            }
            (state.waker.take(), state.thread_waiting)
        };
        if thread_waiting {
            self.done.notify_all();
        }
        // Outside the lock: a waker may run arbitrary code.
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Give up on the op unless it is done: `Some(result)` if it finished
    /// after all, else `None` and the op counts as stuck until it does.
    pub fn abandon(&self) -> Option<isize> {
        let mut state = self.lock();
        if let Some(result) = state.result {
            return Some(result);
        }
        if !state.abandoned {
            state.abandoned = true;
            self.stuck.ops.fetch_add(1, Ordering::AcqRel);
            self.stuck
                .bytes
                .fetch_add(self.io_bytes as u64, Ordering::AcqRel);
        }
        None
    }

    /// Block until the op is done or `deadline` passes; `None` when it
    /// passed (the op is abandoned).
    pub fn wait_until(&self, deadline: Instant) -> Option<isize> {
        let mut state = self.lock();
        loop {
            if let Some(result) = state.result {
                return Some(result);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left == Duration::ZERO {
                state.thread_waiting = false;
                drop(state);
                return self.abandon();
            }
            state.thread_waiting = true;
            state = self
                .done
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
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
    // as librbd allows from its callback.
    let result = unsafe { (lib.rbd_aio_get_return_value)(completion) };
    // SAFETY: as above; nothing uses the completion afterwards.
    unsafe { (lib.rbd_aio_release)(completion) };
    op.finish(result);
}

/// librbd's negative errno as an I/O error.
pub(super) fn errno_error(rc: isize) -> io::Error {
    let errno = (-rc).clamp(1, i32::MAX as isize) as i32;
    if errno == libc::ESHUTDOWN {
        // librbd's EBLOCKLISTED: the cluster fenced this client, for good.
        return io::Error::other(Blocklisted);
    }
    io::Error::from_raw_os_error(errno)
}
