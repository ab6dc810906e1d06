//! The results of one caller's batch of requests, filled in by the reader
//! thread as replies arrive.

use std::io;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// The replies of one caller's batch of requests.
pub(super) struct Batch {
    state: Mutex<BatchState>,
    /// Signalled when the last registered request completes.
    done: Condvar,
}

pub(super) struct BatchState {
    /// `Some(Ok(data))` once a request completed (data for reads).
    pub results: Vec<Option<io::Result<Option<Vec<u8>>>>>,
    /// Requests registered as in flight (sent or being sent).
    pub registered: usize,
    pub completed: usize,
}

impl Batch {
    pub fn new(count: usize) -> Batch {
        Batch {
            state: Mutex::new(BatchState {
                results: (0..count).map(|_| None).collect(),
                registered: 0,
                completed: 0,
            }),
            done: Condvar::new(),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, BatchState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wait up to `timeout` for the batch to complete.
    pub fn wait_timeout<'a>(
        &self,
        state: MutexGuard<'a, BatchState>,
        timeout: Duration,
    ) -> MutexGuard<'a, BatchState> {
        self.done
            .wait_timeout(state, timeout)
            .unwrap_or_else(PoisonError::into_inner)
            .0
    }

    pub fn complete(&self, index: usize, result: io::Result<Option<Vec<u8>>>) {
        let mut state = self.lock();
        if let Some(slot) = state.results.get_mut(index) {
            if slot.is_none() {
                *slot = Some(result);
                state.completed += 1;
                if state.completed == state.registered {
                    self.done.notify_all();
                }
            }
        }
    }
}
