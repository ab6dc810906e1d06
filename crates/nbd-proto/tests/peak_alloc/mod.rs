//! A global allocator that records the largest single allocation made on
//! the current thread while tracking is on, to prove no buffer is sized
//! from a client-claimed length. Included by each test binary that needs it
//! (a global allocator is per binary).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Records the largest single allocation made on a thread while tracking
/// is on, to prove no buffer is sized from a client-claimed length.
struct PeakAlloc;

thread_local! {
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static PEAK_BYTES: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = TRACKING.try_with(|t| {
        if t.get() {
            let _ = PEAK_BYTES.try_with(|p| p.set(p.get().max(size)));
        }
    });
}

// SAFETY: every call is forwarded unchanged to the system allocator; the
// bookkeeping only touches const-initialised thread-locals, which never
// allocate.
unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: PeakAlloc = PeakAlloc;

pub fn peak_allocation<R>(f: impl FnOnce() -> R) -> (R, usize) {
    PEAK_BYTES.with(|p| p.set(0));
    TRACKING.with(|t| t.set(true));
    let r = f();
    TRACKING.with(|t| t.set(false));
    (r, PEAK_BYTES.with(|p| p.get()))
}
