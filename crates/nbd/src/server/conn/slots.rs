//! A connection's in-flight slots and the payload bytes they hold.

use std::cell::Cell;

use cairn_io::LocalNotify;

/// The requests a connection holds: one slot, and the request's payload
/// budget, from when a request is taken from the socket until its reply
/// has been sent (or dropped unsent). A client that stops reading replies
/// therefore stops being read once its slots or its share of the budget
/// are taken, so unsent replies never pile up without bound, and one such
/// client cannot hold the whole server's budget.
#[derive(Default)]
pub(super) struct Slots {
    used: Cell<usize>,
    bytes: Cell<u64>,
    freed: LocalNotify,
}

impl Slots {
    pub(super) fn used(&self) -> usize {
        self.used.get()
    }

    /// Take a slot for a request of `bytes` if fewer than `max` are used
    /// and the connection's bytes stay within `max_bytes`. A request on an
    /// idle connection always gets its slot, however large.
    pub(super) fn try_take(&self, max: usize, bytes: u64, max_bytes: u64) -> bool {
        let used = self.used.get();
        let total = self.bytes.get().saturating_add(bytes);
        if used >= max || (used > 0 && total > max_bytes) {
            return false;
        }
        self.used.set(used + 1);
        self.bytes.set(total);
        true
    }

    /// Give back a slot taken for a request of `bytes`.
    pub(super) fn release(&self, bytes: u64) {
        debug_assert!(self.used.get() > 0, "a slot released twice");
        debug_assert!(self.bytes.get() >= bytes, "more bytes released than taken");
        self.used.set(self.used.get().saturating_sub(1));
        self.bytes.set(self.bytes.get().saturating_sub(bytes));
        self.freed.notify_all();
    }

    /// Wait until a slot is released.
    pub(super) async fn freed(&self) {
        self.freed.notified().await;
    }
}

#[cfg(test)]
mod tests {
    use super::Slots;

    #[test]
    fn slots_and_bytes_bound_a_connection_but_an_idle_one_takes_any_request() {
        let slots = Slots::default();
        assert!(
            slots.try_take(2, 100, 10),
            "idle: even a request over the byte share"
        );
        assert!(
            !slots.try_take(2, 1, 10),
            "over the byte share while one is held"
        );
        slots.release(100);
        assert!(slots.try_take(2, 5, 10));
        assert!(slots.try_take(2, 5, 10));
        assert!(!slots.try_take(2, 0, 10), "every slot taken");
        slots.release(5);
        assert!(!slots.try_take(2, 6, 10), "5 + 6 bytes exceed the share");
        assert!(slots.try_take(2, 5, 10));
        assert_eq!(slots.used(), 2);
    }
}
