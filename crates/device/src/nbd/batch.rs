//! The results of one caller's batch of requests, filled in by the reader
//! thread as replies arrive.

use std::io;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
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
    /// A task waiting for the batch (the asynchronous read path).
    pub waker: Option<Waker>,
}

impl Batch {
    pub fn new(count: usize) -> Batch {
        Batch {
            state: Mutex::new(BatchState {
                results: (0..count).map(|_| None).collect(),
                registered: 0,
                completed: 0,
                waker: None,
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

    /// Ready once every registered request completed; else the task is
    /// woken when the last one does.
    pub fn poll_done(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut state = self.lock();
        if state.completed >= state.registered {
            return Poll::Ready(());
        }
        state.waker = Some(cx.waker().clone());
        Poll::Pending
    }

    pub fn complete(&self, index: usize, result: io::Result<Option<Vec<u8>>>) {
        let mut state = self.lock();
        if let Some(slot) = state.results.get_mut(index) {
            if slot.is_none() {
                *slot = Some(result);
                state.completed += 1;
                if state.completed == state.registered {
                    self.done.notify_all();
                    if let Some(waker) = state.waker.take() {
                        waker.wake();
                    }
                }
            }
        }
    }
}
