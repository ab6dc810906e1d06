//! One thread's io_uring and the tasks it drives.

mod fallback;
mod kinds;
mod op;
mod shared;
mod tasks;

pub use tasks::JoinHandle;

use std::any::{Any, TypeId};
use std::cell::{Cell, RefCell, RefMut};
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Waker;
use std::time::Duration;

use io_uring::{opcode, squeue, types, IoUring};

use fallback::{Attempt, Waits};
pub(crate) use kinds::recv_dontwait;
use kinds::{Fsync, PollFd, ReadAt, Recv, SendOwned, Sleep, WriteAt, WritevAt};
use op::{Op, OpKind, OpTable};
use shared::Shared;
use tasks::{with_join, Tasks};

use crate::backend::{IoBackend, IO_BACKEND_ENV};
use crate::buf::{StableBuf, StableBufMut, StableBufs};

/// User data of the eventfd read (remote wake-ups).
const EVENTFD_USER_DATA: u64 = u64::MAX - 1;
/// User data of cancellations at shutdown (their completions are ignored).
const CANCEL_USER_DATA: u64 = u64::MAX;
/// Tasks polled per pass before the loop looks at the ring again, so a
/// task that keeps waking itself cannot starve completions.
const POLLS_PER_TURN_MAX: usize = 1024;
/// How long a dropped reactor waits for cancelled operations to complete
/// before it leaks their buffers rather than free memory the kernel may
/// still write.
const SHUTDOWN_WAIT_MS: u64 = 5_000;

/// How a reactor's ring is set up.
#[derive(Debug, Clone)]
pub struct ReactorOptions {
    /// Submission queue entries; at most this many operations are in
    /// flight at once (more wait for room, they never fail). Without a
    /// ring, the same bound on operations in flight.
    pub ring_entries: u32,
    /// io_uring, or plain system calls (see [`IoBackend`]); `Auto` falls
    /// back to system calls, with one warning, where io_uring fails.
    pub backend: IoBackend,
}

impl Default for ReactorOptions {
    fn default() -> Self {
        ReactorOptions {
            ring_entries: 256,
            backend: IoBackend::Auto,
        }
    }
}

/// The event loop's running without io_uring has been logged (once per
/// process, not once per connection).
static FALLBACK_WARNED: AtomicBool = AtomicBool::new(false);

struct Inner {
    /// None: no io_uring here; operations are system calls ([`fallback`]).
    ring: Option<RefCell<IoUring>>,
    /// Without a ring: the operations waiting for a socket or a timer.
    waits: RefCell<Waits>,
    ops: RefCell<OpTable>,
    tasks: RefCell<Tasks>,
    shared: Arc<Shared>,
    /// Operations waiting for room in the ring.
    room_waiters: RefCell<VecDeque<Waker>>,
    ops_max: usize,
    /// The eventfd read's 8-byte target: a stable heap allocation.
    eventfd_buf: RefCell<Box<[u8; 8]>>,
    eventfd_armed: Cell<bool>,
    /// A file or device operation is queued and not yet submitted (see
    /// [`OpKind::SUBMIT_PROMPTLY`]).
    prompt_queued: Cell<bool>,
    /// Operations started so far (cancels included): what a caller's
    /// choice of operations costs the ring, for tests and profiles.
    ops_started: Cell<u64>,
    /// Values other crates keep per loop ([`Reactor::local`]); dropped
    /// with the loop, after its tasks and their operations.
    locals: RefCell<HashMap<(TypeId, u64), Rc<dyn Any>>>,
}

/// A thread's event loop. Cloning gives another handle to the same loop;
/// it is not `Send`: it lives and dies on its thread.
#[derive(Clone)]
pub struct Reactor {
    inner: Rc<Inner>,
}

thread_local! {
    static CURRENT: RefCell<Option<Reactor>> = const { RefCell::new(None) };
}

/// Restores the previous current reactor when dropped.
pub(crate) struct CurrentGuard {
    previous: Option<Reactor>,
}

impl Drop for CurrentGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

/// A handle that wakes a reactor's task from any thread.
pub type RemoteWaker = Waker;

impl Reactor {
    /// A reactor for the calling thread. Single-issuer with deferred task
    /// work where the kernel has it (completions are processed only when
    /// this thread enters the ring, not by interrupting it). Without
    /// io_uring (see [`ReactorOptions::backend`]) the loop makes the same
    /// operations with system calls and waits in poll(2).
    pub fn new(options: &ReactorOptions) -> io::Result<Reactor> {
        let entries = options.ring_entries.clamp(8, 4096);
        let ring = match options.backend {
            IoBackend::Pread => {
                if !FALLBACK_WARNED.swap(true, Ordering::Relaxed) {
                    tracing::info!(
                        "event loop without io_uring ({IO_BACKEND_ENV}=pread): poll(2) and \
                         plain system calls"
                    );
                }
                None
            }
            IoBackend::Uring => Some(Self::ring(entries)?),
            IoBackend::Auto => match Self::ring(entries) {
                Ok(ring) => Some(ring),
                Err(e) => {
                    if !FALLBACK_WARNED.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            error = %e,
                            "io_uring is unavailable; event loop without io_uring: poll(2) \
                             and plain system calls ({IO_BACKEND_ENV}=pread makes this choice \
                             without trying io_uring)"
                        );
                    }
                    None
                }
            },
        };
        Ok(Reactor {
            inner: Rc::new(Inner {
                ring: ring.map(RefCell::new),
                waits: RefCell::new(Waits::default()),
                ops: RefCell::new(OpTable::default()),
                tasks: RefCell::new(Tasks::default()),
                shared: Arc::new(Shared::new()?),
                room_waiters: RefCell::new(VecDeque::new()),
                ops_max: entries as usize,
                eventfd_buf: RefCell::new(Box::new([0u8; 8])),
                eventfd_armed: Cell::new(false),
                prompt_queued: Cell::new(false),
                ops_started: Cell::new(0),
                locals: RefCell::new(HashMap::new()),
            }),
        })
    }

    fn ring(entries: u32) -> io::Result<IoUring> {
        IoUring::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_taskrun_flag()
            .setup_cqsize(entries * 2)
            .build(entries)
            .or_else(|_| IoUring::builder().setup_cqsize(entries * 2).build(entries))
    }

    /// Does this loop use io_uring (or plain system calls)?
    pub fn uses_io_uring(&self) -> bool {
        self.inner.ring.is_some()
    }

    /// The reactor running the current task, if any. `None` outside a
    /// reactor and inside [`crate::block_on`].
    pub fn current() -> Option<Reactor> {
        CURRENT.with(|c| c.borrow().clone())
    }

    fn make_current(&self) -> CurrentGuard {
        let previous = CURRENT.with(|c| c.borrow_mut().replace(self.clone()));
        CurrentGuard { previous }
    }

    /// No reactor is current until the guard drops.
    pub(crate) fn suspend_current() -> CurrentGuard {
        let previous = CURRENT.with(|c| c.borrow_mut().take());
        CurrentGuard { previous }
    }

    /// Start a task on this reactor; it runs when the loop next polls.
    pub fn spawn<F>(&self, future: F) -> JoinHandle<F::Output>
    where
        F: Future + 'static,
    {
        let (task, handle) = with_join(future);
        self.inner
            .tasks
            .borrow_mut()
            .insert(task, &self.inner.shared);
        handle
    }

    /// Start a task nobody waits for (a [`Reactor::spawn`] whose handle is
    /// dropped, without the handle's allocation).
    pub fn spawn_detached<F>(&self, future: F)
    where
        F: Future<Output = ()> + 'static,
    {
        self.inner
            .tasks
            .borrow_mut()
            .insert(tasks::detached(future), &self.inner.shared);
    }

    /// This loop's value of type `T` under `key`, made by `make` on first
    /// use. It lives as long as the loop and is dropped after the loop's
    /// tasks and their operations: a connection of the loop's own, say,
    /// whose socket a task of the loop is still receiving on. Values must
    /// not hold the reactor itself (that would be a cycle that never
    /// drops).
    pub fn local<T: Any>(&self, key: u64, make: impl FnOnce() -> T) -> Rc<T> {
        let id = (TypeId::of::<T>(), key);
        if let Some(value) = self.inner.locals.borrow().get(&id) {
            if let Ok(value) = Rc::clone(value).downcast::<T>() {
                return value;
            }
        }
        let value = Rc::new(make());
        let stored: Rc<dyn Any> = value.clone();
        self.inner.locals.borrow_mut().insert(id, stored);
        value
    }

    /// Tasks not yet finished.
    pub fn live_tasks(&self) -> usize {
        self.inner.tasks.borrow().live()
    }

    /// Ring operations started so far, cancellations included.
    pub fn ops_started(&self) -> u64 {
        self.inner.ops_started.get()
    }

    /// Entries queued in the ring and not yet submitted to the kernel
    /// (always 0 without a ring): for tests and profiles.
    pub fn entries_unsubmitted(&self) -> usize {
        match &self.inner.ring {
            Some(ring) => ring.borrow_mut().submission().len(),
            None => 0,
        }
    }

    /// Operations in flight in the ring.
    pub fn ops_in_flight(&self) -> usize {
        self.inner.ops.borrow().in_flight()
    }

    /// Run `main` and every task it spawns until `main` completes. Tasks
    /// still running then are dropped.
    pub fn run<F>(&self, main: F) -> F::Output
    where
        F: Future + 'static,
        F::Output: 'static,
    {
        let _current = self.make_current();
        let handle = self.spawn(main);
        loop {
            self.poll_ready();
            if let Some(output) = handle.try_take() {
                return output;
            }
            self.turn();
        }
    }

    /// Poll every woken task, a bounded number of times.
    fn poll_ready(&self) {
        let mut ready = Vec::new();
        let mut polled = 0;
        while polled < POLLS_PER_TURN_MAX {
            ready.clear();
            self.inner.shared.take_ready(&mut ready);
            if ready.is_empty() {
                return;
            }
            for (index, &id) in ready.iter().enumerate() {
                let taken = self.inner.tasks.borrow_mut().take(id);
                let Some((mut future, waker)) = taken else {
                    continue;
                };
                let mut cx = std::task::Context::from_waker(&waker);
                polled += 1;
                match future.as_mut().poll(&mut cx) {
                    std::task::Poll::Ready(()) => self.inner.tasks.borrow_mut().remove(id),
                    std::task::Poll::Pending => self.inner.tasks.borrow_mut().put_back(id, future),
                }
                // The ready queue's lock is taken only when an operation
                // waits to be submitted, not once per poll.
                if self.inner.prompt_queued.get()
                    && (index + 1 < ready.len() || self.inner.shared.has_ready())
                {
                    self.submit_prompt_ops();
                }
            }
        }
    }

    /// Submit the queued file and device operations now, before the
    /// loop polls its next task, rather than at the end of the turn.
    ///
    /// Why: a connection that takes 30 read requests from one receive
    /// used to prepare all 30 before the first reached the device, and
    /// the replies came back as one wave; the device then idled while
    /// the loop and the client turned the wave around. Measured by hand
    /// with W4d (4 KiB cached O_DIRECT reads, QD32): 41-46k IOPS with one
    /// submission a turn, 59-63k submitting each task's reads as it
    /// yields (less apart on other days: `docs/design.md`). The cost is
    /// a system call per task that started device
    /// I/O, when another task is waiting to be polled; the last task of
    /// a pass leaves its operations to the turn's own submission.
    fn submit_prompt_ops(&self) {
        if !self.inner.prompt_queued.replace(false) {
            return;
        }
        let Some(ring) = &self.inner.ring else {
            return;
        };
        // A failure here is not lost: the entries stay queued and the
        // turn's submission, which handles its errors, sends them.
        let _ = ring.borrow().submit();
    }

    /// Submit what is queued and reap completions, sleeping in the kernel
    /// for at least one completion if no task is ready.
    fn turn(&self) {
        let Some(ring) = &self.inner.ring else {
            self.turn_without_ring();
            return;
        };
        self.arm_eventfd();
        // This submission sends every queued entry.
        self.inner.prompt_queued.set(false);
        let wait = self.inner.shared.prepare_sleep();
        let submitted = {
            let ring = ring.borrow();
            if wait {
                ring.submit_and_wait(1)
            } else {
                ring.submit()
            }
        };
        self.inner.shared.woke();
        match submitted {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)
                ) => {}
            Err(e) => {
                // The ring itself failed: nothing this loop can do but
                // report it; operations stay pending and the owner's
                // timeouts end the work.
                tracing::error!(error = %e, "io_uring_enter failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        self.reap();
    }

    /// [`Reactor::turn`] without a ring: one ppoll(2) for the eventfd,
    /// every socket an operation waits for and the nearest timer (no
    /// wait if a task is ready), then each operation whose wait is over
    /// is tried again.
    fn turn_without_ring(&self) {
        let block = self.inner.shared.prepare_sleep();
        let over = self
            .inner
            .waits
            .borrow_mut()
            .wait(self.inner.shared.eventfd(), block);
        self.inner.shared.woke();
        let mut wakers = Vec::new();
        for key in over {
            if let Some(w) = self.attempt(key) {
                wakers.push(w);
            }
        }
        for waker in wakers {
            waker.wake();
        }
        self.wake_room_waiters();
    }

    /// Without a ring: try operation `key` now; it completes or waits
    /// again. Returns the waker to wake if it completed.
    fn attempt(&self, key: usize) -> Option<Waker> {
        let attempt = self.inner.ops.borrow_mut().attempt(key);
        match attempt {
            // Orphaned or unknown: nothing waits for it any more.
            None => self.inner.ops.borrow_mut().complete(key, -libc::ECANCELED),
            Some(Attempt::Done(result)) => self.inner.ops.borrow_mut().complete(key, result),
            Some(Attempt::Wait(wait)) => {
                self.inner.waits.borrow_mut().push(key, wait);
                None
            }
        }
    }

    /// Handle every completion in the queue.
    fn reap(&self) {
        let Some(ring) = &self.inner.ring else {
            return;
        };
        let mut wakers = Vec::new();
        {
            let mut ring = ring.borrow_mut();
            let mut ops = self.inner.ops.borrow_mut();
            for cqe in ring.completion() {
                match cqe.user_data() {
                    EVENTFD_USER_DATA => self.inner.eventfd_armed.set(false),
                    CANCEL_USER_DATA => {}
                    key => {
                        if let Some(w) = ops.complete(key as usize, cqe.result()) {
                            wakers.push(w);
                        }
                    }
                }
            }
        }
        for waker in wakers {
            waker.wake();
        }
        self.wake_room_waiters();
    }

    /// Keep a read of the eventfd pending, so a wake-up from another
    /// thread completes it and ends the loop's sleep.
    fn arm_eventfd(&self) {
        if self.inner.eventfd_armed.get() || self.inner.ring.is_none() {
            return;
        }
        let ptr = self.inner.eventfd_buf.borrow_mut().as_mut_ptr();
        let entry = opcode::Read::new(types::Fd(self.inner.shared.eventfd()), ptr, 8)
            .build()
            .user_data(EVENTFD_USER_DATA);
        if self.push_entry(entry) {
            self.inner.eventfd_armed.set(true);
        }
    }

    /// Push one entry, making room by submitting if the queue is full.
    fn push_entry(&self, entry: squeue::Entry) -> bool {
        let Some(ring) = &self.inner.ring else {
            return false;
        };
        let mut ring = ring.borrow_mut();
        // SAFETY: every pointer in `entry` targets memory kept alive until
        // its completion (the op table, or the reactor's eventfd buffer).
        let pushed = unsafe { ring.submission().push(&entry) }.is_ok();
        if pushed {
            return true;
        }
        if let Err(e) = ring.submit() {
            tracing::warn!(error = %e, "io_uring submit to make room failed");
        }
        // SAFETY: as above.
        let pushed = unsafe { ring.submission().push(&entry) }.is_ok();
        pushed
    }

    /// Room for one more operation (one entry is kept for the eventfd read).
    fn room_left(&self) -> bool {
        self.inner.ops.borrow().in_flight() + 1 < self.inner.ops_max
    }

    /// Is there room for one more operation? If not, `waker` is woken
    /// when there is.
    fn has_room(&self, waker: &Waker) -> bool {
        if self.room_left() {
            return true;
        }
        let mut waiters = self.inner.room_waiters.borrow_mut();
        // A task joining many operations asks once per operation in one
        // poll: one entry is enough for it.
        if !waiters.back().is_some_and(|w| w.will_wake(waker)) {
            waiters.push_back(waker.clone());
        }
        false
    }

    /// Room came back: wake *every* waiter, and each looks again (those
    /// that find none wait anew). Waking only as many as there are free
    /// entries lost wake-ups: an entry may be a task that got its room
    /// meanwhile, or one that ended (its waker then polls another task,
    /// or none), so the quota went to wakers that submitted nothing, the
    /// ring ran empty, no completion came to wake the rest, and their
    /// requests never finished (NBD reads of 64 scattered cache blocks,
    /// 64 ring reads each, after a recovery; `many_tasks_joining_...` in
    /// `tests/reactor.rs`).
    fn wake_room_waiters(&self) {
        if !self.room_left() {
            return;
        }
        let waiters = std::mem::take(&mut *self.inner.room_waiters.borrow_mut());
        for w in waiters {
            w.wake();
        }
    }

    /// Ask the kernel to end operation `key` early (its future is gone);
    /// it completes with -ECANCELED, or normally if it was already done.
    fn cancel(&self, key: usize) {
        if self.inner.ring.is_none() {
            // Nothing in the kernel: stop waiting and free the slot.
            self.inner.waits.borrow_mut().remove(key);
            let waker = self.inner.ops.borrow_mut().complete(key, -libc::ECANCELED);
            debug_assert!(waker.is_none(), "an abandoned operation has no waiter");
            return;
        }
        let entry = opcode::AsyncCancel::new(key as u64)
            .build()
            .user_data(CANCEL_USER_DATA);
        self.inner.ops_started.set(self.inner.ops_started.get() + 1);
        if !self.push_entry(entry) {
            tracing::warn!(key, "no room to cancel an abandoned operation");
        }
    }

    fn ops_mut(&self) -> RefMut<'_, OpTable> {
        self.inner.ops.borrow_mut()
    }

    /// Record the operation and queue its entry (without a ring: try it
    /// now; it completes at once or waits for its socket or timer).
    fn submit<K: OpKind>(&self, mut kind: Box<K>) -> usize {
        self.inner.ops_started.set(self.inner.ops_started.get() + 1);
        if self.inner.ring.is_none() {
            let key = self.inner.ops.borrow_mut().start(kind);
            // Nobody polled it yet: there is no waker to wake.
            let waker = self.attempt(key);
            debug_assert!(waker.is_none(), "a new operation has no waiter");
            return key;
        }
        let entry = kind.entry();
        let key = self.inner.ops.borrow_mut().start(kind);
        let pushed = self.push_entry(entry.user_data(key as u64));
        if pushed && K::SUBMIT_PROMPTLY {
            self.inner.prompt_queued.set(true);
        }
        if !pushed {
            // Unreachable with room checked (the queue holds `ops_max`),
            // but never lose an operation: complete it as failed.
            let waker = self.inner.ops.borrow_mut().complete(key, -libc::EAGAIN);
            if let Some(w) = waker {
                w.wake();
            }
        }
        key
    }

    // ---------------------------------------------------------- operations

    /// Read into `buf` from `offset` of `fd`; resolves to the bytes read
    /// (a short read is the caller's to handle) and the buffer.
    pub fn read_at<B: StableBufMut>(
        &self,
        fd: i32,
        offset: u64,
        buf: B,
    ) -> impl Future<Output = (io::Result<usize>, B)> {
        Op::new(self.clone(), ReadAt { fd, offset, buf })
    }

    /// Write `buf` at `offset` of `fd`.
    pub fn write_at<B: StableBuf>(
        &self,
        fd: i32,
        offset: u64,
        buf: B,
    ) -> impl Future<Output = (io::Result<usize>, B)> {
        Op::new(self.clone(), WriteAt { fd, offset, buf })
    }

    /// Write `bufs` back to back from `offset` of `fd`.
    pub fn writev_at<B: StableBuf>(
        &self,
        fd: i32,
        offset: u64,
        bufs: Vec<B>,
    ) -> impl Future<Output = (io::Result<usize>, Vec<B>)> {
        Op::new(
            self.clone(),
            WritevAt {
                fd,
                offset,
                bufs,
                iovecs: Vec::new(),
            },
        )
    }

    /// Receive into `buf` from socket `fd`: the bytes received (0 at the
    /// end of the stream) and the buffer. The wait for data happens in the
    /// kernel, with no readiness poll and no extra system call.
    pub fn recv<B: StableBufMut>(
        &self,
        fd: i32,
        buf: B,
    ) -> impl Future<Output = (io::Result<usize>, B)> {
        Op::new(self.clone(), Recv { fd, buf })
    }

    /// Send the buffers `owner` holds on socket `fd`, in order; resolves to
    /// the bytes sent (possibly fewer than all) and the owner.
    pub fn send_owned<B: StableBufs>(
        &self,
        fd: i32,
        owner: B,
    ) -> impl Future<Output = (io::Result<usize>, B)> {
        Op::new(
            self.clone(),
            SendOwned {
                fd,
                owner,
                iovecs: Vec::new(),
                // SAFETY: an all-zero msghdr is a valid empty header.
                header: Box::new(unsafe { std::mem::zeroed() }),
            },
        )
    }

    /// fsync (or fdatasync) `fd`.
    pub fn fsync(&self, fd: i32, datasync: bool) -> impl Future<Output = io::Result<()>> {
        Op::new(self.clone(), Fsync { fd, datasync })
    }

    /// Wait until `fd` is ready for `events` (`libc::POLLIN`...).
    pub fn poll(&self, fd: i32, events: u32) -> impl Future<Output = io::Result<u32>> {
        Op::new(self.clone(), PollFd { fd, events })
    }

    /// Wait `duration`.
    pub fn sleep(&self, duration: Duration) -> impl Future<Output = ()> {
        Op::new(
            self.clone(),
            Sleep {
                timespec: types::Timespec::from(duration),
                duration,
                deadline: None,
            },
        )
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Drop every task first: their operations become orphans.
        drop(self.tasks.get_mut().clear());
        let keys = self.ops.get_mut().in_flight_keys();
        let Some(ring) = self.ring.as_mut() else {
            // Without a ring nothing is in the kernel: the buffers go with
            // the op table.
            return;
        };
        if keys.is_empty() {
            return;
        }
        // Cancel what is still in flight (socket polls never end on their
        // own) and wait for the completions: only then may the buffers the
        // kernel writes into be freed.
        let ring = ring.get_mut();
        for key in &keys {
            let entry = opcode::AsyncCancel::new(*key as u64)
                .build()
                .user_data(CANCEL_USER_DATA);
            // SAFETY: a cancel entry references no memory.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                let _ = ring.submit();
                // SAFETY: as above.
                let _ = unsafe { ring.submission().push(&entry) };
            }
        }
        let deadline = std::time::Instant::now() + Duration::from_millis(SHUTDOWN_WAIT_MS);
        let ops = self.ops.get_mut();
        while ops.in_flight() > 0 && std::time::Instant::now() < deadline {
            let _ = ring.submit_and_wait(1);
            for cqe in ring.completion() {
                let key = cqe.user_data();
                if key < EVENTFD_USER_DATA {
                    ops.complete(key as usize, cqe.result());
                }
            }
        }
        if ops.in_flight() > 0 {
            tracing::error!(
                ops = ops.in_flight(),
                "operations still in flight at reactor shutdown; their buffers are leaked"
            );
            std::mem::forget(std::mem::take(ops));
        }
    }
}
