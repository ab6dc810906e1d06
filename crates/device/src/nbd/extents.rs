//! Block status of the export (`base:allocation`), on a connection of its
//! own.
//!
//! The data connection uses simple replies only, which keeps its pipelined
//! reader to one fixed reply shape (see the module documentation). Block
//! status needs structured replies, so it gets a second, lazily opened
//! connection that negotiates them and the `base:allocation` context, and
//! asks one question at a time: it serves `nbdinfo --map` and copies, not
//! the I/O path.
//!
//! A second connection sees the first one's writes only where the server
//! promises it: `NBD_FLAG_CAN_MULTI_CONN` (a FLUSH on any connection makes
//! every completed write visible on all of them). So [`super::NbdDevice`]
//! asks only such a server, and flushes the data connection first when a
//! write completed since its last flush. A server without multi-conn, or
//! without structured replies or the context, gets no question: everything
//! is reported as data, which is never wrong.

use std::io::{self, Read, Write};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use cairn_nbd_proto::codec::reply::{decode_chunk_header, decode_error_chunk, decode_simple_reply};
use cairn_nbd_proto::codec::wire::{SIMPLE_REPLY_BYTES, STRUCTURED_REPLY_HEADER_BYTES};
use cairn_nbd_proto::codec::RequestHeader;
use cairn_nbd_proto::proto::{
    CMD_BLOCK_STATUS, CMD_DISC, REPLY_TYPE_BLOCK_STATUS, REPLY_TYPE_NONE, SIMPLE_REPLY_MAGIC,
    STATE_HOLE, STATE_ZERO,
};

use super::handshake::{extents_handshake, open_session, protocol_error};
use super::options::NbdOptions;
use super::transport::Stream;
use super::uri::NbdUri;
use crate::allocation::push_run as push;
use crate::AllocationRun;

/// Longest range asked in one request: the length field is 32 bits; stay
/// well inside it, at a multiple of every legal minimum block size.
const MAX_QUERY_BYTES: u64 = 1 << 30;
/// Requests one call makes at most (a server may answer a prefix of the
/// range); what is left after them is reported as data.
const MAX_QUERIES: usize = 64;
/// Chunks of one reply read at most before the reply counts as broken.
const MAX_CHUNKS: usize = 64;
/// Largest chunk payload taken: 64 Ki descriptors.
const MAX_CHUNK_PAYLOAD_BYTES: u64 = 4 + 8 * (64 << 10);
/// Runs one call returns at most, like the file allocation's bound.
const MAX_RUNS: usize = 4096;
/// After a failed connect or request, calls report data at once for this
/// long instead of reconnecting each time.
const RETRY_AFTER_MS: u64 = 5_000;

/// The side connection's state.
enum State {
    /// Not tried yet.
    Closed,
    Open(ExtentsConn),
    /// The server cannot answer (no structured replies or no context):
    /// never asked again.
    Unsupported,
    /// The last attempt failed; try again after this instant.
    Failed {
        retry_at: Instant,
    },
}

/// Block status queries to one export (see the module documentation).
pub(super) struct Extents {
    uri: NbdUri,
    options: NbdOptions,
    size_bytes: u64,
    state: Mutex<State>,
}

/// An open side connection with `base:allocation` negotiated.
struct ExtentsConn {
    stream: Stream,
    context_id: u32,
    min_block_bytes: u64,
    next_cookie: u64,
}

impl Extents {
    pub fn new(uri: NbdUri, options: NbdOptions, size_bytes: u64) -> Extents {
        Extents {
            uri,
            options,
            size_bytes,
            state: Mutex::new(State::Closed),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The runs of `[offset, offset + len)`, summing to `len`. `Ok(None)`:
    /// the server cannot tell, report data. An error: the connection failed
    /// (it is dropped; the next call after a pause reconnects).
    pub fn query(&self, offset: u64, len: u64) -> io::Result<Option<Vec<AllocationRun>>> {
        let mut state = self.lock();
        if let State::Failed { retry_at } = *state {
            if Instant::now() < retry_at {
                return Ok(None);
            }
            *state = State::Closed;
        }
        if matches!(*state, State::Closed) {
            *state = match self.connect() {
                Ok(Some(conn)) => State::Open(conn),
                Ok(None) => {
                    tracing::info!(device = %self.uri, "the server gives no base:allocation block status; its allocation is reported as data");
                    State::Unsupported
                }
                Err(err) => {
                    *state = self.failed();
                    return Err(err);
                }
            };
        }
        let State::Open(conn) = &mut *state else {
            return Ok(None);
        };
        match conn.runs(offset, len) {
            Ok(runs) => Ok(Some(runs)),
            Err(err) => {
                *state = self.failed();
                Err(err)
            }
        }
    }

    fn failed(&self) -> State {
        State::Failed {
            retry_at: Instant::now() + Duration::from_millis(RETRY_AFTER_MS),
        }
    }

    fn connect(&self) -> io::Result<Option<ExtentsConn>> {
        let timeout = Duration::from_millis(self.options.connect_timeout_ms.max(1));
        let request_timeout = Duration::from_millis(self.options.request_timeout_ms.max(1));
        let (mut stream, greeting) = open_session(&self.uri, timeout, request_timeout)?;
        let Some((info, context_id)) = extents_handshake(&mut stream, &greeting, &self.uri.export)?
        else {
            stream.shutdown();
            return Ok(None);
        };
        if info.size_bytes != self.size_bytes {
            stream.shutdown();
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the export's size changed from {} to {} bytes",
                    self.size_bytes, info.size_bytes
                ),
            ));
        }
        stream.set_timeouts(Some(request_timeout), Some(request_timeout))?;
        Ok(Some(ExtentsConn {
            stream,
            context_id,
            min_block_bytes: u64::from(info.min_block_bytes.max(1)),
            next_cookie: 1,
        }))
    }

    /// Soft disconnect of the side connection, if open.
    pub fn close(&self) {
        let mut state = self.lock();
        if let State::Open(conn) = &mut *state {
            conn.disconnect();
        }
        *state = State::Closed;
    }
}

impl ExtentsConn {
    /// Ask until the range is covered, the bounds are reached, or the
    /// server answers nothing new; the rest is data.
    fn runs(&mut self, offset: u64, len: u64) -> io::Result<Vec<AllocationRun>> {
        let end = offset + len;
        let mut runs: Vec<AllocationRun> = Vec::new();
        let mut at = offset;
        for _ in 0..MAX_QUERIES {
            if at >= end || runs.len() >= MAX_RUNS {
                break;
            }
            // Whole minimum blocks: the caller's ranges are aligned, and a
            // ragged tail is left as data below.
            let ask = (end - at).min(MAX_QUERY_BYTES) / self.min_block_bytes * self.min_block_bytes;
            if ask == 0 || !at.is_multiple_of(self.min_block_bytes) {
                break;
            }
            let covered = self.query(at, ask, &mut runs)?;
            debug_assert!(covered > 0 && covered <= ask);
            at += covered;
        }
        if at < end {
            push(&mut runs, end - at, true);
        }
        debug_assert_eq!(runs.iter().map(|r| r.length_bytes).sum::<u64>(), len);
        Ok(runs)
    }

    /// One BLOCK_STATUS of `[offset, offset + len)`: appends its runs and
    /// returns how many bytes they cover (at least one block, at most `len`).
    fn query(&mut self, offset: u64, len: u64, runs: &mut Vec<AllocationRun>) -> io::Result<u64> {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let header = RequestHeader {
            flags: 0,
            command: CMD_BLOCK_STATUS,
            cookie,
            offset,
            length_bytes: len,
        };
        self.stream.write_all(&header.to_compact())?;
        let mut covered: Option<u64> = None;
        for _ in 0..MAX_CHUNKS {
            let mut magic = [0u8; 4];
            self.stream.read_exact(&mut magic)?;
            if u32::from_be_bytes(magic) == SIMPLE_REPLY_MAGIC {
                // Only an error may come as a simple reply here.
                let mut raw = [0u8; SIMPLE_REPLY_BYTES];
                raw[..4].copy_from_slice(&magic);
                self.stream.read_exact(&mut raw[4..])?;
                let reply =
                    decode_simple_reply(&raw).map_err(|err| protocol_error(err.to_string()))?;
                return Err(io::Error::other(format!(
                    "BLOCK_STATUS failed with NBD error {}",
                    reply.error
                )));
            }
            let mut raw = [0u8; STRUCTURED_REPLY_HEADER_BYTES];
            raw[..4].copy_from_slice(&magic);
            self.stream.read_exact(&mut raw[4..])?;
            let chunk = decode_chunk_header(&raw)
                .map_err(|err| protocol_error(err.to_string()))?
                .ok_or_else(|| protocol_error("short chunk header".into()))?;
            if chunk.cookie != cookie {
                return Err(protocol_error(format!(
                    "reply for cookie {}, expected {cookie}",
                    chunk.cookie
                )));
            }
            if chunk.payload_bytes > MAX_CHUNK_PAYLOAD_BYTES {
                return Err(protocol_error(format!(
                    "block status chunk of {} bytes",
                    chunk.payload_bytes
                )));
            }
            let mut payload = vec![0u8; chunk.payload_bytes as usize];
            self.stream.read_exact(&mut payload)?;
            match chunk.reply_type {
                REPLY_TYPE_BLOCK_STATUS => {
                    if covered.is_some() {
                        return Err(protocol_error("two block status chunks".into()));
                    }
                    covered = Some(self.descriptors(&payload, len, runs)?);
                }
                REPLY_TYPE_NONE => {}
                _ if chunk.is_error() => {
                    let (error, message) = decode_error_chunk(&payload);
                    return Err(io::Error::other(format!(
                        "BLOCK_STATUS failed with NBD error {error}: {message}"
                    )));
                }
                t => {
                    return Err(protocol_error(format!(
                        "unexpected chunk type {t} in a block status reply"
                    )))
                }
            }
            if chunk.is_done() {
                return covered
                    .ok_or_else(|| protocol_error("block status reply without extents".into()));
            }
        }
        Err(protocol_error(
            "block status reply of too many chunks".into(),
        ))
    }

    /// Append the descriptors of one chunk (clipped to `len`), returning
    /// the bytes they cover. A hole is only what the server calls both
    /// unallocated and zero: anything else may hold data.
    fn descriptors(
        &self,
        payload: &[u8],
        len: u64,
        runs: &mut Vec<AllocationRun>,
    ) -> io::Result<u64> {
        if payload.len() < 12 || !(payload.len() - 4).is_multiple_of(8) {
            return Err(protocol_error(format!(
                "block status payload of {} bytes",
                payload.len()
            )));
        }
        let context_id = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
        if context_id != self.context_id {
            return Err(protocol_error(format!(
                "block status for context {context_id}, expected {}",
                self.context_id
            )));
        }
        let mut covered = 0u64;
        for d in payload[4..].chunks_exact(8) {
            let length = u64::from(u32::from_be_bytes([d[0], d[1], d[2], d[3]]));
            let flags = u32::from_be_bytes([d[4], d[5], d[6], d[7]]);
            if length == 0 {
                return Err(protocol_error("zero-length extent".into()));
            }
            if covered >= len {
                break;
            }
            let length = length.min(len - covered);
            let hole = flags & STATE_HOLE != 0 && flags & STATE_ZERO != 0;
            push(runs, length, !hole);
            covered += length;
        }
        Ok(covered)
    }

    fn disconnect(&mut self) {
        let header = RequestHeader {
            flags: 0,
            command: CMD_DISC,
            cookie: self.next_cookie,
            offset: 0,
            length_bytes: 0,
        };
        // Best effort: the socket is shut down either way.
        let _ = self.stream.write_all(&header.to_compact());
        self.stream.shutdown();
    }
}
