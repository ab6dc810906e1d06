//! The fixed pool of rings of one device (see the [module
//! documentation](super) for why a pool), and the submission that waits.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::Duration;

use io_uring::{opcode, IoUring, Probe};

use super::ops::Op;

/// How long io_uring_enter may keep failing with EAGAIN/EBUSY (the kernel is
/// out of memory for requests) before we give up.
const ENTER_RETRY_BUDGET_MS: u64 = 5_000;

/// One ring and the scratch lists of the caller holding it.
pub(super) struct Ring {
    pub(super) ring: IoUring,
    /// Scratch space reused by every call, so a batch allocates nothing once
    /// these have grown to the workload's batch size.
    pub(super) ops: Vec<Op>,
    pub(super) iovecs: Vec<libc::iovec>,
}

// SAFETY: the raw pointers in `ops` and `iovecs` are only set while one
// caller holds the ring's mutex, point into memory that caller borrows for
// the duration of its call, and are cleared before the mutex is released.
unsafe impl Send for Ring {}

/// The rings of one device. See the module documentation for why a pool.
pub(crate) struct RingPool {
    rings: Box<[Mutex<Ring>]>,
}

/// Hands each thread its home ring index (see [`RingPool::acquire`]).
static NEXT_HOME: AtomicUsize = AtomicUsize::new(0);

impl RingPool {
    /// Set up `ring_count` rings. Fails when io_uring is unavailable (old
    /// kernel, seccomp, `kernel.io_uring_disabled`) or lacks an opcode we use.
    pub(crate) fn new(ring_count: usize, queue_depth: u32) -> io::Result<RingPool> {
        let ring_count = ring_count.max(1);
        let mut rings = Vec::with_capacity(ring_count);
        for _ in 0..ring_count {
            let ring = IoUring::new(queue_depth.max(2))?;
            if rings.is_empty() {
                check_opcodes(&ring)?;
            }
            rings.push(Mutex::new(Ring {
                ring,
                ops: Vec::new(),
                iovecs: Vec::new(),
            }));
        }
        Ok(RingPool {
            rings: rings.into_boxed_slice(),
        })
    }

    /// A free ring, with empty scratch lists.
    pub(super) fn acquire(&self) -> MutexGuard<'_, Ring> {
        let mut ring = self.lock_one();
        // A previous holder always leaves the scratch lists empty; clear
        // defensively so a stale pointer can never be submitted.
        if !ring.ops.is_empty() || !ring.iovecs.is_empty() {
            ring.ops.clear();
            ring.iovecs.clear();
        }
        ring
    }

    /// Try-lock every ring, starting from this thread's own, then wait for
    /// that one if all are busy.
    fn lock_one(&self) -> MutexGuard<'_, Ring> {
        thread_local! {
            /// This thread's first choice of ring, the same in every pool.
            static HOME: usize = NEXT_HOME.fetch_add(1, Ordering::Relaxed);
        }
        let count = self.rings.len();
        let start = HOME.with(|home| *home) % count;
        for i in 0..count {
            match self.rings[(start + i) % count].try_lock() {
                Ok(guard) => return guard,
                // A panic never leaves I/O in flight (see `InFlightGuard`),
                // so a poisoned ring is still usable.
                Err(TryLockError::Poisoned(poisoned)) => return poisoned.into_inner(),
                Err(TryLockError::WouldBlock) => {}
            }
        }
        self.rings[start]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

fn check_opcodes(ring: &IoUring) -> io::Result<()> {
    let mut probe = Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    for (code, name) in [
        (opcode::Read::CODE, "READ"),
        (opcode::Write::CODE, "WRITE"),
        (opcode::Writev::CODE, "WRITEV"),
        (opcode::Fsync::CODE, "FSYNC"),
    ] {
        if !probe.is_supported(code) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("this kernel's io_uring lacks IORING_OP_{name}"),
            ));
        }
    }
    Ok(())
}

/// Aborts the process if dropped while the kernel may still use memory we
/// lent it: unwinding past in-flight I/O would free buffers the kernel is
/// about to write into.
pub(super) struct InFlightGuard {
    pub(super) in_flight: usize,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self.in_flight > 0 {
            tracing::error!(
                in_flight = self.in_flight,
                "unwinding with io_uring I/O in flight; aborting"
            );
            std::process::abort();
        }
    }
}

/// Submit what is queued and wait for `want` completions, retrying the
/// transient failures. Any other failure aborts: our SQEs reference borrowed
/// memory, so returning while they may still run would be unsound, and
/// io_uring_enter only fails otherwise on a broken ring (EBADF, EFAULT...),
/// which is a bug, not a device error.
pub(super) fn submit_and_wait(ring: &IoUring, want: usize, device: &str) {
    let mut waited_ms = 0u64;
    let mut backoff_ms = 1u64;
    loop {
        match ring.submit_and_wait(want) {
            Ok(_) => return,
            Err(err) => match err.raw_os_error() {
                Some(libc::EINTR) => {}
                Some(libc::EAGAIN) | Some(libc::EBUSY) if waited_ms < ENTER_RETRY_BUDGET_MS => {
                    std::thread::sleep(Duration::from_millis(backoff_ms));
                    waited_ms += backoff_ms;
                    backoff_ms = (backoff_ms * 2).min(64);
                }
                _ => {
                    tracing::error!(
                        device,
                        "io_uring_enter failed with I/O in flight: {err}; aborting"
                    );
                    std::process::abort();
                }
            },
        }
    }
}
