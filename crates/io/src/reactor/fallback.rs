//! The event loop without io_uring: where the kernel lacks it or a
//! seccomp profile or `kernel.io_uring_disabled` forbids it (a container
//! runtime's default profile does), the same operations are made with
//! plain system calls. File reads, writes and syncs run at once on the
//! loop's thread (they block it, as the pread backend's devices do);
//! socket receives and sends are tried without blocking and, when the
//! socket is not ready, wait in one ppoll(2) per loop turn together with
//! the eventfd and the nearest timer.

use std::time::Instant;

/// Times a system call is retried when a signal interrupts it before it
/// did anything; io_uring never reports EINTR for these operations.
const EINTR_RETRIES_MAX: usize = 64;

/// What trying an operation without a ring gave.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Attempt {
    /// Finished, with the result a ring completion would carry (a count,
    /// or `-errno`).
    Done(i32),
    /// Not yet: try again when the wait is over.
    Wait(Wait),
}

/// What an operation that could not finish at once waits for.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Wait {
    /// `fd` ready for `events` (`POLLIN`, `POLLOUT`...).
    Fd { fd: i32, events: i16 },
    /// A timer due at this instant.
    Until(Instant),
}

/// Run `call` (a system call returning -1 and `errno` on failure) and
/// turn its result into a ring-style result, retrying interruptions.
pub(crate) fn syscall(mut call: impl FnMut() -> isize) -> i32 {
    for _ in 0..EINTR_RETRIES_MAX {
        let ret = call();
        if ret >= 0 {
            return i32::try_from(ret).unwrap_or(i32::MAX);
        }
        let errno = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        if errno != libc::EINTR {
            return -errno;
        }
    }
    -libc::EINTR
}

/// A socket call that must not block: `EAGAIN` becomes a wait for
/// `events` on `fd`.
pub(crate) fn socket_attempt(fd: i32, events: i16, call: impl FnMut() -> isize) -> Attempt {
    let result = syscall(call);
    if result == -libc::EAGAIN || result == -libc::EWOULDBLOCK {
        Attempt::Wait(Wait::Fd { fd, events })
    } else {
        Attempt::Done(result)
    }
}

/// Is `fd` ready for `events` now? Its ready events, or a wait.
pub(crate) fn poll_now(fd: i32, events: i16) -> Attempt {
    let mut pollfd = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one valid pollfd, timeout 0 (never blocks).
    let result = syscall(|| unsafe { libc::poll(&mut pollfd, 1, 0) } as isize);
    match result {
        0 => Attempt::Wait(Wait::Fd { fd, events }),
        n if n < 0 => Attempt::Done(n),
        // A descriptor poll(2) cannot watch is reported, as io_uring does.
        _ if pollfd.revents & libc::POLLNVAL != 0 => Attempt::Done(-libc::EBADF),
        _ => Attempt::Done(i32::from(pollfd.revents as u16)),
    }
}

/// The operations waiting without a ring, by their op table key.
#[derive(Default)]
pub(crate) struct Waits {
    waits: Vec<(usize, Wait)>,
}

impl Waits {
    pub(crate) fn push(&mut self, key: usize, wait: Wait) {
        debug_assert!(self.waits.iter().all(|&(k, _)| k != key), "waits twice");
        self.waits.push((key, wait));
    }

    /// Stop waiting for `key` (its future was dropped).
    pub(crate) fn remove(&mut self, key: usize) {
        self.waits.retain(|&(k, _)| k != key);
    }

    /// Block in ppoll(2) until `eventfd` is readable, a waited descriptor
    /// is ready or the nearest timer is due (`block` false: only look).
    /// Returns the keys whose wait is over, taken out of the list; the
    /// caller tries them again. The eventfd is drained when it fired.
    pub(crate) fn wait(&mut self, eventfd: i32, block: bool) -> Vec<usize> {
        let mut pollfds = Vec::with_capacity(self.waits.len() + 1);
        pollfds.push(libc::pollfd {
            fd: eventfd,
            events: libc::POLLIN,
            revents: 0,
        });
        let mut nearest: Option<Instant> = None;
        for &(_, wait) in &self.waits {
            let (fd, events) = match wait {
                Wait::Fd { fd, events } => (fd, events),
                Wait::Until(at) => {
                    nearest = Some(nearest.map_or(at, |n| n.min(at)));
                    // A negative descriptor is ignored by ppoll(2).
                    (-1, 0)
                }
            };
            pollfds.push(libc::pollfd {
                fd,
                events,
                revents: 0,
            });
        }
        // ppoll(2), not poll(2): a timer's wait to the microsecond, as
        // io_uring's timeouts, not rounded up to the next millisecond.
        let timeout: Option<libc::timespec> = if !block {
            Some(libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            })
        } else {
            nearest.map(|at| {
                let left = at.saturating_duration_since(Instant::now());
                libc::timespec {
                    tv_sec: libc::time_t::try_from(left.as_secs()).unwrap_or(libc::time_t::MAX),
                    tv_nsec: left.subsec_nanos() as libc::c_long,
                }
            })
        };
        let timeout_ptr = timeout
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: `pollfds` is a valid array of its length for the call;
        // the timeout, if any, lives until it returns; no signal mask.
        let polled = unsafe {
            libc::ppoll(
                pollfds.as_mut_ptr(),
                pollfds.len() as _,
                timeout_ptr,
                std::ptr::null(),
            )
        };
        if polled < 0 {
            // EINTR (a signal) or ENOMEM: look again next turn.
            return Vec::new();
        }
        if pollfds[0].revents != 0 {
            drain_eventfd(eventfd);
        }
        let now = Instant::now();
        let mut over = Vec::new();
        let mut k = 0;
        self.waits.retain(|&(key, wait)| {
            k += 1;
            let due = match wait {
                Wait::Fd { .. } => pollfds[k].revents != 0,
                Wait::Until(at) => at <= now,
            };
            if due {
                over.push(key);
            }
            !due
        });
        over
    }
}

/// Reset the eventfd's counter so the next poll sleeps again.
fn drain_eventfd(eventfd: i32) {
    let mut value = [0u8; 8];
    // SAFETY: reading 8 bytes into a valid buffer from our non-blocking
    // eventfd; EAGAIN (already drained) is fine.
    unsafe { libc::read(eventfd, value.as_mut_ptr().cast(), value.len()) };
}
