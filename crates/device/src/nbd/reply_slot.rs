//! Where the reply to one read on a loop's own connection lands, and the
//! task waiting for it.

use std::cell::RefCell;
use std::task::{Context, Poll, Waker};

use super::loop_read_error::LoopReadError;

/// The outcome of one request, set once by the loop's reader task (or by
/// the connection's end) and taken by the task that sent the request.
pub(super) struct ReplySlot {
    /// Bytes of data that follow a successful reply.
    pub read_len: usize,
    outcome: RefCell<Option<Result<Vec<u8>, LoopReadError>>>,
    waker: RefCell<Option<Waker>>,
}

impl ReplySlot {
    pub fn new(read_len: usize) -> ReplySlot {
        ReplySlot {
            read_len,
            outcome: RefCell::new(None),
            waker: RefCell::new(None),
        }
    }

    /// The first outcome counts; a later one (the connection ending after
    /// the reply came) changes nothing.
    pub fn complete(&self, outcome: Result<Vec<u8>, LoopReadError>) {
        {
            let mut slot = self.outcome.borrow_mut();
            if slot.is_some() {
                return;
            }
            *slot = Some(outcome);
        }
        if let Some(waker) = self.waker.borrow_mut().take() {
            waker.wake();
        }
    }

    pub fn poll_outcome(&self, cx: &mut Context<'_>) -> Poll<Result<Vec<u8>, LoopReadError>> {
        if let Some(outcome) = self.outcome.borrow_mut().take() {
            return Poll::Ready(outcome);
        }
        *self.waker.borrow_mut() = Some(cx.waker().clone());
        Poll::Pending
    }
}
