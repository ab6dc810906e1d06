//! Wake every task of this thread waiting for something to change (a
//! connection's in-flight count, its output queue). Single-threaded: for
//! tasks of one reactor only.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

#[derive(Default)]
pub struct LocalNotify {
    /// Bumped by every `notify_all`; a waiter is done once it changed.
    epoch: Cell<u64>,
    waiters: RefCell<Vec<Waker>>,
}

impl LocalNotify {
    /// Wake every task waiting in [`LocalNotify::notified`].
    pub fn notify_all(&self) {
        self.epoch.set(self.epoch.get() + 1);
        let waiters = std::mem::take(&mut *self.waiters.borrow_mut());
        for waker in waiters {
            waker.wake();
        }
    }

    /// Resolves at the next `notify_all` after this call.
    pub fn notified(&self) -> Notified<'_> {
        Notified {
            notify: self,
            epoch: self.epoch.get(),
        }
    }
}

pub struct Notified<'a> {
    notify: &'a LocalNotify,
    epoch: u64,
}

impl Future for Notified<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.notify.epoch.get() != self.epoch {
            return Poll::Ready(());
        }
        self.notify.waiters.borrow_mut().push(cx.waker().clone());
        Poll::Pending
    }
}
