//! A gate a device operation can be held at until the test lets it go:
//! armed once, the next operation that matches waits inside the device.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

#[derive(Default)]
struct State {
    /// Matched by the next operation to pass: a byte offset, or any.
    armed: Option<Option<u64>>,
    entered: bool,
    released: bool,
}

#[derive(Default)]
pub struct Gate {
    state: Mutex<State>,
    changed: Condvar,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hold the next operation covering byte `at` (`None`: the next one).
    pub fn arm(&self, at: Option<u64>) {
        *self.lock() = State {
            armed: Some(at),
            ..State::default()
        };
    }

    /// Called by the device for an operation over `[offset, offset + len)`:
    /// waits here if the gate is armed for it.
    pub fn pass(&self, offset: u64, len: u64) {
        let mut g = self.lock();
        let hit = match g.armed {
            Some(None) => true,
            Some(Some(at)) => at >= offset && at < offset + len,
            None => false,
        };
        if !hit {
            return;
        }
        g.armed = None;
        g.entered = true;
        self.changed.notify_all();
        while !g.released {
            g = self.changed.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Is an operation held (or was one, since the last arm)?
    pub fn is_entered(&self) -> bool {
        self.lock().entered
    }

    /// Wait until an operation is held, at most `limit`.
    pub fn wait_entered(&self, limit: Duration, what: &str) {
        let deadline = std::time::Instant::now() + limit;
        let mut g = self.lock();
        while !g.entered {
            assert!(
                std::time::Instant::now() < deadline,
                "{what} never reached the gate"
            );
            g = self
                .changed
                .wait_timeout(g, Duration::from_millis(10))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    pub fn release(&self) {
        self.lock().released = true;
        self.changed.notify_all();
    }
}
