//! What a request holds until its reply has left.

use std::rc::Rc;
use std::sync::Arc;

use super::slots::Slots;
use crate::server::Shared;

/// A request's in-flight slot and its share of the server's payload
/// budget, given back when dropped: when its reply has been sent, or is
/// dropped unsent (a broken connection). Held by the reply in the output
/// queue, so replies waiting for a client that does not read count against
/// both limits, like the requests still running.
pub(super) struct Charge {
    slots: Rc<Slots>,
    shared: Arc<Shared>,
    budget_bytes: u64,
}

impl Charge {
    /// Take on a slot already taken from `slots` for `budget_bytes`, and
    /// those bytes already acquired from the server's budget.
    pub(super) fn new(slots: Rc<Slots>, shared: Arc<Shared>, budget_bytes: u64) -> Charge {
        Charge {
            slots,
            shared,
            budget_bytes,
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.shared.budget.release(self.budget_bytes);
        self.slots.release(self.budget_bytes);
    }
}
