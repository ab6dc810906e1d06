//! A send that is tried at once, outside the ring.

use std::io;

use crate::buf::StableBufs;

/// Send what `bufs` holds with one non-blocking `sendmsg` on the socket
/// `fd`, now: the bytes the socket took (possibly fewer than all), or
/// `WouldBlock` if it took none. A reply the socket has room for then
/// needs no ring operation, completion and loop turn of its own: at one
/// request in flight that was one `io_uring_enter` per request more. What
/// is left goes through the ring, which waits for room.
pub fn send_now<B: StableBufs>(fd: i32, bufs: &B) -> io::Result<usize> {
    let mut iovecs = bufs.iovecs();
    if iovecs.is_empty() {
        return Ok(0);
    }
    // SAFETY: an all-zero msghdr is a valid empty header.
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = iovecs.as_mut_ptr();
    header.msg_iovlen = iovecs.len() as _;
    // SAFETY: the header points to `iovecs`, which describe memory `bufs`
    // keeps valid and unmoved while it is borrowed (the `StableBufs`
    // contract); both outlive the call, and the kernel only reads them.
    let sent = unsafe {
        libc::sendmsg(
            fd,
            &header as *const libc::msghdr,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sent as usize)
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    use super::send_now;
    use crate::buf::StableBufs;

    struct Pieces(Vec<Vec<u8>>);

    // SAFETY: every piece is a Vec owned by the value, unchanged while it
    // lives.
    unsafe impl StableBufs for Pieces {
        fn iovecs(&self) -> Vec<libc::iovec> {
            self.0
                .iter()
                .map(|p| libc::iovec {
                    iov_base: p.as_ptr() as *mut libc::c_void,
                    iov_len: p.len(),
                })
                .collect()
        }
    }

    #[test]
    fn pieces_go_out_in_order_and_a_full_socket_takes_part_then_nothing() {
        let (a, mut b) = UnixStream::pair().expect("socket pair");
        let pieces = Pieces(vec![b"head".to_vec(), Vec::new(), b"-data".to_vec()]);
        assert_eq!(send_now(a.as_raw_fd(), &pieces).expect("send"), 9);
        let mut got = [0u8; 9];
        b.read_exact(&mut got).expect("read");
        assert_eq!(&got, b"head-data");
        assert_eq!(
            send_now(a.as_raw_fd(), &Pieces(Vec::new())).expect("empty"),
            0
        );

        // Nobody reads `b`: the socket fills, takes part of a send, and
        // then refuses with WouldBlock instead of blocking the thread. The
        // piece is larger than any socket buffer a host is likely to set,
        // so the first send cannot be taken whole.
        let big = Pieces(vec![vec![7u8; 32 << 20]]);
        let mut total = 0usize;
        let mut partial = false;
        let refused = loop {
            match send_now(a.as_raw_fd(), &big) {
                Ok(n) => {
                    assert!(n > 0 && n <= 32 << 20);
                    partial |= n < 32 << 20;
                    total += n;
                    assert!(total < 1 << 30, "the socket never filled");
                }
                Err(e) => break e,
            }
        };
        assert_eq!(refused.kind(), std::io::ErrorKind::WouldBlock);
        assert!(
            partial,
            "a send into a filling socket was taken whole every time"
        );
    }
}
