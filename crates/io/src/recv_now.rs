//! A receive that is tried at once, outside the ring.

use std::io;

use crate::buf::StableBufMut;
use crate::reactor::recv_dontwait;

/// Receive into `buf` with one non-blocking `recv` on the socket `fd`,
/// now: the bytes received (0 at the end of the stream), or `WouldBlock`
/// if none are there yet. A client that keeps the socket full (a stream
/// of large writes) then costs one system call per receive, without a
/// ring operation, a completion and a loop turn; the caller goes through
/// the ring, which waits for the bytes, only when none are there.
///
/// `buf` must not be empty: `Ok(0)` means the end of the stream.
pub fn recv_now<B: StableBufMut>(fd: i32, buf: &mut B) -> io::Result<usize> {
    debug_assert!(
        buf.stable_len() > 0,
        "an empty receive reads as the end of the stream"
    );
    let received = recv_dontwait(fd, buf);
    if received < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(received as usize)
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    use super::recv_now;
    use crate::buf::{StableBuf, StableBufMut};

    /// `len` bytes lent from the middle of a vector, as the connection's
    /// input buffer lends its free tail.
    struct Window {
        bytes: Vec<u8>,
        start: usize,
        len: usize,
    }

    // SAFETY: the range lies inside the vector, which is not moved or
    // resized while it is lent.
    unsafe impl StableBuf for Window {
        fn stable_ptr(&self) -> *const u8 {
            self.bytes[self.start..].as_ptr()
        }
        fn stable_len(&self) -> usize {
            self.len
        }
    }

    // SAFETY: as above; the range is initialised and writable.
    unsafe impl StableBufMut for Window {
        fn stable_mut_ptr(&mut self) -> *mut u8 {
            self.bytes[self.start..].as_mut_ptr()
        }
    }

    #[test]
    fn takes_what_is_there_within_its_window_then_would_block_then_sees_the_end() {
        let (a, mut b) = UnixStream::pair().expect("socket pair");
        let mut window = Window {
            bytes: vec![0u8; 16],
            start: 4,
            len: 8,
        };
        let refused = recv_now(a.as_raw_fd(), &mut window).expect_err("nothing sent yet");
        assert_eq!(refused.kind(), std::io::ErrorKind::WouldBlock);

        b.write_all(b"0123456789").expect("send");
        assert_eq!(recv_now(a.as_raw_fd(), &mut window).expect("recv"), 8);
        assert_eq!(&window.bytes[..4], &[0u8; 4], "wrote before its window");
        assert_eq!(&window.bytes[4..12], b"01234567");
        assert_eq!(&window.bytes[12..], &[0u8; 4], "wrote past its window");

        window.start = 0;
        assert_eq!(recv_now(a.as_raw_fd(), &mut window).expect("rest"), 2);
        assert_eq!(&window.bytes[..2], b"89");
        let refused = recv_now(a.as_raw_fd(), &mut window).expect_err("drained");
        assert_eq!(refused.kind(), std::io::ErrorKind::WouldBlock);

        drop(b);
        assert_eq!(recv_now(a.as_raw_fd(), &mut window).expect("end"), 0);
    }
}
