//! Request bytes on their way to the socket, sent from where the last
//! partial send stopped.

use cairn_io::StableBufs;

/// Bytes to send, and how many of them the socket has taken.
pub(super) struct Outgoing {
    pub bytes: Vec<u8>,
    pub sent: usize,
}

impl Outgoing {
    pub fn is_done(&self) -> bool {
        self.sent >= self.bytes.len()
    }
}

// SAFETY: the one slice described lives in `bytes`, a Vec the value owns;
// its heap bytes neither move nor change while the value lives (nothing
// mutates it while a send holds it).
unsafe impl StableBufs for Outgoing {
    fn iovecs(&self) -> Vec<libc::iovec> {
        let rest = &self.bytes[self.sent.min(self.bytes.len())..];
        if rest.is_empty() {
            return Vec::new();
        }
        vec![libc::iovec {
            iov_base: rest.as_ptr() as *mut libc::c_void,
            iov_len: rest.len(),
        }]
    }
}
