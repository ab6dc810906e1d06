//! A counting semaphore for tasks on any reactor (and threads in
//! `block_on`): units are taken as a task waits, never as a thread blocks.

use std::future::poll_fn;
use std::sync::{Mutex, MutexGuard};
use std::task::{Poll, Waker};

struct Units {
    available: u64,
    /// Tasks waiting for units, woken on every release.
    waiters: Vec<Waker>,
    /// Acquisitions that had to wait, for the counters.
    waits: u64,
}

pub struct Semaphore {
    total: u64,
    state: Mutex<Units>,
}

impl Semaphore {
    pub fn new(total: u64) -> Semaphore {
        Semaphore {
            total,
            state: Mutex::new(Units {
                available: total,
                waiters: Vec::new(),
                waits: 0,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Units> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn total(&self) -> u64 {
        self.total
    }

    /// Units not taken right now.
    pub fn available(&self) -> u64 {
        self.lock().available
    }

    /// How many acquisitions had to wait so far.
    pub fn waits(&self) -> u64 {
        self.lock().waits
    }

    /// Wait until `units` are available and take them; true if it had to
    /// wait. Asking for more than the total is capped at the total.
    pub async fn acquire(&self, units: u64) -> bool {
        let units = units.min(self.total);
        if units == 0 {
            return false;
        }
        let mut waited = false;
        poll_fn(|cx| {
            let mut state = self.lock();
            if state.available >= units {
                state.available -= units;
                if waited {
                    state.waits += 1;
                }
                return Poll::Ready(waited);
            }
            waited = true;
            state.waiters.push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Give back `units` taken with [`Semaphore::acquire`] (capped alike).
    pub fn release(&self, units: u64) {
        let units = units.min(self.total);
        if units == 0 {
            return;
        }
        let waiters = {
            let mut state = self.lock();
            state.available = (state.available + units).min(self.total);
            std::mem::take(&mut state.waiters)
        };
        // Every waiter looks again: a wake is cheap next to an I/O.
        for waker in waiters {
            waker.wake();
        }
    }
}
