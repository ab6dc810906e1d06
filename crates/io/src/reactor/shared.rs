//! The part of a reactor other threads may touch: its ready queue and its
//! eventfd, through task wakers.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Wake;

pub(crate) struct Shared {
    /// Tasks woken since the loop last looked.
    ready: Mutex<Vec<usize>>,
    /// The loop is (about to be) blocked in the kernel: a wake-up must
    /// write the eventfd.
    sleeping: AtomicBool,
    eventfd: OwnedFd,
}

impl Shared {
    pub(crate) fn new() -> std::io::Result<Shared> {
        // SAFETY: eventfd(2) with valid flags; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Shared {
            ready: Mutex::new(Vec::new()),
            sleeping: AtomicBool::new(false),
            // SAFETY: `fd` is a fresh descriptor we own.
            eventfd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    pub(crate) fn eventfd(&self) -> i32 {
        self.eventfd.as_raw_fd()
    }

    fn lock_ready(&self) -> std::sync::MutexGuard<'_, Vec<usize>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn push_ready(&self, task: usize) {
        self.lock_ready().push(task);
        if self.sleeping.swap(false, Ordering::SeqCst) {
            let one: u64 = 1;
            // SAFETY: writing 8 bytes from a valid u64 to our eventfd. A
            // full counter (EAGAIN) still leaves the loop woken.
            unsafe {
                libc::write(
                    self.eventfd.as_raw_fd(),
                    (&one as *const u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
        }
    }

    /// Take every woken task id.
    pub(crate) fn take_ready(&self, into: &mut Vec<usize>) {
        into.append(&mut self.lock_ready());
    }

    pub(crate) fn has_ready(&self) -> bool {
        !self.lock_ready().is_empty()
    }

    /// About to block in the kernel: from now on wake-ups write the
    /// eventfd. Returns false (and stays awake) if something is ready.
    pub(crate) fn prepare_sleep(&self) -> bool {
        self.sleeping.store(true, Ordering::SeqCst);
        if self.has_ready() {
            self.sleeping.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    pub(crate) fn woke(&self) {
        self.sleeping.store(false, Ordering::SeqCst);
    }
}

/// The waker of one task.
pub(crate) struct TaskWaker {
    pub(crate) task: usize,
    pub(crate) shared: Arc<Shared>,
    /// Already in the ready queue: a second wake-up adds nothing.
    pub(crate) queued: AtomicBool,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if !self.queued.swap(true, Ordering::AcqRel) {
            self.shared.push_ready(self.task);
        }
    }
}
