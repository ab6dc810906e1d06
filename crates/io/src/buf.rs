//! Buffers the kernel may use while an operation is in flight.

/// A buffer whose bytes stay at the same address while the value is moved
/// (the bytes live on the heap or in a mapping, not inline), for as long as
/// it is not mutated or dropped. The reactor keeps such a buffer alive
/// until the kernel has completed the operation that uses it, even if the
/// future that started it is dropped.
///
/// # Safety
/// `stable_ptr` must point to `stable_len` initialised bytes that do not
/// move when `self` is moved, and stay valid until `self` is dropped or
/// mutably accessed.
pub unsafe trait StableBuf: 'static {
    fn stable_ptr(&self) -> *const u8;
    fn stable_len(&self) -> usize;
}

/// A [`StableBuf`] the kernel may write into.
///
/// # Safety
/// As for [`StableBuf`], and `stable_mut_ptr` must be valid for writes of
/// `stable_len` bytes.
pub unsafe trait StableBufMut: StableBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8;
}

// SAFETY: a Vec's elements live on the heap; moving the Vec moves only its
// (pointer, length, capacity) triple.
unsafe impl StableBuf for Vec<u8> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn stable_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: as above; the pointer is valid for writes of `len` bytes.
unsafe impl StableBufMut for Vec<u8> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
}

// SAFETY: a boxed slice's bytes live on the heap.
unsafe impl StableBuf for Box<[u8]> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn stable_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: as above.
unsafe impl StableBufMut for Box<[u8]> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
}

/// Several buffers sent back to back by one `sendmsg`, owned by one value
/// (a batch of NBD replies: headers and the read buffers they carry).
///
/// # Safety
/// Every slice `iovecs` describes must stay valid, unmoved and unmutated
/// for as long as `self` is alive.
pub unsafe trait StableBufs: 'static {
    fn iovecs(&self) -> Vec<libc::iovec>;
}
