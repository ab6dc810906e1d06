//! Simple replies cut out of a byte stream that arrives in pieces of any
//! size, for a reader that receives whatever the socket holds (a loop's own
//! connection, [`super::loop_channel`]) instead of reading one reply at a
//! time as the reader thread does.

use cairn_nbd_proto::codec::reply::decode_simple_reply;
use cairn_nbd_proto::codec::wire::SIMPLE_REPLY_BYTES;
use cairn_nbd_proto::codec::ReplyError;
use cairn_nbd_proto::proto::STRUCTURED_REPLY_MAGIC;

/// One reply taken whole from the stream.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Reply {
    pub cookie: u64,
    /// The data of a successful read (empty for other commands), or the
    /// server's NBD error.
    pub outcome: Result<Vec<u8>, u32>,
}

/// The reply being read: its header, then the data of a successful read.
struct DataInProgress {
    cookie: u64,
    data: Vec<u8>,
    /// Bytes the data still lacks.
    missing_bytes: usize,
}

/// What the stream has taken of the reply it is in the middle of.
pub(super) struct ReplyStream {
    header: [u8; SIMPLE_REPLY_BYTES],
    header_filled: usize,
    data: Option<DataInProgress>,
}

impl ReplyStream {
    pub fn new() -> ReplyStream {
        ReplyStream {
            header: [0u8; SIMPLE_REPLY_BYTES],
            header_filled: 0,
            data: None,
        }
    }

    /// Take `bytes` (the next piece of the stream) and push every reply
    /// they complete to `replies`. `read_len(cookie)` is how many bytes of
    /// data follow a successful reply to that request (0 for anything but
    /// a read), or `None` for a cookie nobody sent: then, as for any other
    /// protocol error, the stream cannot go on and the reason is returned.
    pub fn feed(
        &mut self,
        mut bytes: &[u8],
        read_len: &mut impl FnMut(u64) -> Option<usize>,
        replies: &mut Vec<Reply>,
    ) -> Result<(), String> {
        while !bytes.is_empty() {
            if let Some(progress) = &mut self.data {
                let taken = progress.missing_bytes.min(bytes.len());
                progress.data.extend_from_slice(&bytes[..taken]);
                progress.missing_bytes -= taken;
                bytes = &bytes[taken..];
                if progress.missing_bytes == 0 {
                    if let Some(done) = self.data.take() {
                        replies.push(Reply {
                            cookie: done.cookie,
                            outcome: Ok(done.data),
                        });
                    }
                }
                continue;
            }
            let wanted = SIMPLE_REPLY_BYTES - self.header_filled;
            let taken = wanted.min(bytes.len());
            self.header[self.header_filled..self.header_filled + taken]
                .copy_from_slice(&bytes[..taken]);
            self.header_filled += taken;
            bytes = &bytes[taken..];
            if self.header_filled == SIMPLE_REPLY_BYTES {
                self.header_filled = 0;
                self.header_done(read_len, replies)?;
            }
        }
        Ok(())
    }

    /// Whether the stream stands between two replies.
    #[cfg(test)]
    pub fn at_boundary(&self) -> bool {
        self.header_filled == 0 && self.data.is_none()
    }

    fn header_done(
        &mut self,
        read_len: &mut impl FnMut(u64) -> Option<usize>,
        replies: &mut Vec<Reply>,
    ) -> Result<(), String> {
        let reply = match decode_simple_reply(&self.header) {
            Ok(reply) => reply,
            Err(ReplyError::BadReplyMagic {
                magic: STRUCTURED_REPLY_MAGIC,
            }) => {
                return Err("protocol error: structured reply that was never negotiated".to_string())
            }
            Err(err) => return Err(format!("protocol error: {err}")),
        };
        let Some(len) = read_len(reply.cookie) else {
            // How much data follows is unknown: the stream is lost.
            return Err(format!(
                "protocol error: reply for unknown cookie {}",
                reply.cookie
            ));
        };
        if reply.error != 0 {
            replies.push(Reply {
                cookie: reply.cookie,
                outcome: Err(reply.error),
            });
        } else if len == 0 {
            replies.push(Reply {
                cookie: reply.cookie,
                outcome: Ok(Vec::new()),
            });
        } else {
            self.data = Some(DataInProgress {
                cookie: reply.cookie,
                data: Vec::with_capacity(len),
                missing_bytes: len,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_nbd_proto::codec::reply::encode_simple;
    use std::collections::HashMap;

    /// Replies to reads of `len` bytes each (data = the cookie's low byte),
    /// one failed with EIO (5), as one stream.
    fn stream_of(lens: &[(u64, usize)], failed: u64) -> Vec<u8> {
        let mut out = Vec::new();
        for &(cookie, len) in lens {
            if cookie == failed {
                encode_simple(&mut out, cookie, 5);
                continue;
            }
            encode_simple(&mut out, cookie, 0);
            out.extend(std::iter::repeat_n(cookie as u8, len));
        }
        out
    }

    #[test]
    fn replies_come_out_whole_however_the_stream_is_cut() {
        let lens: Vec<(u64, usize)> = vec![(1, 4096), (2, 0), (3, 512), (4, 4096), (5, 131072)];
        let table: HashMap<u64, usize> = lens.iter().copied().collect();
        let bytes = stream_of(&lens, 4);
        // Every piece size from 1 byte up, and a few odd ones.
        for piece in [
            1usize,
            2,
            7,
            15,
            16,
            17,
            4095,
            4096,
            4112,
            65536,
            bytes.len(),
        ] {
            let mut stream = ReplyStream::new();
            let mut replies = Vec::new();
            for chunk in bytes.chunks(piece) {
                stream
                    .feed(chunk, &mut |c| table.get(&c).copied(), &mut replies)
                    .expect("a well-formed stream");
            }
            assert!(stream.at_boundary(), "piece {piece}");
            assert_eq!(replies.len(), lens.len(), "piece {piece}");
            for (reply, &(cookie, len)) in replies.iter().zip(&lens) {
                assert_eq!(reply.cookie, cookie);
                match &reply.outcome {
                    Ok(data) => {
                        assert_ne!(cookie, 4);
                        assert_eq!(data.len(), len);
                        assert!(data.iter().all(|&b| b == cookie as u8));
                    }
                    Err(error) => {
                        assert_eq!(cookie, 4);
                        assert_eq!(*error, 5);
                    }
                }
            }
        }
    }

    #[test]
    fn an_unknown_cookie_or_bad_magic_ends_the_stream() {
        let mut stream = ReplyStream::new();
        let mut replies = Vec::new();
        let bytes = stream_of(&[(9, 16)], 0);
        let err = stream
            .feed(&bytes, &mut |_| None, &mut replies)
            .expect_err("nobody sent cookie 9");
        assert!(err.contains("unknown cookie 9"), "{err}");
        assert!(replies.is_empty());

        let mut stream = ReplyStream::new();
        let mut garbage = bytes.clone();
        garbage[0] ^= 0xff;
        let err = stream
            .feed(&garbage, &mut |_| Some(16), &mut replies)
            .expect_err("not a reply");
        assert!(err.contains("protocol error"), "{err}");

        let mut stream = ReplyStream::new();
        let mut structured = bytes;
        structured[..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        let err = stream
            .feed(&structured, &mut |_| Some(16), &mut replies)
            .expect_err("structured replies were not negotiated");
        assert!(err.contains("structured"), "{err}");
    }
}
