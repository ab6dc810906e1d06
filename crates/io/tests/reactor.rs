//! The reactor against real files, sockets and threads.

use std::cell::Cell;
use std::future::Future;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::rc::Rc;
use std::time::{Duration, Instant};

use cairn_io::{block_on, oneshot, LocalNotify, Reactor, ReactorOptions};

fn reactor(entries: u32) -> Reactor {
    Reactor::new(&ReactorOptions {
        ring_entries: entries,
    })
    .expect("io_uring available")
}

#[test]
fn spawned_tasks_run_and_join() {
    let r = reactor(32);
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

#[test]
fn file_reads_and_writes_through_the_ring() {
    let file = tempfile::tempfile().unwrap();
    let fd = file.as_raw_fd();
    let r = reactor(16);
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

#[test]
fn more_operations_than_ring_entries_all_complete() {
    let file = tempfile::tempfile().unwrap();
    file.set_len(1 << 20).unwrap();
    let fd = file.as_raw_fd();
    let r = reactor(8);
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

#[test]
fn another_thread_wakes_a_sleeping_reactor() {
    let r = reactor(16);
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

#[test]
fn socket_readiness_and_sleep() {
    let (a, mut b) = UnixStream::pair().unwrap();
    let fd = a.as_raw_fd();
    let r = reactor(16);
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

#[test]
fn dropped_operations_and_a_dropped_reactor_free_nothing_in_use() {
    let (a, _b) = UnixStream::pair().unwrap();
    let fd = a.as_raw_fd();
    let file = tempfile::tempfile().unwrap();
    file.set_len(1 << 16).unwrap();
    let ffd = file.as_raw_fd();
    {
        let r = reactor(16);
        let r2 = r.clone();
        r.run(async move {
            // A poll that never completes, left running in a task.
            let r3 = r2.clone();
            drop(r2.spawn(async move {
                let _ = r3.poll(fd, libc::POLLIN as u32).await;
            }));
            // An operation whose future is dropped once submitted.
            let mut read = Box::pin(r2.read_at(ffd, 0, vec![0u8; 4096]));
            let waker = std::task::Waker::noop();
            let mut cx = std::task::Context::from_waker(waker);
            assert!(read.as_mut().poll(&mut cx).is_pending());
            drop(read);
            r2.sleep(Duration::from_millis(5)).await;
        });
        // Dropping the reactor cancels the pending poll and waits for it.
    }
}

#[test]
fn block_on_inside_a_task_has_no_current_reactor() {
    let r = reactor(16);
    let seen = r.run(async move {
        assert!(Reactor::current().is_some());
        let inside = block_on(async { Reactor::current().is_some() });
        (inside, Reactor::current().is_some())
    });
    assert_eq!(seen, (false, true));
    assert!(Reactor::current().is_none());
}

#[test]
fn local_notify_wakes_every_waiter() {
    let r = reactor(16);
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

#[test]
fn direct_io_with_aligned_buffers() {
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
    let r = reactor(16);
    let r2 = r.clone();
    let ok = r.run(async move {
        let (n, buf) = r2.read_at(fd, 8192, buf).await;
        // SAFETY: the buffer holds 4096 initialised bytes.
        let bytes = unsafe { std::slice::from_raw_parts(buf.0, 4096) };
        n.unwrap() == 4096 && bytes.iter().all(|&b| b == 9)
    });
    assert!(ok);
}

#[test]
fn an_abandoned_long_timeout_gives_its_slot_back() {
    // A ring of 8: were the dropped 60 s sleeps left in flight, the ring
    // would be full after a few and every later operation would wait.
    let r = reactor(8);
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

#[test]
fn a_deadline_lets_quick_operations_through_with_one_timer() {
    let r = reactor(8);
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

#[test]
fn a_deadline_stops_a_slow_operation_at_its_limit_not_before() {
    let r = reactor(16);
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
#[test]
fn many_tasks_joining_many_operations_on_a_full_ring_all_finish() {
    let file = tempfile::tempfile().unwrap();
    file.set_len(1 << 20).unwrap();
    let fd = file.as_raw_fd();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = reactor(8);
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
