//! A value sent once from any thread to a task on any executor.
//!
//! The receiver is a future; sending wakes it with whatever waker polled it
//! last (a reactor's task waker, which writes the reactor's eventfd when
//! the send comes from another thread, or [`crate::block_on`]'s thread
//! waker). Dropping the sender without sending completes the receiver with
//! `Err(Canceled)`.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

struct Slot<T> {
    value: Option<T>,
    waker: Option<Waker>,
    sender_gone: bool,
}

/// The sender was dropped without sending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Canceled;

pub struct Sender<T> {
    slot: Arc<Mutex<Slot<T>>>,
}

pub struct Receiver<T> {
    slot: Arc<Mutex<Slot<T>>>,
}

pub fn channel<T>() -> (Sender<T>, Receiver<T>) {
    let slot = Arc::new(Mutex::new(Slot {
        value: None,
        waker: None,
        sender_gone: false,
    }));
    (Sender { slot: slot.clone() }, Receiver { slot })
}

fn lock<T>(slot: &Mutex<Slot<T>>) -> std::sync::MutexGuard<'_, Slot<T>> {
    slot.lock().unwrap_or_else(|p| p.into_inner())
}

impl<T> Sender<T> {
    /// Deliver the value and wake the receiver.
    pub fn send(self, value: T) {
        let waker = {
            let mut slot = lock(&self.slot);
            slot.value = Some(value);
            slot.waker.take()
        };
        // Wake outside the lock: the waker may run arbitrary code.
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let waker = {
            let mut slot = lock(&self.slot);
            slot.sender_gone = true;
            slot.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl<T> Receiver<T> {
    /// The value, if it was sent already.
    pub fn try_recv(&mut self) -> Option<T> {
        lock(&self.slot).value.take()
    }
}

impl<T> Future for Receiver<T> {
    type Output = Result<T, Canceled>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut slot = lock(&self.slot);
        if let Some(value) = slot.value.take() {
            return Poll::Ready(Ok(value));
        }
        if slot.sender_gone {
            return Poll::Ready(Err(Canceled));
        }
        match &slot.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => slot.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}
