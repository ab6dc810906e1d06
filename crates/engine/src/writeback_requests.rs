//! Write-back steps that tasks wait for instead of running them.
//!
//! A writer that must wait for write-back (the log full of dirty data, its
//! volume at its dirty share, a write-through write waiting for its origin)
//! ran the step itself, in its own thread. On a connection's event loop
//! that stopped every other request of the connection for the step's whole
//! origin latency: 32 write-through writes in flight over a 5 ms origin
//! were written back one after another, 163 IOPS where the origin alone
//! took 3,115. A task now queues a request here and waits for its answer as
//! a task; the daemon's request threads ([`WritebackRequests::serve`]) take
//! every request that wants the same thing, run one step for all of them
//! and answer each, and each writer then looks again at what it waits for.
//!
//! Nothing waits on this when no thread serves: a caller without a reactor,
//! or with nobody serving (offline commands, the simulation, tests), runs
//! the step itself, as before. A request queued when the last server stops
//! is answered "not served" and its caller runs the step itself too.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use cairn_io::oneshot;

use crate::error::{EngineError, EngineResult};
use crate::want::Want;

/// How long a server with nothing to do sleeps before it looks at its stop
/// flag again, if nobody woke it ([`WritebackRequests::wake_servers`] does
/// at a stop): a bound, not a poll.
const IDLE_WAIT: Duration = Duration::from_secs(5);

/// What a step ended with, for every request it answered: the error's
/// errno, message and whether an origin failed (the error itself went to
/// no one in particular).
pub(crate) type StepAnswer = Result<(), (i32, String, bool)>;

struct Request {
    want: Want,
    answer: oneshot::Sender<StepAnswer>,
}

#[derive(Default)]
struct Queue {
    /// Threads in [`WritebackRequests::serve`] now.
    servers: usize,
    /// Bounded by the tasks waiting, one request each (and those by the
    /// server's in-flight limits).
    requests: VecDeque<Request>,
}

#[derive(Default)]
pub(crate) struct WritebackRequests {
    queue: Mutex<Queue>,
    /// Signalled when a request is queued.
    queued: Condvar,
}

impl WritebackRequests {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Threads serving requests now.
    pub(crate) fn servers(&self) -> usize {
        self.lock().servers
    }

    /// Queue a request for a step that `want` names; `None` if no thread
    /// serves requests (the caller runs the step itself).
    pub(crate) fn submit(&self, want: Want) -> Option<oneshot::Receiver<StepAnswer>> {
        let mut queue = self.lock();
        if queue.servers == 0 {
            return None;
        }
        let (answer, receiver) = oneshot::channel();
        queue.requests.push_back(Request { want, answer });
        drop(queue);
        self.queued.notify_one();
        Some(receiver)
    }

    /// Serve requests with `step` until `stop` is set. Several threads may
    /// serve at once; each takes the oldest request and every other one
    /// that wants the same step, runs it once and answers them all.
    pub(crate) fn serve(&self, stop: &AtomicBool, step: impl Fn(Want) -> EngineResult<()>) {
        self.lock().servers += 1;
        // Not counted: it runs for the daemon's life, one step per turn,
        // and sleeps until a request comes or it is woken to stop.
        loop {
            let mut queue = self.lock();
            while queue.requests.is_empty() && !stop.load(Ordering::Acquire) {
                queue = self
                    .queued
                    .wait_timeout(queue, IDLE_WAIT)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            if stop.load(Ordering::Acquire) {
                break;
            }
            let Some(first) = queue.requests.pop_front() else {
                continue;
            };
            let want = first.want;
            let mut same = vec![first];
            let mut rest = VecDeque::with_capacity(queue.requests.len());
            for request in queue.requests.drain(..) {
                if request.want == want {
                    same.push(request);
                } else {
                    rest.push_back(request);
                }
            }
            queue.requests = rest;
            drop(queue);
            let answer = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(want)))
            {
                Ok(result) => result.map_err(|e| (e.errno(), e.to_string(), e.is_origin_failure())),
                Err(_) => Err((libc::EIO, "a write-back step panicked".to_string(), false)),
            };
            for request in same {
                request.answer.send(answer.clone());
            }
        }
        let orphans = {
            let mut queue = self.lock();
            queue.servers -= 1;
            if queue.servers == 0 {
                std::mem::take(&mut queue.requests)
            } else {
                VecDeque::new()
            }
        };
        // Their senders dropped unanswered: each caller runs its step itself.
        drop(orphans);
        // Another server may be asleep with requests this one left behind.
        self.queued.notify_all();
    }

    /// Wake every server, after their stop flag was set. Under the lock,
    /// so a server between its look at the flag and its sleep is not
    /// missed.
    pub(crate) fn wake_servers(&self) {
        let _queue = self.lock();
        self.queued.notify_all();
    }

    /// The error a waiter returns for a step that failed for it.
    pub(crate) fn error_of(answer: (i32, String, bool)) -> EngineError {
        let (errno, message, origin_failed) = answer;
        EngineError::WritebackStep {
            errno,
            message,
            origin_failed,
        }
    }
}
