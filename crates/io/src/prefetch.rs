//! A hint to the CPU to start loading a cache line now, for tables read
//! at places set by a hash: a caller that knows the next few places can
//! have their misses overlap instead of paying one after another.

/// Start loading the cache line that holds `value` into every cache
/// level. Only a hint: it never faults, changes nothing, and is a no-op
/// where no prefetch instruction is available.
#[inline(always)]
pub fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: SSE, the feature the intrinsic needs, is part of the
        // x86_64 baseline every build targets; a prefetch never faults,
        // and the address comes from a live reference anyway.
        unsafe { _mm_prefetch::<_MM_HINT_T0>((value as *const T).cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = value;
    }
}
