//! The tasks of one reactor: futures in a slab, each with its waker.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use super::shared::{Shared, TaskWaker};

type LocalFuture = Pin<Box<dyn Future<Output = ()>>>;

struct Task {
    /// `None` while the task is being polled (so it may spawn others).
    future: Option<LocalFuture>,
    waker: Arc<TaskWaker>,
}

#[derive(Default)]
pub(crate) struct Tasks {
    slots: Vec<Option<Task>>,
    /// The waker of each slot, kept when its task ends and reused by the
    /// next task there: a task per request made a waker allocation per
    /// request. A waker of an ended task that fires late only polls its
    /// slot's next task once more, which every future must tolerate.
    wakers: Vec<Arc<TaskWaker>>,
    free: Vec<usize>,
    live: usize,
}

impl Tasks {
    pub(crate) fn live(&self) -> usize {
        self.live
    }

    /// Add a task and queue it to be polled.
    pub(crate) fn insert(&mut self, future: LocalFuture, shared: &Arc<Shared>) -> usize {
        let id = self.free.pop().unwrap_or_else(|| {
            let id = self.slots.len();
            self.slots.push(None);
            self.wakers.push(Arc::new(TaskWaker {
                task: id,
                shared: shared.clone(),
                queued: AtomicBool::new(false),
            }));
            id
        });
        debug_assert!(self.slots[id].is_none(), "a free slot is empty");
        let waker = self.wakers[id].clone();
        debug_assert_eq!(waker.task, id);
        // A late wake-up meant for the slot's last task may have left the
        // flag set with no entry left in the ready queue: start clear (at
        // worst the new task is polled twice).
        waker.queued.store(false, Ordering::Release);
        self.slots[id] = Some(Task {
            future: Some(future),
            waker: waker.clone(),
        });
        self.live += 1;
        std::task::Wake::wake_by_ref(&waker);
        id
    }

    /// Take task `id`'s future to poll it, with its waker. `None` if the
    /// task ended (a stale wake-up) or is being polled.
    pub(crate) fn take(&mut self, id: usize) -> Option<(LocalFuture, Waker)> {
        let task = self.slots.get_mut(id)?.as_mut()?;
        // Clear before polling: a wake-up during the poll queues it again.
        task.waker.queued.store(false, Ordering::Release);
        let future = task.future.take()?;
        Some((future, Waker::from(task.waker.clone())))
    }

    /// Put a still pending future back.
    pub(crate) fn put_back(&mut self, id: usize, future: LocalFuture) {
        let task = self.slots[id].as_mut().expect("a task being polled exists");
        task.future = Some(future);
    }

    /// The task finished: free its slot.
    pub(crate) fn remove(&mut self, id: usize) {
        self.slots[id] = None;
        self.free.push(id);
        self.live -= 1;
    }

    /// Drop every task (their futures release what they hold).
    pub(crate) fn clear(&mut self) -> Vec<LocalFuture> {
        let mut futures = Vec::new();
        for (id, slot) in self.slots.iter_mut().enumerate() {
            if let Some(task) = slot.take() {
                if let Some(f) = task.future {
                    futures.push(f);
                }
                self.free.push(id);
            }
        }
        self.live = 0;
        futures
    }
}

/// What a spawned task leaves for its [`JoinHandle`].
struct JoinState<T> {
    output: Option<T>,
    waker: Option<Waker>,
}

/// Awaits a spawned task's output. Dropping it detaches the task.
pub struct JoinHandle<T> {
    state: Rc<RefCell<JoinState<T>>>,
}

impl<T> JoinHandle<T> {
    /// The output, if the task finished.
    pub fn try_take(&self) -> Option<T> {
        self.state.borrow_mut().output.take()
    }
}

impl<T> Future for JoinHandle<T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let mut state = self.state.borrow_mut();
        match state.output.take() {
            Some(output) => Poll::Ready(output),
            None => {
                state.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// `future` as a task nobody joins.
pub(crate) fn detached<F>(future: F) -> LocalFuture
where
    F: Future<Output = ()> + 'static,
{
    Box::pin(future)
}

/// Wrap `future` so its output lands in a join handle.
pub(crate) fn with_join<F>(future: F) -> (LocalFuture, JoinHandle<F::Output>)
where
    F: Future + 'static,
{
    let state = Rc::new(RefCell::new(JoinState {
        output: None,
        waker: None,
    }));
    let handle = JoinHandle {
        state: state.clone(),
    };
    let task = async move {
        let output = future.await;
        let waker = {
            let mut s = state.borrow_mut();
            s.output = Some(output);
            s.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    };
    (Box::pin(task), handle)
}
