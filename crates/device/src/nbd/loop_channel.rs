//! A connection to the server owned by one event loop, for the reads of
//! its misses.
//!
//! On the main connection a reply is read by the reader thread, which
//! wakes the loop waiting for it through its eventfd: a miss costs the
//! loop's send, the reader thread's wake-up and the loop's wake-up. Here
//! the loop itself receives the replies (a `recv` on its own ring, made by
//! a task of the loop), so a reply wakes the loop directly and no other
//! thread is involved. Requests are queued in order for the channel's
//! writer task, which sends what a pass of the loop queued in one
//! `sendmsg` (measured: a burst of 23 misses cost 23 sends of 30-50 us
//! each, 1.3 ms from the first request to the last).
//!
//! A channel serves reads only. Writes, flushes and everything else stay
//! on the main connection, where their order and FLUSH semantics are kept
//! (see [`super::loop_conn`] for when a read may come here).

use std::cell::RefCell;
use std::collections::HashMap;
use std::io;
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::Duration;

use cairn_io::{first_of, send_now, Either, Reactor};
use cairn_nbd_proto::proto::{CMD_DISC, CMD_READ, NBD_ESHUTDOWN};

use super::command::Command;
use super::loop_read_error::LoopReadError;
use super::outgoing::Outgoing;
use super::reply_slot::ReplySlot;
use super::reply_stream::{Reply, ReplyStream};
use super::stats::Counters;
use super::transport::Stream;

/// What one `recv` takes at most: many 4 KiB replies at once, a large one
/// in a few pieces.
const RECV_BUFFER_BYTES: usize = 256 << 10;

struct ChannelState {
    /// Why the channel is unusable; `None` while it works.
    dead: Option<String>,
    pending: HashMap<u64, Rc<ReplySlot>>,
    next_cookie: u64,
    /// Requests queued for the writer task, in order.
    outbox: Vec<u8>,
    /// The writer task, asleep on an empty outbox.
    writer: Option<Waker>,
}

/// One loop's own connection (see the module documentation).
pub(super) struct LoopChannel {
    stream: Stream,
    state: RefCell<ChannelState>,
    counters: Arc<Counters>,
    max_in_flight: usize,
}

impl LoopChannel {
    /// Take over a connected, negotiated `stream` and start its reader and
    /// writer tasks on `reactor`.
    pub fn start(
        reactor: &Reactor,
        stream: Stream,
        counters: Arc<Counters>,
        max_in_flight: usize,
    ) -> Rc<LoopChannel> {
        let channel = Rc::new(LoopChannel {
            stream,
            state: RefCell::new(ChannelState {
                dead: None,
                pending: HashMap::new(),
                next_cookie: 1,
                outbox: Vec::new(),
                writer: None,
            }),
            counters,
            max_in_flight: max_in_flight.max(1),
        });
        reactor.spawn_detached(read_loop(reactor.clone(), Rc::clone(&channel)));
        reactor.spawn_detached(write_loop(reactor.clone(), Rc::clone(&channel)));
        channel
    }

    fn fd(&self) -> i32 {
        self.stream.as_raw_fd()
    }

    pub fn is_dead(&self) -> bool {
        self.state.borrow().dead.is_some()
    }

    /// Alive, with room in its window for one more request.
    pub fn has_room(&self) -> bool {
        let state = self.state.borrow();
        state.dead.is_none() && state.pending.len() < self.max_in_flight
    }

    /// Read `len` bytes at `offset`: the data, or why not.
    pub async fn read(
        &self,
        reactor: &Reactor,
        offset: u64,
        len: u32,
        timeout: Duration,
    ) -> Result<Vec<u8>, LoopReadError> {
        let slot = self.send_read(offset, len)?;
        let outcome = std::future::poll_fn(|cx| slot.poll_outcome(cx));
        match first_of(outcome, reactor.sleep(timeout)).await {
            Either::Left(outcome) => outcome,
            Either::Right(()) => {
                self.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                let message = format!("no reply within {} ms", timeout.as_millis());
                // A server that stopped answering one request is not trusted
                // with the next: the rest fail over to the main connection.
                self.kill(message.clone());
                Err(LoopReadError::TimedOut(message))
            }
        }
    }

    /// Enter a read in the table and queue its request for the writer
    /// task.
    fn send_read(&self, offset: u64, len: u32) -> Result<Rc<ReplySlot>, LoopReadError> {
        let mut state = self.state.borrow_mut();
        if let Some(reason) = &state.dead {
            return Err(LoopReadError::Lost(reason.clone()));
        }
        let cookie = state.next_cookie;
        state.next_cookie += 1;
        let slot = Rc::new(ReplySlot::new(len as usize));
        state.pending.insert(cookie, Rc::clone(&slot));
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let header = Command::bare(CMD_READ, offset, len).header(cookie);
        // Queued for the writer task, which runs after the tasks ready now:
        // the requests a burst of misses makes in one pass leave in one
        // `sendmsg` instead of one each.
        state.outbox.extend_from_slice(&header);
        if let Some(writer) = state.writer.take() {
            writer.wake();
        }
        Ok(slot)
    }

    /// Complete the requests `bytes` finish; `Err` with the reason when the
    /// stream cannot go on.
    fn take_replies(
        &self,
        stream: &mut ReplyStream,
        bytes: &[u8],
        replies: &mut Vec<Reply>,
    ) -> Result<(), String> {
        replies.clear();
        let fed = {
            let state = self.state.borrow();
            stream.feed(
                bytes,
                &mut |cookie| state.pending.get(&cookie).map(|slot| slot.read_len),
                replies,
            )
        };
        let mut shutting_down = false;
        for reply in replies.drain(..) {
            let Some(slot) = self.state.borrow_mut().pending.remove(&reply.cookie) else {
                continue;
            };
            let outcome = match reply.outcome {
                Ok(data) => Ok(data),
                Err(error) => {
                    shutting_down |= error == NBD_ESHUTDOWN;
                    Err(LoopReadError::Server(error))
                }
            };
            slot.complete(outcome);
        }
        fed?;
        if shutting_down {
            return Err("the server is shutting down".to_string());
        }
        Ok(())
    }

    /// Mark the channel dead (keeping an earlier reason), shut its socket
    /// and fail every request still waiting, so their tasks ask again on
    /// the main connection.
    pub fn kill(&self, reason: String) {
        let (orphans, writer) = {
            let mut state = self.state.borrow_mut();
            if state.dead.is_some() {
                return;
            }
            tracing::debug!("loop connection closed: {reason}");
            state.dead = Some(reason.clone());
            state.outbox.clear();
            let orphans: Vec<Rc<ReplySlot>> = state.pending.drain().map(|(_, s)| s).collect();
            (orphans, state.writer.take())
        };
        self.stream.shutdown();
        for slot in orphans {
            slot.complete(Err(LoopReadError::Lost(reason.clone())));
        }
        if let Some(writer) = writer {
            writer.wake();
        }
    }
}

impl Drop for LoopChannel {
    /// A soft disconnect, best effort: the loop is going away (its client
    /// left), so nothing waits for the server's side of it.
    fn drop(&mut self) {
        if self.state.get_mut().dead.is_some() {
            return;
        }
        let header = Command::bare(CMD_DISC, 0, 0).header(0);
        let disc = Outgoing {
            bytes: header.to_vec(),
            sent: 0,
        };
        let _ = send_now(self.fd(), &disc);
    }
}

/// The reader task: receive whatever the socket holds and complete the
/// requests it answers, until the connection ends.
async fn read_loop(reactor: Reactor, channel: Rc<LoopChannel>) {
    let mut buf = vec![0u8; RECV_BUFFER_BYTES];
    let mut stream = ReplyStream::new();
    let mut replies = Vec::new();
    loop {
        if channel.is_dead() {
            return;
        }
        let (received, returned) = reactor.recv(channel.fd(), buf).await;
        buf = returned;
        let reason = match received {
            Ok(0) => "the server closed the loop connection".to_string(),
            Ok(n) => match channel.take_replies(&mut stream, &buf[..n], &mut replies) {
                Ok(()) => continue,
                Err(reason) => reason,
            },
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => format!("loop connection lost: {err}"),
        };
        if !channel.is_dead() {
            channel
                .counters
                .connection_losses
                .fetch_add(1, Ordering::Relaxed);
        }
        channel.kill(reason);
        return;
    }
}

/// The writer task: send what the request tasks queued, in order, all that
/// one pass of the loop queued at once; the next batch waits until this one
/// is sent.
async fn write_loop(reactor: Reactor, channel: Rc<LoopChannel>) {
    loop {
        let next = std::future::poll_fn(|cx| {
            let mut state = channel.state.borrow_mut();
            if state.dead.is_some() {
                return Poll::Ready(None);
            }
            if state.outbox.is_empty() {
                state.writer = Some(cx.waker().clone());
                return Poll::Pending;
            }
            Poll::Ready(Some(std::mem::take(&mut state.outbox)))
        })
        .await;
        let Some(bytes) = next else {
            return;
        };
        channel.counters.loop_sends.fetch_add(1, Ordering::Relaxed);
        let mut out = Outgoing { bytes, sent: 0 };
        // Sent at once when the socket takes it (the usual case); through
        // the ring, waiting for room, only what it does not.
        match send_now(channel.fd(), &out) {
            Ok(taken) => out.sent = taken,
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
            Err(err) => {
                channel.kill(format!("sending a request failed: {err}"));
                return;
            }
        }
        while !out.is_done() {
            let (sent, returned) = reactor.send_owned(channel.fd(), out).await;
            out = returned;
            match sent {
                Ok(0) => {
                    channel.kill("sending a request failed: the socket took nothing".into());
                    return;
                }
                Ok(taken) => out.sent += taken,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => {
                    channel.kill(format!("sending a request failed: {err}"));
                    return;
                }
            }
        }
    }
}
