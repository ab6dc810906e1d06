//! [`Deadline`]: a time limit for one operation after another, with one
//! ring timer shared by all of them.
//!
//! A timer per operation (a `sleep` raced against each send, then
//! cancelled) costs two extra ring operations for every one it guards. A
//! `Deadline` keeps its timer across operations: a timer armed for an
//! earlier operation always fires no later than the current one's limit
//! would, so when it fires early it is armed again for the time left. A
//! busy connection then arms about one timer per limit period, not one per
//! send.

use std::future::Future;
use std::pin::{pin, Pin};
use std::task::Poll;
use std::time::{Duration, Instant};

use crate::Reactor;

type Timer = Pin<Box<dyn Future<Output = ()>>>;

pub struct Deadline {
    reactor: Reactor,
    limit: Duration,
    /// Armed by an earlier (or the current) operation; fires at or before
    /// the current operation's limit.
    timer: Option<Timer>,
}

impl Deadline {
    /// Each operation run through this deadline gets `limit`.
    pub fn new(reactor: Reactor, limit: Duration) -> Deadline {
        Deadline {
            reactor,
            limit,
            timer: None,
        }
    }

    /// Run `operation` to its end (`Some`), or give up on it (`None`, the
    /// operation dropped) once it has taken `limit`.
    pub async fn run<F: Future>(&mut self, operation: F) -> Option<F::Output> {
        let started = Instant::now();
        let mut operation = pin!(operation);
        // Bounded: each early firing re-arms for the time left, which
        // shrinks; the clock only moves forward.
        loop {
            if self.timer.is_none() {
                let left = self.limit.saturating_sub(started.elapsed());
                self.timer = Some(Box::pin(self.reactor.sleep(left)));
            }
            let timer = self.timer.as_mut().expect("armed above");
            let fired = std::future::poll_fn(|cx| {
                if let Poll::Ready(out) = operation.as_mut().poll(cx) {
                    return Poll::Ready(Some(out));
                }
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(None),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
            match fired {
                Some(out) => return Some(out),
                None => {
                    self.timer = None;
                    if started.elapsed() >= self.limit {
                        return None;
                    }
                }
            }
        }
    }
}
