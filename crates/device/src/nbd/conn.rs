//! One pipelined connection: callers write their requests straight to the
//! socket under a short writer lock and wait on their batch; the reader
//! thread ([`super::reader`]) completes them.

use std::io::{self, Write};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cairn_io::{first_of, Either, Reactor};
use cairn_nbd_proto::proto::{CMD_DISC, CMD_READ};

use super::batch::Batch;
use super::command::Command;
use super::handshake::{handshake, open_session, NegotiatedExport};
use super::options::NbdOptions;
use super::reader::{reader_loop, ConnShared, Pending};
use super::stats::Counters;
use super::transport::{write_request, Stream};
use super::uri::NbdUri;

/// How long close and a timed-out request wait for the reader thread to
/// notice the socket was shut down.
const READER_EXIT_WAIT_MS: u64 = 2_000;

/// A request that could not be sent.
pub(super) struct SendError {
    pub error: io::Error,
    /// The request never fully left and the connection is dead.
    pub retryable: bool,
}

pub(super) struct Conn {
    writer: Mutex<Stream>,
    /// A handle used only to end the connection (shut it down, which wakes
    /// the reader, or reset it).
    control: Stream,
    shared: Arc<ConnShared>,
    reader: Mutex<Option<JoinHandle<()>>>,
    pub info: NegotiatedExport,
    options: NbdOptions,
    counters: Arc<Counters>,
}

impl Conn {
    /// Connect and handshake; check the export still has the size we opened.
    pub fn open(
        uri: &NbdUri,
        options: &NbdOptions,
        counters: &Arc<Counters>,
        expect_size_bytes: Option<u64>,
    ) -> io::Result<Arc<Conn>> {
        let connect_timeout = Duration::from_millis(options.connect_timeout_ms.max(1));
        let request_timeout = Duration::from_millis(options.request_timeout_ms.max(1));
        let (mut stream, greeting) = open_session(uri, connect_timeout, request_timeout)?;
        let info = handshake(&mut stream, &greeting, &uri.export)?;
        if let Some(expected) = expect_size_bytes {
            if info.size_bytes != expected {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "the export's size changed from {expected} to {} bytes",
                        info.size_bytes
                    ),
                ));
            }
        }
        // The reader blocks until a reply comes (callers time out on their own);
        // a send must not block forever on a server that stopped reading.
        stream.set_timeouts(
            None,
            Some(Duration::from_millis(options.request_timeout_ms.max(1))),
        )?;
        let reader_stream = stream.try_clone()?;
        let control = stream.try_clone()?;
        let shared = Arc::new(ConnShared::new());
        let reader_shared = Arc::clone(&shared);
        let reader = std::thread::Builder::new()
            .name("cairn-nbd-rx".into())
            .spawn(move || reader_loop(reader_stream, reader_shared))?;
        Ok(Arc::new(Conn {
            writer: Mutex::new(stream),
            control,
            shared,
            reader: Mutex::new(Some(reader)),
            info,
            options: *options,
            counters: Arc::clone(counters),
        }))
    }

    pub fn is_alive(&self) -> bool {
        self.shared.lock().dead.is_none()
    }

    /// Why the connection died (empty while it works).
    pub fn dead_reason(&self) -> String {
        self.shared.lock().dead.clone().unwrap_or_default()
    }

    /// Mark the connection dead and wake everyone; the reader thread then
    /// fails whatever is still in flight. The connection is reset
    /// (`Stream::abort`): a request the kernel had not sent yet must not
    /// reach the server later, after its retry or a newer write.
    pub fn kill(&self, reason: String) {
        // Not a graceful end any more, whatever a close decided: the reader
        // resets the connection again once it has woken (a kernel may
        // refuse a reset while it waits).
        self.shared.lock().closing = false;
        self.mark_dead(reason);
        if let Err(e) = self.control.abort() {
            tracing::debug!(error = %e, "resetting the NBD connection failed; the reader tries again");
        }
    }

    fn mark_dead(&self, reason: String) {
        {
            let mut state = self.shared.lock();
            if state.dead.is_none() {
                state.dead = Some(reason);
            }
        }
        self.shared.window_changed(true);
    }

    /// Soft disconnect (NBD_CMD_DISC), then stop the reader thread. A
    /// connection that is dead, busy (requests in flight) or whose
    /// disconnect request could not be sent is reset instead (`kill`):
    /// only an idle, working one ends gracefully.
    pub fn close(&self) {
        // Decided under the lock the reader fails requests under: a
        // connection that failed meanwhile is reset, one closed on purpose
        // ends gracefully, so the disconnect request reaches the server.
        let idle = {
            let mut state = self.shared.lock();
            state.closing = state.dead.is_none() && state.in_flight == 0;
            state.closing
        };
        let sent = idle && {
            let header = Command::bare(CMD_DISC, 0, 0).header(0);
            let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
            writer.write_all(&header).is_ok()
        };
        if sent {
            self.mark_dead("closed".into());
            self.control.shutdown();
        } else {
            self.kill("closed".into());
        }
        let handle = self
            .reader
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(handle) = handle {
            // The shutdown above makes the reader's read return at once.
            let _ = handle.join();
        }
    }

    fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.options.request_timeout_ms)
    }

    /// Register one command of `batch` as pending under `cookie` (waiting
    /// for a free slot in the window) and write it to the socket.
    pub fn send(
        &self,
        batch: &Arc<Batch>,
        index: usize,
        command: &Command<'_>,
        cookie: u64,
    ) -> Result<(), SendError> {
        self.register(batch, index, command, cookie)?;
        self.write_command(command, cookie)
    }

    /// [`Conn::send`] as a task on the current reactor: waiting for a slot
    /// in the window holds no thread.
    pub async fn send_async(
        &self,
        reactor: &Reactor,
        batch: &Arc<Batch>,
        index: usize,
        command: &Command<'_>,
        cookie: u64,
    ) -> Result<(), SendError> {
        self.register_async(reactor, batch, index, command, cookie)
            .await?;
        self.write_command(command, cookie)
    }

    /// Write a registered command to the socket.
    fn write_command(&self, command: &Command<'_>, cookie: u64) -> Result<(), SendError> {
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let header = command.header(cookie);
        let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(err) = write_request(&mut *writer, &header, &command.payload) {
            drop(writer);
            // Part of a request may be on the wire: the stream is unusable.
            // The reader fails this request (and the others in flight).
            self.kill(format!("sending a request failed: {err}"));
            // A send timeout means the server stopped reading: not worth
            // resending. A broken connection is.
            let retryable = !matches!(
                err.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            );
            return Err(SendError {
                error: err,
                retryable,
            });
        }
        Ok(())
    }

    fn dead_error(reason: &str) -> SendError {
        SendError {
            error: io::Error::new(io::ErrorKind::ConnectionAborted, reason.to_string()),
            retryable: true,
        }
    }

    /// No slot freed within the request timeout: the server is stuck.
    fn window_timeout(&self) -> SendError {
        self.counters.timeouts.fetch_add(1, Ordering::Relaxed);
        let message = format!(
            "no request slot freed within {} ms",
            self.options.request_timeout_ms
        );
        self.kill(message.clone());
        SendError {
            error: io::Error::new(io::ErrorKind::TimedOut, message),
            retryable: false,
        }
    }

    /// Enter a command in the table the reader completes (a slot is free).
    fn enter_pending(
        &self,
        state: &mut super::reader::ConnState,
        batch: &Arc<Batch>,
        index: usize,
        command: &Command<'_>,
        cookie: u64,
    ) {
        state.in_flight += 1;
        self.counters
            .peak_in_flight
            .fetch_max(state.in_flight as u64, Ordering::Relaxed);
        batch.lock().registered += 1;
        let read_len = if command.command == CMD_READ {
            command.len as usize
        } else {
            0
        };
        state.pending.insert(
            cookie,
            Pending {
                batch: Arc::clone(batch),
                index,
                read_len,
            },
        );
    }

    /// [`Conn::register`] as a task.
    async fn register_async(
        &self,
        reactor: &Reactor,
        batch: &Arc<Batch>,
        index: usize,
        command: &Command<'_>,
        cookie: u64,
    ) -> Result<(), SendError> {
        let max = self.options.max_in_flight.max(1);
        let slot = std::future::poll_fn(|cx| {
            let mut state = self.shared.lock();
            if let Some(reason) = &state.dead {
                return Poll::Ready(Err(Self::dead_error(reason)));
            }
            if state.in_flight < max {
                self.enter_pending(&mut state, batch, index, command, cookie);
                return Poll::Ready(Ok(()));
            }
            state.window_waiters.push(cx.waker().clone());
            Poll::Pending
        });
        match first_of(slot, reactor.sleep(self.request_timeout())).await {
            Either::Left(result) => result,
            Either::Right(()) => Err(self.window_timeout()),
        }
    }

    /// [`Conn::wait`] as a task: every registered request of `batch`
    /// completed, or the oldest passed its deadline (which kills the
    /// connection and fails the rest).
    pub async fn wait_async(&self, reactor: &Reactor, batch: &Batch, sent_at: &[Instant]) {
        let deadline =
            sent_at.first().map_or_else(Instant::now, |sent| *sent) + self.request_timeout();
        let left = deadline.saturating_duration_since(Instant::now());
        let done = std::future::poll_fn(|cx| batch.poll_done(cx));
        if let Either::Left(()) = first_of(done, reactor.sleep(left)).await {
            return;
        }
        self.counters.timeouts.fetch_add(1, Ordering::Relaxed);
        self.kill(format!(
            "no reply within {} ms",
            self.options.request_timeout_ms
        ));
        self.wait_for_drain(batch);
    }

    /// Wait for a slot in the window, then enter the command in the table
    /// the reader completes.
    fn register(
        &self,
        batch: &Arc<Batch>,
        index: usize,
        command: &Command<'_>,
        cookie: u64,
    ) -> Result<(), SendError> {
        let deadline = Instant::now() + self.request_timeout();
        let mut state = self.shared.lock();
        loop {
            if let Some(reason) = &state.dead {
                return Err(Self::dead_error(reason));
            }
            if state.in_flight < self.options.max_in_flight.max(1) {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                drop(state);
                return Err(self.window_timeout());
            }
            state = self
                .shared
                .window
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        self.enter_pending(&mut state, batch, index, command, cookie);
        Ok(())
    }

    /// Wait until every registered request of `batch` completed, or the
    /// oldest incomplete one passed its deadline (which kills the
    /// connection and fails the rest).
    pub fn wait(&self, batch: &Batch, sent_at: &[Instant]) {
        let timeout = self.request_timeout();
        let mut state = batch.lock();
        let mut oldest = 0usize;
        while state.completed < state.registered {
            while oldest < sent_at.len() && state.results[oldest].is_some() {
                oldest += 1;
            }
            // Registered but never fully sent: its send failed and killed the
            // connection, so the reader completes it soon.
            let deadline = sent_at.get(oldest).map_or_else(Instant::now, |sent| *sent) + timeout;
            let now = Instant::now();
            if now >= deadline {
                drop(state);
                self.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                self.kill(format!(
                    "no reply within {} ms",
                    self.options.request_timeout_ms
                ));
                self.wait_for_drain(batch);
                return;
            }
            state = batch.wait_timeout(state, deadline - now);
        }
    }

    /// After a timeout killed the connection, the reader fails what is left;
    /// mark what it has not reached yet as timed out ourselves.
    fn wait_for_drain(&self, batch: &Batch) {
        let deadline = Instant::now() + Duration::from_millis(READER_EXIT_WAIT_MS);
        let mut state = batch.lock();
        while state.completed < state.registered {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            state = batch.wait_timeout(state, deadline - now);
        }
        let message = format!("no reply within {} ms", self.options.request_timeout_ms);
        for slot in state.results.iter_mut() {
            match slot {
                // Replaced so the caller sees the timeout, not the abort it caused.
                Some(Err(err)) if err.kind() == io::ErrorKind::ConnectionAborted => {
                    *slot = Some(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        message.clone(),
                    )));
                }
                None => {
                    *slot = Some(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        message.clone(),
                    )))
                }
                _ => {}
            }
        }
    }
}
