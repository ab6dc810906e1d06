//! Operations in flight on the ring, and the future that awaits one.
//!
//! An operation owns everything the kernel touches (buffers, iovecs, a
//! timespec) in a box that stays in the reactor's op table until the
//! completion arrives, even if the future that started it is dropped: the
//! kernel never writes into freed memory.

use std::any::Any;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use io_uring::squeue;

use super::fallback::Attempt;
use super::Reactor;

/// What an operation is: how to build its ring entry from its (boxed,
/// stable) self, how to make it without a ring, and what its completion
/// yields.
pub trait OpKind: 'static {
    type Output;
    /// A read, write or sync of a file or device: submitted as soon as
    /// the task that started it yields, so the device starts on it while
    /// the loop serves its other ready tasks (socket operations wait for
    /// the turn's one submission).
    const SUBMIT_PROMPTLY: bool = false;
    /// The entry, pointing into `self` (which no longer moves).
    fn entry(&mut self) -> squeue::Entry;
    /// Without a ring: try the operation now with a plain system call.
    fn attempt(&mut self) -> Attempt;
    /// The output, from the completion's result (`-errno` or a count).
    fn finish(self: Box<Self>, result: i32) -> Self::Output;
}

/// An operation in the table, its kind erased.
pub(crate) trait ErasedOp: Any {
    fn attempt(&mut self) -> Attempt;
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
}

impl<K: OpKind> ErasedOp for K {
    fn attempt(&mut self) -> Attempt {
        OpKind::attempt(self)
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

enum SlotState {
    Free,
    InFlight {
        waker: Option<Waker>,
        keep: Box<dyn ErasedOp>,
        /// The future is gone: free the slot when the completion comes.
        orphaned: bool,
    },
    Done {
        result: i32,
        keep: Box<dyn ErasedOp>,
    },
}

/// Slots of operations in flight, indexed by the entries' user data.
#[derive(Default)]
pub(crate) struct OpTable {
    slots: Vec<SlotState>,
    free: Vec<usize>,
    in_flight: usize,
}

impl OpTable {
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight
    }

    pub(crate) fn start(&mut self, keep: Box<dyn ErasedOp>) -> usize {
        let key = self.free.pop().unwrap_or_else(|| {
            self.slots.push(SlotState::Free);
            self.slots.len() - 1
        });
        self.slots[key] = SlotState::InFlight {
            waker: None,
            keep,
            orphaned: false,
        };
        self.in_flight += 1;
        key
    }

    /// A completion for `key` arrived. Returns the waker to wake.
    pub(crate) fn complete(&mut self, key: usize, result: i32) -> Option<Waker> {
        let Some(slot) = self.slots.get_mut(key) else {
            tracing::error!(key, "completion for an unknown operation");
            return None;
        };
        match std::mem::replace(slot, SlotState::Free) {
            SlotState::InFlight {
                waker,
                keep,
                orphaned,
            } => {
                self.in_flight -= 1;
                if orphaned {
                    drop(keep);
                    self.free.push(key);
                    None
                } else {
                    *slot = SlotState::Done { result, keep };
                    waker
                }
            }
            other => {
                *slot = other;
                tracing::error!(key, "second completion for one operation");
                None
            }
        }
    }

    /// Without a ring: try operation `key` (in flight, not orphaned) again.
    pub(crate) fn attempt(&mut self, key: usize) -> Option<Attempt> {
        match self.slots.get_mut(key) {
            Some(SlotState::InFlight {
                keep,
                orphaned: false,
                ..
            }) => Some(keep.attempt()),
            _ => None,
        }
    }

    /// Poll `key`: its result and what it kept, once done.
    fn poll(&mut self, key: usize, waker: &Waker) -> Option<(i32, Box<dyn ErasedOp>)> {
        let slot = &mut self.slots[key];
        match slot {
            SlotState::InFlight { waker: w, .. } => {
                match w {
                    Some(old) if old.will_wake(waker) => {}
                    _ => *w = Some(waker.clone()),
                }
                None
            }
            SlotState::Done { .. } => {
                let SlotState::Done { result, keep } = std::mem::replace(slot, SlotState::Free)
                else {
                    unreachable!("matched Done")
                };
                self.free.push(key);
                Some((result, keep))
            }
            SlotState::Free => panic!("polled a freed operation slot {key}"),
        }
    }

    /// The future of `key` was dropped. True if the operation is still in
    /// flight: the caller cancels it, so its slot (and its place in the
    /// ring) comes back soon, not when a long timeout or a socket poll
    /// would end on its own.
    fn abandon(&mut self, key: usize) -> bool {
        let slot = &mut self.slots[key];
        match slot {
            SlotState::InFlight { orphaned, .. } => {
                *orphaned = true;
                true
            }
            SlotState::Done { .. } => {
                *slot = SlotState::Free;
                self.free.push(key);
                false
            }
            SlotState::Free => false,
        }
    }

    /// User data of every operation still in flight (to cancel them).
    pub(crate) fn in_flight_keys(&self) -> Vec<usize> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| matches!(s, SlotState::InFlight { .. }))
            .map(|(k, _)| k)
            .collect()
    }
}

/// A ring operation; resolves to its kind's output.
pub(crate) struct Op<K: OpKind> {
    reactor: Reactor,
    state: OpState<K>,
    _kind: PhantomData<K>,
}

enum OpState<K> {
    /// Not submitted yet: submission happens at the first poll.
    Unsubmitted(Box<K>),
    Submitted(usize),
    Finished,
}

impl<K: OpKind> Op<K> {
    pub(crate) fn new(reactor: Reactor, kind: K) -> Op<K> {
        Op {
            reactor,
            state: OpState::Unsubmitted(Box::new(kind)),
            _kind: PhantomData,
        }
    }
}

impl<K: OpKind> Unpin for Op<K> {}

impl<K: OpKind> Future for Op<K> {
    type Output = K::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<K::Output> {
        let this = &mut *self;
        loop {
            match std::mem::replace(&mut this.state, OpState::Finished) {
                OpState::Unsubmitted(kind) => {
                    if !this.reactor.has_room(cx.waker()) {
                        this.state = OpState::Unsubmitted(kind);
                        return Poll::Pending;
                    }
                    let key = this.reactor.submit(kind);
                    this.state = OpState::Submitted(key);
                }
                OpState::Submitted(key) => {
                    let polled = this.reactor.ops_mut().poll(key, cx.waker());
                    let Some((result, keep)) = polled else {
                        this.state = OpState::Submitted(key);
                        return Poll::Pending;
                    };
                    let kind = keep
                        .into_any()
                        .downcast::<K>()
                        .expect("an operation keeps its own kind");
                    return Poll::Ready(kind.finish(result));
                }
                OpState::Finished => panic!("operation polled after it completed"),
            }
        }
    }
}

impl<K: OpKind> Drop for Op<K> {
    fn drop(&mut self) {
        if let OpState::Submitted(key) = self.state {
            let in_flight = self.reactor.ops_mut().abandon(key);
            if in_flight {
                self.reactor.cancel(key);
            }
        }
    }
}
