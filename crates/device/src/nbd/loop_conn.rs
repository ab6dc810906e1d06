//! One loop's own connection to one export: opened in the background on
//! the loop's first miss, used while it works, retried a while after it
//! failed. Until it is open, and whenever it cannot be used, reads go to
//! the main connection, so opening it never delays a request.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_io::{oneshot, Reactor};

use super::loop_channel::LoopChannel;
use super::loop_dial::LoopDial;
use super::stats::Counters;

/// After a failed attempt (or a connection that broke), reads use the
/// main connection for this long before the loop tries again.
const RETRY_AFTER_MS: u64 = 5_000;

enum State {
    Closed,
    Opening,
    Open(Rc<LoopChannel>),
    Off { retry_at: Instant },
}

/// A loop's connection (see the module documentation); one per loop and
/// export, kept by the loop ([`Reactor::local`]).
pub(super) struct LoopConn {
    state: RefCell<State>,
}

impl LoopConn {
    pub fn new() -> LoopConn {
        LoopConn {
            state: RefCell::new(State::Closed),
        }
    }

    /// The channel a read may use now, if one is open with room; with
    /// none, start opening one (on a thread of its own) unless an attempt
    /// failed recently.
    /// `warned` is the export's: the first failure is logged once per
    /// export, not once per loop.
    pub fn channel(
        this: &Rc<LoopConn>,
        reactor: &Reactor,
        dial: &LoopDial,
        counters: &Arc<Counters>,
        warned: &Arc<AtomicBool>,
    ) -> Option<Rc<LoopChannel>> {
        let mut state = this.state.borrow_mut();
        match &*state {
            State::Open(channel) if !channel.is_dead() => {
                return channel.has_room().then(|| Rc::clone(channel));
            }
            State::Open(_) => {
                *state = Self::off();
                return None;
            }
            State::Opening => return None,
            State::Off { retry_at } if Instant::now() < *retry_at => return None,
            State::Off { .. } | State::Closed => {}
        }
        *state = State::Opening;
        drop(state);
        // A thread of its own, not the shared offload pool: a server that
        // stops accepting holds a dial for the whole connect timeout, and
        // the pool's few threads serve other calls (block status).
        let dialing = dial.clone();
        let (sender, opened) = oneshot::channel();
        let spawned = std::thread::Builder::new()
            .name("nbd-loop-dial".into())
            .spawn(move || sender.send(dialing.dial()));
        if let Err(err) = spawned {
            tracing::debug!("cannot start a thread to open a loop connection: {err}");
            *this.state.borrow_mut() = Self::off();
            return None;
        }
        let conn = Rc::clone(this);
        let loop_reactor = reactor.clone();
        let counters = Arc::clone(counters);
        let warned = Arc::clone(warned);
        let max_in_flight = dial.options.max_in_flight;
        let uri = dial.uri.to_string();
        reactor.spawn_detached(async move {
            let next = match opened.await {
                Ok(Ok(stream)) => {
                    counters.loop_connections.fetch_add(1, Ordering::Relaxed);
                    State::Open(LoopChannel::start(
                        &loop_reactor,
                        stream,
                        counters,
                        max_in_flight,
                    ))
                }
                Ok(Err(err)) => {
                    if !warned.swap(true, Ordering::Relaxed) {
                        tracing::info!(
                            device = %uri,
                            "a second connection to the origin failed ({err}); misses share \
                             its main connection (tried again every {} s)",
                            RETRY_AFTER_MS / 1000
                        );
                    }
                    Self::off()
                }
                // The dial's thread panicked: treat it like a failure.
                Err(_) => Self::off(),
            };
            *conn.state.borrow_mut() = next;
        });
        None
    }

    fn off() -> State {
        State::Off {
            retry_at: Instant::now() + Duration::from_millis(RETRY_AFTER_MS),
        }
    }
}
