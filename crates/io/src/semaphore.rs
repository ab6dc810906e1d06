//! A counting semaphore for tasks on any reactor (and threads in
//! `block_on`): units are taken as a task waits, never as a thread blocks.
//!
//! First come, first served: a request for units waits behind every
//! earlier one still waiting, so a large request (a 32 MiB payload against
//! the server's byte budget) is not overtaken again and again by small
//! ones while the budget stays nearly spent. Units given back go to the
//! oldest waiters, as many as they cover, and only those are woken. A
//! waiter whose future is dropped (its request ended another way) leaves
//! the queue, and units it was granted but never took come back, so a
//! dropped waiter never holds up the others.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

/// One waiting acquisition; its state changes only under the semaphore's
/// lock.
#[derive(Default)]
struct Slot {
    granted: bool,
    waker: Option<Waker>,
}

struct Waiter {
    units: u64,
    slot: Arc<Mutex<Slot>>,
}

struct Units {
    available: u64,
    /// Oldest first; bounded by the tasks waiting (each holds one entry).
    waiters: VecDeque<Waiter>,
    /// Acquisitions that had to wait, for the counters.
    waits: u64,
}

pub struct Semaphore {
    total: u64,
    state: Mutex<Units>,
}

fn lock_slot(slot: &Mutex<Slot>) -> MutexGuard<'_, Slot> {
    slot.lock().unwrap_or_else(|e| e.into_inner())
}

impl Semaphore {
    pub fn new(total: u64) -> Semaphore {
        Semaphore {
            total,
            state: Mutex::new(Units {
                available: total,
                waiters: VecDeque::new(),
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

    /// Units not taken (nor granted to a waiter) right now.
    pub fn available(&self) -> u64 {
        self.lock().available
    }

    /// How many acquisitions had to wait so far.
    pub fn waits(&self) -> u64 {
        self.lock().waits
    }

    /// Acquisitions waiting now.
    pub fn waiting(&self) -> usize {
        self.lock().waiters.len()
    }

    /// Wait until `units` are available and take them, after every
    /// acquisition that started waiting earlier; true if it had to wait.
    /// Asking for more than the total is capped at the total.
    pub fn acquire(&self, units: u64) -> Acquire<'_> {
        let units = units.min(self.total);
        let mut state = self.lock();
        if units == 0 || (state.waiters.is_empty() && state.available >= units) {
            state.available -= units;
            return Acquire {
                semaphore: self,
                units,
                slot: None,
                done: false,
            };
        }
        state.waits += 1;
        let slot = Arc::new(Mutex::new(Slot::default()));
        state.waiters.push_back(Waiter {
            units,
            slot: Arc::clone(&slot),
        });
        Acquire {
            semaphore: self,
            units,
            slot: Some(slot),
            done: false,
        }
    }

    /// Give back `units` taken with [`Semaphore::acquire`] (capped alike).
    pub fn release(&self, units: u64) {
        let units = units.min(self.total);
        if units == 0 {
            return;
        }
        let wakers = {
            let mut state = self.lock();
            state.available = (state.available + units).min(self.total);
            grant(&mut state)
        };
        for waker in wakers {
            waker.wake();
        }
    }
}

/// Hand units to the oldest waiters while they fit; the wakers of those
/// granted, to wake once the lock is given up.
fn grant(state: &mut Units) -> Vec<Waker> {
    let mut wakers = Vec::new();
    while let Some(front) = state.waiters.front() {
        if front.units > state.available {
            break;
        }
        let waiter = state
            .waiters
            .pop_front()
            .expect("the front waiter was just seen");
        state.available -= waiter.units;
        let mut slot = lock_slot(&waiter.slot);
        slot.granted = true;
        if let Some(waker) = slot.waker.take() {
            wakers.push(waker);
        }
    }
    wakers
}

/// The future of [`Semaphore::acquire`]: resolves with whether it waited.
pub struct Acquire<'a> {
    semaphore: &'a Semaphore,
    units: u64,
    /// `None`: taken at once, without waiting.
    slot: Option<Arc<Mutex<Slot>>>,
    /// Resolved: the units are the caller's now.
    done: bool,
}

impl Future for Acquire<'_> {
    type Output = bool;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<bool> {
        let Some(slot) = self.slot.clone() else {
            self.done = true;
            return Poll::Ready(false);
        };
        // The grant is made under the semaphore's lock: take it first.
        let _state = self.semaphore.lock();
        let mut slot = lock_slot(&slot);
        if slot.granted {
            drop(slot);
            self.done = true;
            return Poll::Ready(true);
        }
        match &slot.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => slot.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl Drop for Acquire<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let Some(slot) = self.slot.take() else {
            // Taken at once but never polled: give the units back.
            self.semaphore.release(self.units);
            return;
        };
        let wakers = {
            let mut state = self.semaphore.lock();
            let granted = lock_slot(&slot).granted;
            if granted {
                // Granted, never taken: the units go to the next waiters.
                state.available = (state.available + self.units).min(self.semaphore.total);
            } else if let Some(at) = state
                .waiters
                .iter()
                .position(|w| Arc::ptr_eq(&w.slot, &slot))
            {
                state.waiters.remove(at);
            }
            // Leaving the front may let the next waiters through.
            grant(&mut state)
        };
        for waker in wakers {
            waker.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Semaphore;
    use std::future::Future;
    use std::pin::pin;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};

    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn waker() -> (Arc<CountingWaker>, Waker) {
        let counter = Arc::new(CountingWaker(AtomicUsize::new(0)));
        (counter.clone(), Waker::from(counter))
    }

    fn poll_once<F: Future>(f: std::pin::Pin<&mut F>, waker: &Waker) -> Poll<F::Output> {
        f.poll(&mut Context::from_waker(waker))
    }

    #[test]
    fn a_large_request_is_not_overtaken_by_small_ones() {
        let sem = Semaphore::new(100);
        let (_, w) = waker();
        let mut held = pin!(sem.acquire(90));
        assert_eq!(poll_once(held.as_mut(), &w), Poll::Ready(false));
        // 60 do not fit: the large request waits.
        let (large_woken, large_waker) = waker();
        let mut large = pin!(sem.acquire(60));
        assert!(poll_once(large.as_mut(), &large_waker).is_pending());
        // 5 would fit, but waits behind the large one.
        let (small_woken, small_waker) = waker();
        let mut small = pin!(sem.acquire(5));
        assert!(poll_once(small.as_mut(), &small_waker).is_pending());
        assert_eq!(sem.waiting(), 2);
        // 90 come back: the large one gets its 60, the small one its 5.
        sem.release(90);
        assert_eq!(large_woken.0.load(Ordering::SeqCst), 1);
        assert_eq!(small_woken.0.load(Ordering::SeqCst), 1);
        assert_eq!(poll_once(large.as_mut(), &large_waker), Poll::Ready(true));
        assert_eq!(poll_once(small.as_mut(), &small_waker), Poll::Ready(true));
        assert_eq!(sem.available(), 35);
        assert_eq!(sem.waits(), 2);
    }

    #[test]
    fn only_the_waiters_the_units_cover_are_woken() {
        let sem = Semaphore::new(10);
        let (_, w) = waker();
        let mut all = pin!(sem.acquire(10));
        assert!(poll_once(all.as_mut(), &w).is_ready());
        let counters: Vec<_> = (0..4).map(|_| waker()).collect();
        let mut futures: Vec<_> = (0..4).map(|_| Box::pin(sem.acquire(5))).collect();
        for (f, (_, w)) in futures.iter_mut().zip(&counters) {
            assert!(poll_once(f.as_mut(), w).is_pending());
        }
        sem.release(5);
        let woken: Vec<usize> = counters
            .iter()
            .map(|(c, _)| c.0.load(Ordering::SeqCst))
            .collect();
        assert_eq!(woken, vec![1, 0, 0, 0], "the oldest waiter only");
    }

    #[test]
    fn a_dropped_waiter_leaves_the_queue_and_lets_the_next_through() {
        let sem = Semaphore::new(10);
        let (_, w) = waker();
        let mut held = pin!(sem.acquire(8));
        assert!(poll_once(held.as_mut(), &w).is_ready());
        // The front waiter needs more than will come back; the next fits.
        let mut big = Box::pin(sem.acquire(10));
        assert!(poll_once(big.as_mut(), &w).is_pending());
        let (next_woken, next_waker) = waker();
        let mut next = pin!(sem.acquire(2));
        assert!(poll_once(next.as_mut(), &next_waker).is_pending());
        drop(big);
        assert_eq!(next_woken.0.load(Ordering::SeqCst), 1);
        assert_eq!(poll_once(next.as_mut(), &next_waker), Poll::Ready(true));
        assert_eq!(sem.waiting(), 0);
        assert_eq!(sem.available(), 0);
    }

    #[test]
    fn units_granted_to_a_waiter_that_is_dropped_come_back() {
        let sem = Semaphore::new(10);
        let (_, w) = waker();
        let mut held = pin!(sem.acquire(10));
        assert!(poll_once(held.as_mut(), &w).is_ready());
        let mut granted = Box::pin(sem.acquire(4));
        assert!(poll_once(granted.as_mut(), &w).is_pending());
        let (later_woken, later_waker) = waker();
        let mut later = pin!(sem.acquire(8));
        assert!(poll_once(later.as_mut(), &later_waker).is_pending());
        // 4 come back and go to the first waiter, which is then dropped
        // before it takes them: they go on to the next.
        sem.release(4);
        drop(granted);
        assert_eq!(later_woken.0.load(Ordering::SeqCst), 0, "8 do not fit in 4");
        sem.release(4);
        assert_eq!(later_woken.0.load(Ordering::SeqCst), 1);
        assert_eq!(poll_once(later.as_mut(), &later_waker), Poll::Ready(true));
        assert_eq!(sem.available(), 0);
    }

    #[test]
    fn an_acquisition_never_polled_gives_its_units_back() {
        let sem = Semaphore::new(10);
        drop(sem.acquire(7));
        assert_eq!(sem.available(), 10);
        let (_, w) = waker();
        let mut taken = pin!(sem.acquire(7));
        assert_eq!(poll_once(taken.as_mut(), &w), Poll::Ready(false));
        // Resolved: the units are the caller's, dropping the future keeps
        // them taken until released.
        assert_eq!(sem.available(), 3);
    }
}
