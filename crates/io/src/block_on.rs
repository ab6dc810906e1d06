//! Running a future to completion on a thread that has no reactor (or
//! from inside a reactor task that must call a synchronous API).

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;

use crate::reactor::Reactor;

struct ThreadWaker {
    thread: Thread,
    woken: AtomicBool,
}

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

/// Poll `future` on this thread until it completes, parking in between.
/// No reactor is current while it runs, so I/O the future does through
/// cairn's devices is done synchronously.
pub fn block_on<F: Future>(future: F) -> F::Output {
    let _no_reactor = Reactor::suspend_current();
    let waker_state = Arc::new(ThreadWaker {
        thread: std::thread::current(),
        woken: AtomicBool::new(false),
    });
    let waker = Waker::from(waker_state.clone());
    let mut cx = Context::from_waker(&waker);
    let mut future = pin!(future);
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return output;
        }
        // Park until woken; `woken` covers a wake before we park, and
        // spurious unparks just poll again.
        while !waker_state.woken.swap(false, Ordering::Acquire) {
            std::thread::park();
        }
    }
}
