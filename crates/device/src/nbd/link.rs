//! The device's connection to its server, re-established with exponential
//! backoff when it is lost.
//!
//! A reconnect attempt (connect plus handshake, up to `connect_timeout_ms`)
//! never runs under the link's lock, and never on a reactor's thread: a
//! task that finds the link down starts the attempt on a thread of its own
//! and waits for it as a task, so the event loop it runs on goes on serving
//! its other requests (cache hits, writes) meanwhile. Until 2026-12-04 the
//! attempt and the backoff sleeps ran in the calling thread with the lock
//! held: a read miss during an origin outage stopped its connection's loop
//! for up to `reconnect_wait_ms` (a cached read behind it on the same
//! connection waited 3.1 s), and a connect to a silent host held every
//! other caller on the lock for up to `connect_timeout_ms`. One attempt
//! runs at a time; everyone else waits for its outcome.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use cairn_io::{first_of, oneshot, Reactor};

use super::conn::Conn;
use super::options::NbdOptions;
use super::stats::Counters;
use super::uri::NbdUri;

struct LinkState {
    conn: Option<Arc<Conn>>,
    /// When the connection was lost; `None` while connected.
    down_since: Option<Instant>,
    next_attempt: Instant,
    backoff_ms: u64,
    last_error: String,
    /// A reconnect attempt is running, outside the lock.
    attempting: bool,
    /// Bumped when an attempt ends, so a blocked caller knows to look again.
    attempts_ended: u64,
    /// Tasks waiting for the running attempt to end (at most one entry per
    /// waiting request; emptied when it ends).
    waiting_tasks: Vec<oneshot::Sender<()>>,
    /// The device is going away: an attempt that succeeds now closes its
    /// connection instead of keeping it.
    closed: bool,
}

/// What is fixed for the link's lifetime, shared with attempt threads.
struct Shared {
    /// The device name, for logs.
    name: String,
    uri: NbdUri,
    options: NbdOptions,
    /// The export size seen at open; a reconnect to another size fails.
    size_bytes: u64,
    counters: Arc<Counters>,
    state: Mutex<LinkState>,
    /// Signalled when an attempt ends, for blocked callers.
    attempt_ended: Condvar,
}

/// A connection that is there when asked for, within the reconnect policy
/// of [`NbdOptions`] (see the module documentation of `nbd`).
pub(super) struct Link {
    shared: Arc<Shared>,
}

/// What a caller does next, decided under the lock.
enum Step {
    Ready(Arc<Conn>),
    Fail(io::Error),
    /// This caller claimed the next attempt: it runs it (or has it run).
    Attempt,
    /// Another caller's attempt is running: wait for it to end, at most
    /// until the instant given (then look again).
    WaitAttempt {
        ended: u64,
        until: Instant,
    },
    /// No attempt is due before this instant.
    Sleep(Instant),
}

impl Link {
    /// A link that starts on `conn`, the connection made at open.
    pub fn new(
        name: String,
        uri: NbdUri,
        options: NbdOptions,
        counters: Arc<Counters>,
        conn: Arc<Conn>,
    ) -> Link {
        Link {
            shared: Arc::new(Shared {
                name,
                uri,
                size_bytes: conn.info.size_bytes,
                counters,
                state: Mutex::new(LinkState {
                    conn: Some(conn),
                    down_since: None,
                    next_attempt: Instant::now(),
                    backoff_ms: options.backoff_initial_ms.max(1),
                    last_error: String::new(),
                    attempting: false,
                    attempts_ended: 0,
                    waiting_tasks: Vec::new(),
                    closed: false,
                }),
                attempt_ended: Condvar::new(),
                options,
            }),
        }
    }

    pub fn uri(&self) -> &NbdUri {
        &self.shared.uri
    }

    /// A live connection, reconnecting with backoff if needed; blocks the
    /// calling thread meanwhile (callers outside a reactor).
    pub fn connection(&self) -> io::Result<Arc<Conn>> {
        let shared = &self.shared;
        let start = Instant::now();
        // Each turn either returns, runs an attempt or waits until an
        // instant that moves forward; the reconnect window ends them.
        loop {
            match shared.next_step(start, false) {
                Step::Ready(conn) => return Ok(conn),
                Step::Fail(err) => return Err(err),
                Step::Attempt => shared.run_attempt(),
                Step::WaitAttempt { ended, until } => {
                    let mut link = shared.lock();
                    while link.attempts_ended == ended {
                        let left = until.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            break;
                        }
                        link = shared
                            .attempt_ended
                            .wait_timeout(link, left)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                    }
                }
                Step::Sleep(until) => {
                    std::thread::sleep(until.saturating_duration_since(Instant::now()))
                }
            }
        }
    }

    /// [`Link::connection`] for a task on `reactor`: the attempt runs on a
    /// thread of its own and the waits are the task's, so the reactor's
    /// thread goes on with its other tasks.
    pub async fn connection_async(&self, reactor: &Reactor) -> io::Result<Arc<Conn>> {
        let shared = &self.shared;
        let start = Instant::now();
        let mut started_attempt = false;
        loop {
            match shared.next_step(start, started_attempt) {
                Step::Ready(conn) => return Ok(conn),
                Step::Fail(err) => return Err(err),
                Step::Attempt => {
                    started_attempt = true;
                    let attempt_shared = Arc::clone(shared);
                    let spawned = std::thread::Builder::new()
                        .name("nbd-reconnect".into())
                        .spawn(move || attempt_shared.run_attempt());
                    if let Err(err) = spawned {
                        // No thread to be had: run it here rather than
                        // leave the link marked as connecting for good.
                        tracing::warn!(device = %shared.name, "cannot start a reconnect thread ({err}); reconnecting on the event loop");
                        shared.run_attempt();
                    }
                }
                Step::WaitAttempt { ended, until } => {
                    let (sender, receiver) = oneshot::channel();
                    {
                        let mut link = shared.lock();
                        if link.attempts_ended != ended {
                            continue;
                        }
                        link.waiting_tasks.push(sender);
                    }
                    let left = until.saturating_duration_since(Instant::now());
                    let _ = first_of(receiver, reactor.sleep(left)).await;
                }
                Step::Sleep(until) => {
                    reactor
                        .sleep(until.saturating_duration_since(Instant::now()))
                        .await
                }
            }
        }
    }

    /// Close the connection, if any (the device is going away).
    pub fn close(&self) {
        let conn = {
            let mut link = self.shared.lock();
            link.closed = true;
            link.conn.take()
        };
        if let Some(conn) = conn {
            conn.close();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, LinkState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Decide the next step of a caller that started asking at `start`;
    /// `started_attempt` if it started an attempt already (it then waits
    /// for that attempt's outcome even past the reconnect window).
    fn next_step(&self, start: Instant, started_attempt: bool) -> Step {
        let mut link = self.lock();
        if let Some(conn) = link.conn.clone() {
            if conn.is_alive() {
                return Step::Ready(conn);
            }
            self.drop_dead(&mut link, &conn);
        }
        if link.closed {
            return Step::Fail(io::Error::new(
                io::ErrorKind::NotConnected,
                "the NBD device is closed",
            ));
        }
        let now = Instant::now();
        let down_since = *link.down_since.get_or_insert(now);
        let give_up_at = (down_since + Duration::from_millis(self.options.reconnect_wait_ms))
            .min(start + Duration::from_millis(self.options.request_timeout_ms));
        if link.attempting {
            // An attempt is bounded by the connect timeout; its starter
            // waits for it, the others only within the window.
            let until = if started_attempt {
                now + Duration::from_millis(self.options.connect_timeout_ms.max(1))
            } else {
                give_up_at
            };
            if now >= until {
                return Step::Fail(self.unreachable(&link));
            }
            return Step::WaitAttempt {
                ended: link.attempts_ended,
                until,
            };
        }
        if started_attempt && link.next_attempt > now {
            // The attempt this caller started has ended and failed.
            if link.next_attempt > give_up_at {
                return Step::Fail(self.unreachable(&link));
            }
            return Step::Sleep(link.next_attempt);
        }
        if now >= link.next_attempt {
            link.attempting = true;
            return Step::Attempt;
        }
        if link.next_attempt > give_up_at {
            return Step::Fail(self.unreachable(&link));
        }
        Step::Sleep(link.next_attempt)
    }

    fn unreachable(&self, link: &LinkState) -> io::Error {
        io::Error::new(
            io::ErrorKind::NotConnected,
            format!("the NBD server is unreachable: {}", link.last_error),
        )
    }

    /// Forget a connection found dead.
    fn drop_dead(&self, link: &mut LinkState, conn: &Conn) {
        let reason = conn.dead_reason();
        tracing::warn!(device = %self.name, "NBD connection lost ({reason}); reconnecting");
        self.counters
            .connection_losses
            .fetch_add(1, Ordering::Relaxed);
        link.conn = None;
        link.last_error = reason;
        conn.close();
    }

    /// One reconnect attempt, claimed with [`Step::Attempt`], run without
    /// the lock; on failure, schedule the next one. Wakes every waiter.
    fn run_attempt(&self) {
        // A panic in the attempt must still end it, or the link would stay
        // "attempting" and every later request would wait for nothing.
        let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Conn::open(
                &self.uri,
                &self.options,
                &self.counters,
                Some(self.size_bytes),
            )
        }))
        .unwrap_or_else(|_| Err(io::Error::other("the reconnect attempt panicked")));
        let (waiting_tasks, unused) = {
            let mut link = self.lock();
            assert!(link.attempting, "an attempt ran that nobody claimed");
            link.attempting = false;
            link.attempts_ended += 1;
            let now = Instant::now();
            let mut unused = None;
            match opened {
                Ok(conn) if link.closed => unused = Some(conn),
                Ok(conn) => {
                    let down_ms = link
                        .down_since
                        .map_or(0, |since| now.duration_since(since).as_millis() as u64);
                    tracing::info!(device = %self.name, down_ms, "NBD connection re-established");
                    self.counters.reconnects.fetch_add(1, Ordering::Relaxed);
                    link.conn = Some(conn);
                    link.down_since = None;
                    link.backoff_ms = self.options.backoff_initial_ms.max(1);
                    link.next_attempt = now;
                }
                Err(err) => {
                    link.last_error = err.to_string();
                    link.next_attempt = now + Duration::from_millis(link.backoff_ms);
                    link.backoff_ms = (link.backoff_ms * 2).min(self.options.backoff_max_ms.max(1));
                }
            }
            (std::mem::take(&mut link.waiting_tasks), unused)
        };
        if let Some(conn) = unused {
            conn.close();
        }
        self.attempt_ended.notify_all();
        for task in waiting_tasks {
            task.send(());
        }
    }
}
