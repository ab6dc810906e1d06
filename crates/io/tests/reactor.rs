//! The reactor against real files, sockets and threads.

use std::cell::Cell;
use std::future::Future;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::rc::Rc;
use std::time::{Duration, Instant};

use cairn_io::{block_on, oneshot, IoBackend, LocalNotify, Reactor, ReactorOptions};

/// A reactor on `backend`: every test here runs twice, with io_uring and
/// with plain system calls (the fallback where io_uring is forbidden), by
/// `on_both_backends!` at the end of the file.
fn reactor(backend: IoBackend, entries: u32) -> Reactor {
    let r = Reactor::new(&ReactorOptions {
        ring_entries: entries,
        backend,
    })
    .expect("a reactor on this backend");
    assert_eq!(r.uses_io_uring(), backend == IoBackend::Uring);
    r
}

fn spawned_tasks_run_and_join(backend: IoBackend) {
    let r = reactor(backend, 32);
    let r2 = r.clone();
    let total = r.run(async move {
        let handles: Vec<_> = (0..100u64)
            .map(|i| r2.spawn(async move { i * 2 }))
            .collect();
        let mut sum = 0;
        for h in handles {
            sum += h.await;
        }
        sum
    });
    assert_eq!(total, (0..100u64).map(|i| i * 2).sum::<u64>());
}

fn file_reads_and_writes_through_the_ring(backend: IoBackend) {
    let file = tempfile::tempfile().unwrap();
    let fd = file.as_raw_fd();
    let r = reactor(backend, 16);
    let r2 = r.clone();
    r.run(async move {
        let (n, _) = r2.write_at(fd, 4096, vec![7u8; 4096]).await;
        assert_eq!(n.unwrap(), 4096);
        let (n, _) = r2
            .writev_at(fd, 0, vec![vec![1u8; 1000], vec![2u8; 3096]])
            .await;
        assert_eq!(n.unwrap(), 4096);
        r2.fsync(fd, true).await.unwrap();
        let (n, buf) = r2.read_at(fd, 0, vec![0u8; 8192]).await;
        assert_eq!(n.unwrap(), 8192);
        assert!(buf[..1000].iter().all(|&b| b == 1));
        assert!(buf[1000..4096].iter().all(|&b| b == 2));
        assert!(buf[4096..].iter().all(|&b| b == 7));
        // A read past the end is short, not an error.
        let (n, _) = r2.read_at(fd, 8192 - 100, vec![0u8; 4096]).await;
        assert_eq!(n.unwrap(), 100);
        // A bad descriptor is an error, not a panic.
        let (n, _) = r2.read_at(-1, 0, vec![0u8; 16]).await;
        assert!(n.is_err());
    });
}

fn more_operations_than_ring_entries_all_complete(backend: IoBackend) {
    let file = tempfile::tempfile().unwrap();
    file.set_len(1 << 20).unwrap();
    let fd = file.as_raw_fd();
    let r = reactor(backend, 8);
    let r2 = r.clone();
    let done = r.run(async move {
        let handles: Vec<_> = (0..500u64)
            .map(|i| {
                let r3 = r2.clone();
                r2.spawn(async move {
                    let (n, _) = r3.read_at(fd, (i % 256) * 4096, vec![0u8; 4096]).await;
                    n.unwrap()
                })
            })
            .collect();
        let mut done = 0;
        for h in handles {
            assert_eq!(h.await, 4096);
            done += 1;
        }
        done
    });
    assert_eq!(done, 500);
}

fn another_thread_wakes_a_sleeping_reactor(backend: IoBackend) {
    let r = reactor(backend, 16);
    let (tx, rx) = oneshot::channel::<u64>();
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        tx.send(42);
    });
    let started = Instant::now();
    let got = r.run(async move { rx.await.unwrap() });
    assert_eq!(got, 42);
    assert!(started.elapsed() >= Duration::from_millis(40));
    sender.join().unwrap();
    // A dropped sender ends the wait too.
    let (tx, rx) = oneshot::channel::<u64>();
    std::thread::spawn(move || drop(tx));
    assert!(r.run(rx).is_err());
}

fn socket_readiness_and_sleep(backend: IoBackend) {
    let (a, mut b) = UnixStream::pair().unwrap();
    let fd = a.as_raw_fd();
    let r = reactor(backend, 16);
    let r2 = r.clone();
    let writer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        b.write_all(b"hello").unwrap();
        b
    });
    let events = r.run(async move {
        r2.sleep(Duration::from_millis(5)).await;
        r2.poll(fd, libc::POLLIN as u32).await.unwrap()
    });
    assert!(events & libc::POLLIN as u32 != 0);
    drop(writer.join().unwrap());
    drop(a);
}

fn dropped_operations_and_a_dropped_reactor_free_nothing_in_use(backend: IoBackend) {
    let (a, _b) = UnixStream::pair().unwrap();
    let fd = a.as_raw_fd();
    let file = tempfile::tempfile().unwrap();
    file.set_len(1 << 16).unwrap();
    let ffd = file.as_raw_fd();
    {
        let r = reactor(backend, 16);
        let r2 = r.clone();
        r.run(async move {
            // A poll that never completes, left running in a task.
            let r3 = r2.clone();
            drop(r2.spawn(async move {
                let _ = r3.poll(fd, libc::POLLIN as u32).await;
            }));
            // An operation whose future is dropped once submitted.
            let waker = std::task::Waker::from(std::sync::Arc::new(NoWake));
            let mut cx = std::task::Context::from_waker(&waker);
            let mut read = Box::pin(r2.read_at(ffd, 0, vec![0u8; 4096]));
            // Without a ring a file read is made at once, in the poll.
            let pending = read.as_mut().poll(&mut cx).is_pending();
            assert_eq!(pending, backend == IoBackend::Uring);
            drop(read);
            // A receive on a silent socket pends on either backend.
            let mut recv = Box::pin(r2.recv(fd, vec![0u8; 4096]));
            assert!(recv.as_mut().poll(&mut cx).is_pending());
            drop(recv);
            r2.sleep(Duration::from_millis(5)).await;
        });
        // Dropping the reactor cancels the pending poll and waits for it.
    }
}

fn block_on_inside_a_task_has_no_current_reactor(backend: IoBackend) {
    let r = reactor(backend, 16);
    let seen = r.run(async move {
        assert!(Reactor::current().is_some());
        let inside = block_on(async { Reactor::current().is_some() });
        (inside, Reactor::current().is_some())
    });
    assert_eq!(seen, (false, true));
    assert!(Reactor::current().is_none());
}

fn local_notify_wakes_every_waiter(backend: IoBackend) {
    let r = reactor(backend, 16);
    let r2 = r.clone();
    let woken = r.run(async move {
        let notify = Rc::new(LocalNotify::default());
        let count = Rc::new(Cell::new(0));
        let handles: Vec<_> = (0..5)
            .map(|_| {
                let (n, c) = (notify.clone(), count.clone());
                r2.spawn(async move {
                    n.notified().await;
                    c.set(c.get() + 1);
                })
            })
            .collect();
        r2.sleep(Duration::from_millis(1)).await;
        notify.notify_all();
        for h in handles {
            h.await;
        }
        count.get()
    });
    assert_eq!(woken, 5);
}

fn direct_io_with_aligned_buffers(backend: IoBackend) {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let path = dir.path().join("direct");
    std::fs::write(&path, vec![9u8; 1 << 16]).unwrap();
    let Ok(file) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
    else {
        eprintln!("O_DIRECT not supported here; skipping");
        return;
    };
    let fd = file.as_raw_fd();
    // A page-aligned heap buffer: a Vec of u64-aligned pages is not enough,
    // so over-allocate and read into an aligned window of a boxed slice.
    let layout = std::alloc::Layout::from_size_align(4096, 4096).unwrap();
    struct Aligned(*mut u8, std::alloc::Layout);
    // SAFETY: the allocation is owned and freed once, in Drop.
    unsafe impl cairn_io::StableBuf for Aligned {
        fn stable_ptr(&self) -> *const u8 {
            self.0
        }
        fn stable_len(&self) -> usize {
            self.1.size()
        }
    }
    // SAFETY: as above, valid for writes of its size.
    unsafe impl cairn_io::StableBufMut for Aligned {
        fn stable_mut_ptr(&mut self) -> *mut u8 {
            self.0
        }
    }
    impl Drop for Aligned {
        fn drop(&mut self) {
            // SAFETY: allocated with this layout below.
            unsafe { std::alloc::dealloc(self.0, self.1) }
        }
    }
    // SAFETY: a non-zero-sized layout.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    let buf = Aligned(ptr, layout);
    let r = reactor(backend, 16);
    let r2 = r.clone();
    let ok = r.run(async move {
        let (n, buf) = r2.read_at(fd, 8192, buf).await;
        // SAFETY: the buffer holds 4096 initialised bytes.
        let bytes = unsafe { std::slice::from_raw_parts(buf.0, 4096) };
        n.unwrap() == 4096 && bytes.iter().all(|&b| b == 9)
    });
    assert!(ok);
}

fn an_abandoned_long_timeout_gives_its_slot_back(backend: IoBackend) {
    // A ring of 8: were the dropped 60 s sleeps left in flight, the ring
    // would be full after a few and every later operation would wait.
    let r = reactor(backend, 8);
    let r2 = r.clone();
    let done = r.run(async move {
        for _ in 0..100 {
            let long = r2.sleep(Duration::from_secs(60));
            let short = r2.sleep(Duration::from_millis(1));
            match cairn_io::first_of(long, short).await {
                cairn_io::Either::Left(()) => panic!("the long sleep cannot win"),
                cairn_io::Either::Right(()) => {}
            }
        }
        // Cancellations complete at the next turns.
        r2.sleep(Duration::from_millis(5)).await;
        r2.ops_in_flight()
    });
    assert!(done <= 2, "{done} operations still in flight");
}

fn a_deadline_lets_quick_operations_through_with_one_timer(backend: IoBackend) {
    let r = reactor(backend, 8);
    let r2 = r.clone();
    let (finished, started, in_flight) = r.run(async move {
        let mut deadline = cairn_io::Deadline::new(r2.clone(), Duration::from_secs(60));
        let mut finished = 0;
        let before = r2.ops_started();
        for _ in 0..200 {
            if deadline.run(r2.sleep(Duration::from_micros(50))).await == Some(()) {
                finished += 1;
            }
        }
        // The 200 operations and the one 60 s timer: a timer per operation
        // (armed, then cancelled) would have started 600.
        (finished, r2.ops_started() - before, r2.ops_in_flight())
    });
    assert_eq!(finished, 200);
    assert_eq!(started, 201, "ring operations for 200 guarded ones");
    assert!(in_flight <= 1, "{in_flight} operations in flight");
}

fn a_deadline_stops_a_slow_operation_at_its_limit_not_before(backend: IoBackend) {
    let r = reactor(backend, 16);
    let r2 = r.clone();
    let limit = Duration::from_millis(40);
    let outcomes = r.run(async move {
        let mut deadline = cairn_io::Deadline::new(r2.clone(), limit);
        let mut outcomes = Vec::new();
        // Quick, then idle past the limit (the timer fires unused), then
        // slow twice: each slow one gets its full limit from its own start.
        outcomes.push((deadline.run(async {}).await.is_some(), Duration::ZERO));
        r2.sleep(limit * 2).await;
        for _ in 0..2 {
            let started = Instant::now();
            let got = deadline.run(r2.sleep(Duration::from_secs(5))).await;
            outcomes.push((got.is_some(), started.elapsed()));
        }
        outcomes
    });
    assert!(outcomes[0].0, "the quick operation finished");
    for (finished, took) in &outcomes[1..] {
        assert!(!finished, "a 5 s operation cannot beat a 40 ms limit");
        assert!(*took >= limit, "given up after {took:?}, before the limit");
        assert!(
            *took < Duration::from_secs(2),
            "given up only after {took:?}"
        );
    }
}

/// Tasks that each wait for many operations at once on a small ring (a
/// 256 KiB read of 64 scattered cache blocks is 64 reads joined): every
/// one of them finishes. The ring had room again but a task waiting for
/// it was never woken when the wake-ups went to waiters that no longer
/// needed room (stale duplicates of tasks already done); seen as NBD reads
/// that never got a reply after a cache was recovered.
fn many_tasks_joining_many_operations_on_a_full_ring_all_finish(backend: IoBackend) {
    let file = tempfile::tempfile().unwrap();
    file.set_len(1 << 20).unwrap();
    let fd = file.as_raw_fd();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = reactor(backend, 8);
        let r2 = r.clone();
        let finished = r.run(async move {
            let mut finished = 0u64;
            for round in 0..40u64 {
                let tasks = 2 + round % 5;
                let handles: Vec<_> = (0..tasks)
                    .map(|t| {
                        let r3 = r2.clone();
                        r2.spawn(async move {
                            let ops = 1 + (t * 37 + round * 11) % 64;
                            let reads: Vec<_> = (0..ops)
                                .map(|k| {
                                    r3.read_at(fd, ((k * 7 + t) % 256) * 4096, vec![0u8; 4096])
                                })
                                .collect();
                            for (n, _) in cairn_io::join_all(reads).await {
                                assert_eq!(n.unwrap(), 4096);
                            }
                        })
                    })
                    .collect();
                for h in handles {
                    h.await;
                    finished += 1;
                }
            }
            finished
        });
        let _ = done_tx.send(finished);
    });
    let finished = done_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("tasks waiting for room in the ring were never woken");
    assert_eq!(finished, (0..40u64).map(|round| 2 + round % 5).sum::<u64>());
}

/// Sockets without a ring: a send larger than the socket buffer waits for
/// room (POLLOUT) and goes out in parts, a receive waits for data (POLLIN),
/// and a peer that hangs up ends the receive with 0 bytes, not a hang.
fn sockets_wait_for_room_and_data_and_see_a_hang_up(backend: IoBackend) {
    let (a, b) = UnixStream::pair().unwrap();
    let (fa, fb) = (a.as_raw_fd(), b.as_raw_fd());
    const TOTAL: usize = 8 << 20;
    let r = reactor(backend, 16);
    let r2 = r.clone();
    let received = r.run(async move {
        let r3 = r2.clone();
        let sender = r2.spawn(async move {
            let data: Vec<u8> = (0..TOTAL).map(|i| (i % 251) as u8).collect();
            let mut sent = 0;
            while sent < TOTAL {
                let (n, _) = r3.send_owned(fa, Chunk(data[sent..].to_vec())).await;
                let n = n.expect("send");
                assert!(n > 0, "a blocking-style send took nothing");
                sent += n;
            }
            drop(a);
        });
        let mut received = Vec::with_capacity(TOTAL);
        loop {
            let (n, buf) = r2.recv(fb, vec![0u8; 64 << 10]).await;
            let n = n.expect("recv");
            if n == 0 {
                break;
            }
            received.extend_from_slice(&buf[..n]);
            assert!(received.len() <= TOTAL, "more bytes than were sent");
        }
        sender.await;
        received
    });
    assert_eq!(received.len(), TOTAL);
    assert!(received
        .iter()
        .enumerate()
        .all(|(i, &b)| b == (i % 251) as u8));
    drop(b);
}

/// A waker that does nothing (`Waker::noop` needs Rust 1.85).
struct NoWake;

impl std::task::Wake for NoWake {
    fn wake(self: std::sync::Arc<Self>) {}
}

/// One owned buffer for `send_owned`.
struct Chunk(Vec<u8>);

// SAFETY: the Vec is owned by the value and not changed while it lives.
unsafe impl cairn_io::StableBufs for Chunk {
    fn iovecs(&self) -> Vec<libc::iovec> {
        vec![libc::iovec {
            iov_base: self.0.as_ptr() as *mut libc::c_void,
            iov_len: self.0.len(),
        }]
    }
}

/// Drops into a shared log, to see when a loop's value goes.
struct Tracked {
    name: &'static str,
    log: Rc<std::cell::RefCell<Vec<&'static str>>>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.log.borrow_mut().push(self.name);
    }
}

fn loop_values_are_made_once_per_key_and_outlive_the_tasks(backend: IoBackend) {
    let log = Rc::new(std::cell::RefCell::new(Vec::new()));
    let made = Rc::new(Cell::new(0u32));
    {
        let r = reactor(backend, 16);
        let first = r.local(7, || {
            made.set(made.get() + 1);
            Tracked {
                name: "value 7",
                log: Rc::clone(&log),
            }
        });
        let again = r.local(7, || {
            made.set(made.get() + 1);
            Tracked {
                name: "never made",
                log: Rc::clone(&log),
            }
        });
        assert!(Rc::ptr_eq(&first, &again), "one value per key");
        let other = r.local(8, || Tracked {
            name: "value 8",
            log: Rc::clone(&log),
        });
        assert!(!Rc::ptr_eq(&first, &other), "another key, another value");
        // Another type under the same key is another value.
        let number = r.local(7, || 42u64);
        assert_eq!(*number, 42);
        assert_eq!(made.get(), 1);
        drop((first, again, other));
        assert!(log.borrow().is_empty(), "the loop keeps its values");
        // A task still waiting when the loop goes is dropped before them.
        let r2 = r.clone();
        let task_log = Rc::clone(&log);
        r.run(async move {
            let guard = Tracked {
                name: "task",
                log: task_log,
            };
            r2.spawn_detached(async move {
                let _guard = guard;
                std::future::pending::<()>().await;
            });
        });
        assert!(log.borrow().is_empty());
    }
    let log = log.borrow();
    assert_eq!(log.first(), Some(&"task"), "tasks go first: {log:?}");
    let mut values: Vec<_> = log[1..].to_vec();
    values.sort();
    assert_eq!(values, vec!["value 7", "value 8"]);
}

/// A file read a task starts reaches the kernel before the loop polls its
/// next task (the device works on it meanwhile); a socket receive waits for
/// the turn's one submission.
#[test]
fn file_operations_are_submitted_when_their_task_yields() {
    let file = tempfile::tempfile().unwrap();
    file.set_len(4096).unwrap();
    let fd = file.as_raw_fd();
    let (a, mut b) = UnixStream::pair().unwrap();
    let socket = a.as_raw_fd();
    let r = reactor(IoBackend::Uring, 16);
    let r2 = r.clone();
    let (after_read, after_recv) = r.run(async move {
        // Spawned in one pass: the reader is polled first, then the
        // observer, with no turn of the loop between them.
        let reader = {
            let r = r2.clone();
            r2.spawn(async move { r.read_at(fd, 0, vec![0u8; 4096]).await.0 })
        };
        let observer = {
            let r = r2.clone();
            r2.spawn(async move { r.entries_unsubmitted() })
        };
        let after_read = observer.await;
        assert_eq!(reader.await.unwrap(), 4096);
        let receiver = {
            let r = r2.clone();
            r2.spawn(async move { r.recv(socket, vec![0u8; 16]).await.0 })
        };
        let observer = {
            let r = r2.clone();
            r2.spawn(async move { r.entries_unsubmitted() })
        };
        let after_recv = observer.await;
        b.write_all(b"hello").unwrap();
        assert_eq!(receiver.await.unwrap(), 5);
        (after_read, after_recv)
    });
    assert_eq!(after_read, 0, "the read waited for the end of the turn");
    assert_eq!(after_recv, 1, "a receive is submitted with the turn");
}

macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod with_io_uring {
            $(#[test]
            fn $name() {
                super::$name(cairn_io::IoBackend::Uring)
            })*
        }
        mod without_io_uring {
            $(#[test]
            fn $name() {
                super::$name(cairn_io::IoBackend::Pread)
            })*
        }
    };
}

on_both_backends!(
    spawned_tasks_run_and_join,
    file_reads_and_writes_through_the_ring,
    more_operations_than_ring_entries_all_complete,
    another_thread_wakes_a_sleeping_reactor,
    socket_readiness_and_sleep,
    dropped_operations_and_a_dropped_reactor_free_nothing_in_use,
    block_on_inside_a_task_has_no_current_reactor,
    local_notify_wakes_every_waiter,
    direct_io_with_aligned_buffers,
    an_abandoned_long_timeout_gives_its_slot_back,
    a_deadline_lets_quick_operations_through_with_one_timer,
    a_deadline_stops_a_slow_operation_at_its_limit_not_before,
    many_tasks_joining_many_operations_on_a_full_ring_all_finish,
    sockets_wait_for_room_and_data_and_see_a_hang_up,
    loop_values_are_made_once_per_key_and_outlive_the_tasks,
);
