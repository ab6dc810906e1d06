//! Blocking calls a task must not make on its reactor's thread, run on a
//! few threads of their own: a device call with no asynchronous form that
//! may wait on a network (an NBD or RBD origin's allocation query). The
//! task waits for the answer as a task, so its event loop goes on.
//!
//! The threads start at the first call, so a process that never offloads
//! never starts them; if none can be started, the call runs on the caller's
//! thread, as it did before.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};

use crate::oneshot;

/// Threads: enough for a few slow calls at once on 2 cores; a call beyond
/// them waits in the queue.
const OFFLOAD_THREADS: usize = 4;

type Job = Box<dyn FnOnce() + Send>;

struct Queue {
    /// Bounded by the callers waiting, one job each.
    jobs: Mutex<VecDeque<Job>>,
    ready: Condvar,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, VecDeque<Job>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// `None`: no thread could be started (calls run where they are made).
static POOL: OnceLock<Option<&'static Queue>> = OnceLock::new();

fn start() -> Option<&'static Queue> {
    let queue: &'static Queue = Box::leak(Box::new(Queue {
        jobs: Mutex::new(VecDeque::new()),
        ready: Condvar::new(),
    }));
    let mut started = 0;
    for index in 0..OFFLOAD_THREADS {
        let spawned = std::thread::Builder::new()
            .name(format!("offload-{index}"))
            .spawn(move || run_jobs(queue));
        match spawned {
            Ok(_) => started += 1,
            Err(e) => {
                tracing::warn!("started {started} of {OFFLOAD_THREADS} offload threads: {e}");
                break;
            }
        }
    }
    (started > 0).then_some(queue)
}

/// Take jobs for the life of the process. A job that panics drops its
/// answer unsent (its caller sees the call canceled); the thread goes on.
fn run_jobs(queue: &Queue) {
    loop {
        let job = {
            let mut jobs = queue.lock();
            loop {
                if let Some(job) = jobs.pop_front() {
                    break job;
                }
                jobs = queue.ready.wait(jobs).unwrap_or_else(|p| p.into_inner());
            }
        };
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
            tracing::error!("an offloaded call panicked");
        }
    }
}

/// Run `call` on an offload thread; its result arrives on the receiver (a
/// future any task can await, or `block_on`). Canceled if `call` panicked.
pub fn offload<T: Send + 'static>(
    call: impl FnOnce() -> T + Send + 'static,
) -> oneshot::Receiver<T> {
    let (sender, receiver) = oneshot::channel();
    let job: Job = Box::new(move || sender.send(call()));
    match POOL.get_or_init(start) {
        Some(queue) => {
            queue.lock().push_back(job);
            queue.ready.notify_one();
        }
        None => job(),
    }
    receiver
}
