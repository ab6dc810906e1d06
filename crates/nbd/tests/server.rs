//! The real server, in process, over real sockets, driven by the test
//! client: bad clients are cut off while others keep being served,
//! replies come back by cookie, backpressure bounds concurrency, and
//! shutdown finishes what is in flight.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_nbd::proto::*;
use cairn_nbd::{
    serve, Export, ExportError, ExportFuture, Extent, Listener, MemExport, MemOp, ReadBuffer,
    ServerConfig, ServerError,
};
use common::*;

const SIZE: u64 = 16 << 20;

/// A MemExport that can be slowed down and counts concurrent calls.
struct Instrumented {
    inner: MemExport,
    write_delay_ms: AtomicU64,
    /// Reads at this offset sleep `slow_read_ms`.
    slow_read_offset: AtomicU64,
    slow_read_ms: AtomicU64,
    current: AtomicUsize,
    peak: AtomicUsize,
    /// A read at this offset fails with EIO.
    read_error_offset: AtomicU64,
}

impl Instrumented {
    fn new(size: u64) -> Arc<Instrumented> {
        Arc::new(Instrumented {
            inner: MemExport::new(size),
            write_delay_ms: AtomicU64::new(0),
            slow_read_offset: AtomicU64::new(u64::MAX),
            slow_read_ms: AtomicU64::new(0),
            current: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            read_error_offset: AtomicU64::new(u64::MAX),
        })
    }

    fn enter(&self) -> Guard<'_> {
        let now = self.current.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
        Guard(&self.current)
    }
}

struct Guard<'a>(&'a AtomicUsize);
impl Drop for Guard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn sleep_ms(ms: u64) {
    if ms > 0 {
        std::thread::sleep(Duration::from_millis(ms));
    }
}

impl Export for Instrumented {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        self.inner.read(offset, buf)
    }
    /// As a task: a slow read waits on the connection's event loop (as a
    /// device read would), so the requests after it keep being served.
    fn read_async(&self, offset: u64, length: u64) -> ExportFuture<'_, ReadBuffer> {
        Box::pin(async move {
            let _g = self.enter();
            if offset == self.slow_read_offset.load(Ordering::SeqCst) {
                let ms = self.slow_read_ms.load(Ordering::SeqCst);
                let reactor = cairn_io::Reactor::current().expect("reads run on a reactor");
                reactor.sleep(Duration::from_millis(ms)).await;
            }
            if offset == self.read_error_offset.load(Ordering::SeqCst) {
                return Err(ExportError::io("injected read failure"));
            }
            let mut buf = vec![0u8; length as usize];
            self.inner.read(offset, &mut buf)?;
            Ok(Box::new(buf) as ReadBuffer)
        })
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
        let _g = self.enter();
        sleep_ms(self.write_delay_ms.load(Ordering::SeqCst));
        self.inner.write(offset, data, fua)
    }
    fn flush(&self) -> Result<(), ExportError> {
        self.inner.flush()
    }
    fn trim(&self, offset: u64, length: u64) -> Result<(), ExportError> {
        self.inner.trim(offset, length)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
    ) -> Result<(), ExportError> {
        self.inner.write_zeroes(offset, length, may_trim, fast_only)
    }
    fn cache(&self, offset: u64, length: u64) -> Result<(), ExportError> {
        self.inner.cache(offset, length)
    }
    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, ExportError> {
        self.inner.block_status(offset, length)
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i % 251) as u8))
        .collect()
}

fn assert_serving(c: &mut Client) {
    let data = pattern(9, 4096);
    assert_eq!(c.write(8192, &data).unwrap(), 0);
    assert_eq!(c.read(8192, 4096).unwrap().unwrap(), data);
}

// ------------------------------------------------------------ bad input ---

#[test]
fn garbage_after_negotiation_disconnects_only_that_client() {
    let (server, _export) = TestServer::mem(SIZE);
    let mut good = Client::open(&server.socket, Mode::Structured, false).unwrap();
    let mut bad = Client::open(&server.socket, Mode::Structured, false).unwrap();
    bad.send_raw(b"this is not an NBD request at all....")
        .unwrap();
    assert!(
        bad.wait_closed(),
        "server keeps talking to a client sending garbage"
    );
    eventually("protocol error counted", || {
        server.handle().stats().protocol_errors == 1
    });
    assert_serving(&mut good);
    good.disconnect().unwrap();
}

#[test]
fn commands_before_negotiation_ends_disconnect() {
    let (server, _export) = TestServer::mem(SIZE);
    // A request where an option belongs.
    let mut c = Client::connect(&server.socket).unwrap();
    c.send_raw(&request(false, 0, CMD_READ, 1, 0, 512)).unwrap();
    assert!(c.wait_closed());
    // A request before even the client flags.
    let mut raw = UnixStream::connect(&server.socket).unwrap();
    let mut greeting = [0u8; 18];
    raw.read_exact(&mut greeting).unwrap();
    raw.write_all(&request(false, 0, CMD_WRITE, 1, 0, 512))
        .unwrap();
    assert!(closed_by_server(&mut raw));
    eventually("both counted", || {
        server.handle().stats().protocol_errors == 2
    });
    let mut good = Client::open(&server.socket, Mode::Simple, false).unwrap();
    assert_serving(&mut good);
}

#[test]
fn huge_option_and_name_lengths_disconnect_at_once() {
    let (server, _export) = TestServer::mem(SIZE);
    for header in [
        option_header(OPT_GO, 0xffff_ffff),
        option_header(OPT_EXPORT_NAME, 4097),
    ] {
        let mut c = Client::connect(&server.socket).unwrap();
        let started = Instant::now();
        c.send_raw(&header).unwrap();
        assert!(c.wait_closed());
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "server waited for the claimed data"
        );
    }
    // A GO whose inner name length is huge gets an error reply, and the
    // client can carry on.
    let mut c = Client::connect(&server.socket).unwrap();
    let mut data = Vec::new();
    be32(&mut data, 0xffff_ffff);
    be16(&mut data, 0);
    let replies = c.option(OPT_GO, &data).unwrap();
    assert_eq!(replies.last().unwrap().reply_type, REP_ERR_TOO_BIG);
    c.negotiate(Mode::Simple, false).unwrap();
    assert_serving(&mut c);
}

#[test]
fn oversized_write_payload_is_consumed_and_refused() {
    let export = Arc::new(MemExport::new(SIZE));
    let config = ServerConfig {
        max_payload_bytes: 1 << 20,
        ..ServerConfig::default()
    };
    let server = TestServer::start(export, config);
    for mode in [Mode::Simple, Mode::Structured, Mode::Extended] {
        let mut c = Client::open(&server.socket, mode, false).unwrap();
        let big = vec![0x5au8; (1 << 20) + 4096];
        let r = c.call(0, CMD_WRITE, 0, big.len() as u64, &big).unwrap();
        assert_eq!(r.error, NBD_EINVAL, "{mode:?}");
        if mode != Mode::Simple {
            assert!(!r.message.is_empty(), "structured errors carry a message");
        }
        // The payload was skipped, so the stream is still framed.
        assert_serving(&mut c);
        assert_eq!(
            c.read(0, 4096).unwrap().unwrap(),
            vec![0u8; 4096],
            "refused write must not land"
        );
        // A read over the maximum is refused too.
        assert_eq!(c.read(0, (1 << 20) + 512).unwrap(), Err(NBD_EINVAL));
    }
}

#[test]
fn write_too_large_to_skip_closes_only_that_connection() {
    let (server, _export) = TestServer::mem(SIZE);
    let mut good = Client::open(&server.socket, Mode::Simple, false).unwrap();
    let mut bad = Client::open(&server.socket, Mode::Simple, false).unwrap();
    bad.send_raw(&request(false, 0, CMD_WRITE, 1, 0, 0xffff_fff0))
        .unwrap();
    assert!(bad.wait_closed());
    assert_serving(&mut good);
}

#[test]
fn client_vanishing_mid_payload_ends_just_that_connection() {
    let (server, export) = TestServer::mem(SIZE);
    let mut good = Client::open(&server.socket, Mode::Structured, false).unwrap();
    {
        let mut c = Client::open(&server.socket, Mode::Structured, false).unwrap();
        let mut bytes = request(false, 0, CMD_WRITE, 1, 0, 65536);
        bytes.extend_from_slice(&[1u8; 1000]);
        c.send_raw(&bytes).unwrap();
        // dropped here: EOF inside the payload
    }
    eventually("half-written connection gone", || {
        server.handle().active_connections() == 1
    });
    assert_eq!(
        export.counters.writes.load(Ordering::SeqCst),
        0,
        "a partial payload must never be written"
    );
    assert_serving(&mut good);
    good.disconnect().unwrap();
    eventually("all connections gone", || {
        server.handle().active_connections() == 0
    });
    assert_eq!(
        server.handle().stats().protocol_errors,
        0,
        "a vanished client is not a protocol error"
    );
}

#[test]
fn zero_length_requests_succeed_without_disconnect() {
    let (server, export) = TestServer::mem(SIZE);
    for mode in [Mode::Simple, Mode::Structured, Mode::Extended] {
        let mut c = Client::open(&server.socket, mode, mode != Mode::Simple).unwrap();
        for cmd in [CMD_READ, CMD_WRITE, CMD_TRIM, CMD_WRITE_ZEROES, CMD_CACHE] {
            let r = c.call(0, cmd, 4096, 0, &[]).unwrap();
            assert_eq!(r.error, 0, "{mode:?} {}", command_name(cmd));
        }
        if mode != Mode::Simple {
            assert_eq!(
                c.call(0, CMD_BLOCK_STATUS, 0, 0, &[]).unwrap().error,
                NBD_EINVAL
            );
        }
        assert_serving(&mut c);
    }
    assert_eq!(
        export.counters.trims.load(Ordering::SeqCst),
        0,
        "zero-length work never reaches the export"
    );
}

#[test]
fn unknown_commands_flags_and_out_of_range_requests_get_errors() {
    let (server, _export) = TestServer::mem(SIZE);
    for mode in [Mode::Simple, Mode::Structured, Mode::Extended] {
        let mut c = Client::open(&server.socket, mode, false).unwrap();
        assert_eq!(c.call(0, 42, 0, 512, &[]).unwrap().error, NBD_EINVAL);
        assert_eq!(
            c.call(1 << 12, CMD_READ, 0, 512, &[]).unwrap().error,
            NBD_EINVAL
        );
        assert_eq!(
            c.call(CMD_FLAG_REQ_ONE, CMD_WRITE, 0, 512, &[0u8; 512])
                .unwrap()
                .error,
            NBD_EINVAL
        );
        // The client asked for block sizes, so it promised alignment.
        assert_eq!(
            c.call(0, CMD_WRITE, 1, 4, b"abcd").unwrap().error,
            NBD_EINVAL
        );
        assert_eq!(c.read(SIZE - 512, 1024).unwrap(), Err(NBD_EINVAL));
        assert_eq!(
            c.call(0, CMD_TRIM, SIZE, 512, &[]).unwrap().error,
            NBD_EINVAL
        );
        assert_eq!(c.write(SIZE - 512, &[1u8; 1024]).unwrap(), NBD_ENOSPC);
        assert_eq!(
            c.call(0, CMD_WRITE_ZEROES, SIZE - 512, 1024, &[])
                .unwrap()
                .error,
            NBD_ENOSPC
        );
        assert_eq!(c.call(0, CMD_FLUSH, 512, 0, &[]).unwrap().error, NBD_EINVAL);
        // BLOCK_STATUS without SET_META_CONTEXT.
        if mode != Mode::Simple {
            assert_eq!(
                c.call(0, CMD_BLOCK_STATUS, 0, 512, &[]).unwrap().error,
                NBD_EINVAL
            );
        }
        assert_serving(&mut c);
    }
    assert_eq!(server.handle().stats().protocol_errors, 0);
}

/// Offsets and lengths chosen so that `offset + length` overflows u64 (or
/// sits right at the edge), for every command, with 64-bit lengths: each
/// gets an error reply, never a panic or a wrapped range, and the
/// connection goes on serving.
#[test]
fn requests_whose_end_overflows_u64_get_errors() {
    let (server, export) = TestServer::mem(SIZE);
    let mut c = Client::open(&server.socket, Mode::Extended, true).unwrap();
    let near_max = u64::MAX - 511;
    for command in [
        CMD_READ,
        CMD_TRIM,
        CMD_WRITE_ZEROES,
        CMD_CACHE,
        CMD_BLOCK_STATUS,
    ] {
        for (offset, length) in [
            (near_max, 1024),
            (u64::MAX, 1),
            (4096, u64::MAX),
            (SIZE, u64::MAX),
        ] {
            let r = c.call(0, command, offset, length, &[]).unwrap();
            assert_ne!(r.error, 0, "command {command} at {offset} length {length}");
        }
    }
    // A write whose end overflows: the payload is read and dropped.
    assert_eq!(
        c.call(0, CMD_WRITE, near_max, 1024, &[7u8; 1024])
            .unwrap()
            .error,
        NBD_ENOSPC
    );
    // Past the end from 0 is an error too (not answered for a wrapped range).
    let r = c.call(0, CMD_BLOCK_STATUS, 0, u64::MAX, &[]).unwrap();
    assert_eq!(r.error, NBD_EINVAL);
    assert_eq!(export.allocated_chunks(), 0, "nothing reached the export");
    assert_serving(&mut c);
    assert_eq!(server.handle().stats().protocol_errors, 0);
}

#[test]
fn handshake_timeout_closes_a_silent_client() {
    let export = Arc::new(MemExport::new(SIZE));
    let config = ServerConfig {
        handshake_timeout_ms: 200,
        ..ServerConfig::default()
    };
    let server = TestServer::start(export, config);
    let mut raw = UnixStream::connect(&server.socket).unwrap();
    let started = Instant::now();
    assert!(closed_by_server(&mut raw));
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(150) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    // A client trickling bytes is held to the same total deadline.
    let mut c = Client::connect(&server.socket).unwrap();
    let started = Instant::now();
    let go = option(OPT_GO, &info_data("", &[]));
    for b in go.iter().take(go.len() - 1) {
        if c.send_raw(&[*b]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        if started.elapsed() > Duration::from_secs(2) {
            break;
        }
    }
    assert!(c.wait_closed());
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[test]
fn too_many_connections_are_refused() {
    let export = Arc::new(MemExport::new(SIZE));
    let config = ServerConfig {
        max_connections: 1,
        ..ServerConfig::default()
    };
    let server = TestServer::start(export, config);
    let mut first = Client::open(&server.socket, Mode::Simple, false).unwrap();
    // A second client may start its handshake, but is closed instead of
    // entering transmission: it gets no reply to its GO.
    assert!(Client::open(&server.socket, Mode::Simple, false).is_err());
    assert_eq!(server.handle().stats().connections_refused, 1);
    assert_serving(&mut first);
    first.disconnect().unwrap();
    eventually("slot free", || server.handle().active_connections() == 0);
    let mut third = Client::open(&server.socket, Mode::Simple, false).unwrap();
    assert_serving(&mut third);
}

#[test]
fn handshakes_that_never_finish_do_not_lock_out_real_clients() {
    let export = Arc::new(MemExport::new(SIZE));
    let config = ServerConfig {
        max_connections: 4,
        max_handshakes: 8,
        max_handshakes_per_peer: 4,
        ..ServerConfig::default()
    };
    let server = TestServer::start(export, config);
    let mut working = Client::open(&server.socket, Mode::Structured, false).unwrap();
    // 100 connections that never say a word, far more than the handshake
    // limit (and the established one).
    let mut silent: Vec<UnixStream> = (0..100)
        .map(|_| UnixStream::connect(&server.socket).unwrap())
        .collect();
    // The established client goes on, and new clients still get in, each
    // pushing out the oldest silent handshakes.
    for i in 0..3u64 {
        assert_eq!(working.write(i * 4096, &pattern(i as u8, 4096)).unwrap(), 0);
        let mut fresh = Client::open(&server.socket, Mode::Simple, false).unwrap();
        assert_serving(&mut fresh);
        fresh.disconnect().unwrap();
    }
    assert_serving(&mut working);
    let stats = server.handle().stats();
    assert!(
        stats.handshakes_evicted >= 90,
        "the silent handshakes were pushed out: {stats:?}"
    );
    assert!(stats.connections_handshaking <= 8, "{stats:?}");
    // The oldest silent ones see their socket closed.
    assert!(closed_by_server(&mut silent[0]));
    drop(silent);
    working.disconnect().unwrap();
}

// ------------------------------------------------------ replies & flow ---

#[test]
fn pipelined_requests_are_answered_out_of_order_within_the_in_flight_bound() {
    let export = Instrumented::new(SIZE);
    let config = ServerConfig {
        max_in_flight_per_connection: 3,
        ..ServerConfig::default()
    };
    let server = TestServer::start(export.clone(), config);
    let mut c = Client::open(&server.socket, Mode::Structured, false).unwrap();
    for i in 0..32u64 {
        assert_eq!(c.write(i * 4096, &pattern(i as u8, 4096)).unwrap(), 0);
    }
    // The first read is slow, so later ones overtake it.
    export.slow_read_offset.store(0, Ordering::SeqCst);
    export.slow_read_ms.store(300, Ordering::SeqCst);
    export.peak.store(0, Ordering::SeqCst);

    let replies = c.pipelined_reads(32);
    for r in &replies {
        assert_eq!(r.error, 0);
        let i = r.cookie - 1000;
        assert_eq!(
            r.data,
            pattern(i as u8, 4096),
            "reply matched to the wrong request"
        );
    }
    assert_ne!(
        replies[0].cookie, 1000,
        "the slow first read should have been overtaken"
    );
    let peak = export.peak.load(Ordering::SeqCst);
    assert!(
        (2..=3).contains(&peak),
        "in-flight bound not respected: {peak} concurrent calls"
    );
    // The reader paused at the bound, and the counter says so.
    let stats = server.handle().stats();
    assert!(
        stats.in_flight_limit_waits >= 1,
        "hitting the in-flight bound is counted: {stats:?}"
    );
    assert_eq!(stats.max_in_flight_per_connection, 3);
    // A request gives its budget back once its reply has been sent, which
    // can be a moment after the client has read it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut buffered = stats.buffered_bytes;
    while buffered != 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
        buffered = server.handle().stats().buffered_bytes;
    }
    assert_eq!(buffered, 0, "every request gave its budget back");
}

/// Pipelined reads are in flight together on the connection's event loop:
/// a slow read is overtaken, a failed read fails alone, and every read is
/// answered exactly once with its own data.
#[test]
fn pipelined_reads_run_together_and_a_slow_one_does_not_hold_up_the_rest() {
    let export = Instrumented::new(SIZE);
    let config = ServerConfig {
        max_in_flight_per_connection: 16,
        ..ServerConfig::default()
    };
    let server = TestServer::start(export.clone(), config);
    for mode in [Mode::Simple, Mode::Structured] {
        let mut c = Client::open(&server.socket, mode, false).unwrap();
        for i in 0..64u64 {
            assert_eq!(c.write(i * 4096, &pattern(i as u8, 4096)).unwrap(), 0);
        }
        export.slow_read_offset.store(0, Ordering::SeqCst);
        export.slow_read_ms.store(300, Ordering::SeqCst);
        export.read_error_offset.store(5 * 4096, Ordering::SeqCst);
        export.peak.store(0, Ordering::SeqCst);
        let replies = c.pipelined_reads(64);
        for r in &replies {
            let i = r.cookie - 1000;
            if i == 5 {
                assert_ne!(r.error, 0, "the injected failure is reported");
            } else {
                assert_eq!(r.error, 0, "read {i}");
                assert_eq!(
                    r.data,
                    pattern(i as u8, 4096),
                    "reply matched to the wrong request"
                );
            }
        }
        assert_eq!(replies.len(), 64, "every read answered once");
        assert_ne!(
            replies[0].cookie, 1000,
            "the slow read should have been overtaken"
        );
        assert!(
            export.peak.load(Ordering::SeqCst) > 1,
            "pipelined reads were not in flight together"
        );
        export.slow_read_ms.store(0, Ordering::SeqCst);
        c.disconnect().unwrap();
    }
}

/// Large writes make the server receive the next header on its own (so
/// the payload after it lands straight in its buffer): pipelined writes of
/// every size around that threshold, mixed with reads and flushes, sent in
/// one stream and again cut into small pieces, in both header formats,
/// each store the bytes it carried and get one reply.
#[test]
fn pipelined_large_and_small_writes_keep_their_bytes_however_the_stream_is_cut() {
    let (server, _mem) = TestServer::mem(SIZE);
    // Around the threshold (16 KiB) in steps of the minimum block size.
    let lengths: [u64; 8] = [65536, 16384, 15872, 16896, 512, 20480, 4096, 131072];
    for (mode, cut) in [
        (Mode::Simple, None),
        (Mode::Extended, None),
        (Mode::Simple, Some(13)),
        (Mode::Extended, Some(7)),
    ] {
        let mut c = Client::open(&server.socket, mode, false).unwrap();
        let extended = mode == Mode::Extended;
        let mut stream_bytes = Vec::new();
        let mut expected = Vec::new();
        let mut offset = 0u64;
        for (k, &length) in lengths.iter().cycle().take(40).enumerate() {
            let cookie = 5000 + k as u64;
            let data = pattern(k as u8 ^ length as u8, length as usize);
            stream_bytes.extend(request(extended, 0, CMD_WRITE, cookie, offset, length));
            stream_bytes.extend_from_slice(&data);
            c.expect_reply(cookie, CMD_WRITE, offset, length);
            // A small request right behind a large payload, every other time.
            if k % 2 == 1 {
                let cookie = 9000 + k as u64;
                let (command, length) = if k % 4 == 1 {
                    (CMD_READ, 4096)
                } else {
                    (CMD_FLUSH, 0)
                };
                stream_bytes.extend(request(extended, 0, command, cookie, 0, length));
                c.expect_reply(cookie, command, 0, length);
            }
            expected.push((offset, data));
            offset += length + 4096;
        }
        let replies_due = c.pending_count();
        let mut writer = c.stream.try_clone().unwrap();
        let sender = std::thread::spawn(move || match cut {
            None => writer.write_all(&stream_bytes),
            Some(piece) => stream_bytes.chunks(piece).try_for_each(|bytes| {
                writer.write_all(bytes)?;
                writer.flush()
            }),
        });
        for _ in 0..replies_due {
            let r = c.reply().expect("a reply");
            assert_eq!(
                r.error, 0,
                "request {} failed ({mode:?}, cut {cut:?})",
                r.cookie
            );
        }
        sender.join().unwrap().unwrap();
        assert_eq!(c.pending_count(), 0, "every request answered once");
        for (offset, data) in &expected {
            let got = c.read(*offset, data.len() as u64).unwrap().unwrap();
            assert!(got == *data, "bytes at {offset} ({mode:?}, cut {cut:?})");
        }
        assert_serving(&mut c);
        c.disconnect().unwrap();
    }
}

#[test]
fn extended_headers_round_trip_with_64_bit_lengths_and_block_status() {
    let size = 8u64 << 30; // sparse: nothing is allocated up front
    let export = Arc::new(MemExport::new(size));
    let server = TestServer::start(export.clone(), ServerConfig::default());
    let mut c = Client::open(&server.socket, Mode::Extended, true).unwrap();
    assert_eq!(c.size_bytes, size);
    let data = pattern(3, 8192);
    // qemu-style (no PAYLOAD_LEN) and spec-style writes both work.
    assert_eq!(
        c.call(0, CMD_WRITE, 0, 4096, &data[..4096]).unwrap().error,
        0
    );
    assert_eq!(
        c.call(CMD_FLAG_PAYLOAD_LEN, CMD_WRITE, 4096, 4096, &data[4096..])
            .unwrap()
            .error,
        0
    );
    assert_eq!(c.read(0, 8192).unwrap().unwrap(), data);
    // A zeroing request longer than 4 GiB needs the 64-bit length.
    assert_eq!(
        c.call(0, CMD_WRITE_ZEROES, 1 << 30, 5 << 30, &[])
            .unwrap()
            .error,
        0
    );
    let r = c.call(0, CMD_BLOCK_STATUS, 0, 1 << 20, &[]).unwrap();
    assert_eq!(r.error, 0);
    assert_eq!(r.context_id, Some(1));
    assert_eq!(r.descriptors[0], (8192, 0));
    assert_eq!(
        r.descriptors[1],
        ((1 << 20) - 8192, (STATE_HOLE | STATE_ZERO) as u64)
    );
    let r = c
        .call(CMD_FLAG_REQ_ONE, CMD_BLOCK_STATUS, 0, 100, &[])
        .unwrap();
    assert_eq!(r.descriptors, vec![(100, 0)]);
    // Reading past 4 GiB works (offsets were always 64-bit).
    assert_eq!(c.write(6 << 30, &data[..512]).unwrap(), 0);
    assert_eq!(c.read(6 << 30, 512).unwrap().unwrap(), data[..512].to_vec());
}

#[test]
fn block_status_is_capped() {
    let export = Arc::new(MemExport::new(SIZE));
    let config = ServerConfig {
        max_block_status_extents: 4,
        ..ServerConfig::default()
    };
    let server = TestServer::start(export.clone(), config);
    let mut c = Client::open(&server.socket, Mode::Structured, true).unwrap();
    for i in 0..16u64 {
        assert_eq!(c.write(i * 8192, &[1u8; 4096]).unwrap(), 0);
    }
    let r = c.call(0, CMD_BLOCK_STATUS, 0, SIZE, &[]).unwrap();
    assert_eq!(r.descriptors.len(), 4);
    assert_eq!(r.descriptors.iter().map(|d| d.0).sum::<u64>(), 16384);
    let r = c.call(0, CMD_BLOCK_STATUS, 4096, 4096, &[]).unwrap();
    assert_eq!(
        r.descriptors,
        vec![(4096, (STATE_HOLE | STATE_ZERO) as u64)]
    );
}

#[test]
fn export_errors_reach_the_client_as_nbd_errors() {
    let (server, export) = TestServer::mem(SIZE);
    let mut s = Client::open(&server.socket, Mode::Structured, true).unwrap();
    export.fail_next(MemOp::Write, libc::EIO);
    let r = s.call(0, CMD_WRITE, 0, 512, &[1u8; 512]).unwrap();
    assert_eq!(r.error, NBD_EIO);
    assert!(r.message.contains("injected"), "{:?}", r.message);
    export.fail_next(MemOp::Read, libc::EDQUOT);
    assert_eq!(s.read(0, 512).unwrap(), Err(NBD_ENOSPC));
    export.fail_next(MemOp::WriteZeroes, libc::ENOTSUP);
    assert_eq!(
        s.call(CMD_FLAG_FAST_ZERO, CMD_WRITE_ZEROES, 0, 4096, &[])
            .unwrap()
            .error,
        NBD_ENOTSUP
    );
    export.fail_next(MemOp::BlockStatus, libc::EBADF);
    assert_eq!(
        s.call(0, CMD_BLOCK_STATUS, 0, 4096, &[]).unwrap().error,
        NBD_EIO,
        "unknown errnos become EIO"
    );
    export.fail_next(MemOp::Flush, libc::EIO);
    assert_eq!(s.call(0, CMD_FLUSH, 0, 0, &[]).unwrap().error, NBD_EIO);
    let mut simple = Client::open(&server.socket, Mode::Simple, false).unwrap();
    export.fail_next(MemOp::Read, libc::EIO);
    assert_eq!(simple.read(0, 4096).unwrap(), Err(NBD_EIO));
    assert_serving(&mut simple);
    assert_serving(&mut s);
}

#[test]
fn fua_trim_and_zeroes_reach_the_export() {
    let (server, export) = TestServer::mem(SIZE);
    let mut c = Client::open(&server.socket, Mode::Structured, true).unwrap();
    assert_eq!(
        c.call(CMD_FLAG_FUA, CMD_WRITE, 0, 4096, &[7u8; 4096])
            .unwrap()
            .error,
        0
    );
    assert_eq!(export.counters.fua_writes.load(Ordering::SeqCst), 1);
    let flushes = export.counters.flushes.load(Ordering::SeqCst);
    assert_eq!(
        c.call(CMD_FLAG_FUA, CMD_TRIM, 0, 4096, &[]).unwrap().error,
        0
    );
    assert_eq!(
        export.counters.flushes.load(Ordering::SeqCst),
        flushes + 1,
        "FUA on TRIM flushes"
    );
    assert_eq!(export.allocated_chunks(), 0);
    assert_eq!(c.write(0, &[7u8; 8192]).unwrap(), 0);
    assert_eq!(
        c.call(CMD_FLAG_NO_HOLE, CMD_WRITE_ZEROES, 0, 4096, &[])
            .unwrap()
            .error,
        0
    );
    assert_eq!(c.read(0, 4096).unwrap().unwrap(), vec![0u8; 4096]);
    assert_eq!(
        export.allocated_chunks(),
        2,
        "NO_HOLE keeps the zeroed range allocated"
    );
    assert_eq!(c.call(0, CMD_CACHE, 0, 1 << 20, &[]).unwrap().error, 0);
    assert_eq!(export.counters.caches.load(Ordering::SeqCst), 1);
}

#[test]
fn read_only_export_refuses_writes() {
    let export = Arc::new(MemExport::new(SIZE));
    let config = ServerConfig {
        read_only: true,
        ..ServerConfig::default()
    };
    let server = TestServer::start(export, config);
    let mut c = Client::open(&server.socket, Mode::Structured, false).unwrap();
    assert_ne!(c.transmission_flags & FLAG_READ_ONLY, 0);
    assert_eq!(c.write(0, &[1u8; 512]).unwrap(), NBD_EPERM);
    assert_eq!(c.call(0, CMD_TRIM, 0, 512, &[]).unwrap().error, NBD_EPERM);
    assert_eq!(c.read(0, 512).unwrap().unwrap(), vec![0u8; 512]);
}

#[test]
fn disc_finishes_in_flight_requests_then_closes() {
    let export = Instrumented::new(SIZE);
    export.write_delay_ms.store(300, Ordering::SeqCst);
    let server = TestServer::start(export.clone(), ServerConfig::default());
    let mut c = Client::open(&server.socket, Mode::Simple, false).unwrap();
    let data = pattern(5, 4096);
    let cookie = c.send(0, CMD_WRITE, 0, 4096, &data).unwrap();
    c.send_raw(&request(false, 0, CMD_DISC, 99, 0, 0)).unwrap();
    let r = c.reply().unwrap();
    assert_eq!((r.cookie, r.error), (cookie, 0));
    assert!(c.wait_closed());
    let mut back = vec![0u8; 4096];
    export.read(0, &mut back).unwrap();
    assert_eq!(back, data);
}

#[test]
fn abort_during_negotiation_is_acked() {
    let (server, _export) = TestServer::mem(SIZE);
    let mut c = Client::connect(&server.socket).unwrap();
    let replies = c.option(OPT_ABORT, &[]).unwrap();
    assert_eq!(replies[0].reply_type, REP_ACK);
    assert!(c.wait_closed());
}

// ------------------------------------------------------------ shutdown ---

#[test]
fn shutdown_finishes_in_flight_requests_cuts_idle_clients_and_flushes() {
    let export = Instrumented::new(SIZE);
    export.write_delay_ms.store(400, Ordering::SeqCst);
    let mut server = TestServer::start(export.clone(), ServerConfig::default());
    // An idle client mid-handshake and one idle in transmission: neither
    // may hold shutdown up (CVE-2024-7409).
    let mut idle_handshake = Client::connect(&server.socket).unwrap();
    let mut idle = Client::open(&server.socket, Mode::Structured, false).unwrap();
    let mut busy = Client::open(&server.socket, Mode::Structured, false).unwrap();
    let data = pattern(1, 65536);
    let cookie = busy
        .send(CMD_FLAG_FUA, CMD_WRITE, 0, data.len() as u64, &data)
        .unwrap();
    eventually("write reached the export", || {
        export.current.load(Ordering::SeqCst) == 1
    });

    let flushes_before = export.inner.counters.flushes.load(Ordering::SeqCst);
    let started = Instant::now();
    server.shutdown();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(5), "shutdown took {took:?}");
    // The in-flight write completed and was answered before the close.
    let r = busy.reply().unwrap();
    assert_eq!((r.cookie, r.error), (cookie, 0));
    assert!(busy.wait_closed());
    assert!(idle.wait_closed());
    assert!(idle_handshake.wait_closed());
    assert!(
        export.inner.counters.flushes.load(Ordering::SeqCst) > flushes_before,
        "shutdown flushes the export"
    );
    let mut back = vec![0u8; data.len()];
    export.read(0, &mut back).unwrap();
    assert_eq!(back, data);
    assert!(!server.socket.exists(), "the socket file is removed");
}

#[test]
fn stop_when_idle_stops_after_the_last_client() {
    init_tracing();
    let dir = TempDir::new("idle");
    let socket = dir.path("s.sock");
    let config = ServerConfig {
        stop_when_idle: true,
        ..ServerConfig::default()
    };
    let handle = serve(
        Arc::new(MemExport::new(SIZE)),
        Listener::bind_unix(&socket).unwrap(),
        config,
    )
    .unwrap();
    let waiter = std::thread::spawn(move || handle.wait());
    let mut a = Client::open(&socket, Mode::Simple, false).unwrap();
    let mut b = Client::open(&socket, Mode::Simple, false).unwrap();
    assert_serving(&mut a);
    a.disconnect().unwrap();
    assert_serving(&mut b);
    b.disconnect().unwrap();
    waiter.join().unwrap().unwrap();
    assert!(!socket.exists());
}

// ----------------------------------------------------------- listeners ---

#[test]
fn unix_socket_path_rules() {
    init_tracing();
    let dir = TempDir::new("paths");
    let socket = dir.path("nbd.sock");
    let export: Arc<dyn Export> = Arc::new(MemExport::new(SIZE));

    // A stale socket file (its listener is gone) is replaced.
    drop(UnixListener::bind(&socket).unwrap());
    assert!(socket.exists());
    let live = serve(
        export.clone(),
        Listener::bind_unix(&socket).unwrap(),
        ServerConfig::default(),
    )
    .unwrap();
    // A live server's path is refused, and left alone.
    match Listener::bind_unix(&socket) {
        Err(ServerError::SocketInUse { .. }) => {}
        other => panic!("expected SocketInUse, got {other:?}"),
    }
    let mut c = Client::open(&socket, Mode::Simple, false).unwrap();
    assert_serving(&mut c);
    c.disconnect().unwrap();
    live.shutdown().unwrap();
    assert!(!socket.exists(), "socket removed at shutdown");

    // Something that is not a socket is never replaced.
    let file = dir.path("not-a-socket");
    std::fs::write(&file, b"precious").unwrap();
    match Listener::bind_unix(&file) {
        Err(ServerError::NotASocket { .. }) => {}
        other => panic!("expected NotASocket, got {other:?}"),
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"precious");
}

#[test]
fn tcp_listener_serves() {
    init_tracing();
    let listener = Listener::bind_tcp("127.0.0.1:0").unwrap();
    let addr = listener.tcp_local_addr().unwrap();
    let handle = serve(
        Arc::new(MemExport::new(SIZE)),
        listener,
        ServerConfig::default(),
    )
    .unwrap();
    let stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut c = Client::over(stream).unwrap();
    c.negotiate(Mode::Extended, true).unwrap();
    let data = pattern(4, 1 << 20);
    assert_eq!(
        c.call(0, CMD_WRITE, 0, data.len() as u64, &data)
            .unwrap()
            .error,
        0
    );
    let r = c.call(0, CMD_READ, 0, data.len() as u64, &[]).unwrap();
    assert_eq!(r.data, data);
    c.disconnect().unwrap();
    handle.shutdown().unwrap();
}

#[test]
fn config_validation_rejects_inconsistent_limits() {
    let bad = [
        ServerConfig {
            max_in_flight_per_connection: 0,
            ..ServerConfig::default()
        },
        ServerConfig {
            min_block_bytes: 1000,
            ..ServerConfig::default()
        },
        ServerConfig {
            preferred_block_bytes: 256,
            ..ServerConfig::default()
        },
        ServerConfig {
            max_payload_bytes: 1024,
            ..ServerConfig::default()
        },
        ServerConfig {
            max_buffered_bytes: 1 << 20,
            ..ServerConfig::default()
        },
        ServerConfig {
            max_name_bytes: 5000,
            ..ServerConfig::default()
        },
        ServerConfig {
            max_discard_bytes: 0,
            ..ServerConfig::default()
        },
    ];
    for config in bad {
        assert!(
            matches!(config.validate(), Err(ServerError::Config(_))),
            "{config:?}"
        );
    }
    ServerConfig::default().validate().unwrap();
}

/// A client that sends reads and never reads the replies is dropped after
/// `write_timeout_ms` of no progress, while others are served meanwhile
/// (the deadline is shared by the connection's sends, so this is the test
/// of that sharing too).
#[test]
fn a_client_that_stops_reading_replies_is_dropped_after_the_write_timeout() {
    let export = Arc::new(MemExport::new(SIZE));
    let config = ServerConfig {
        write_timeout_ms: 300,
        ..ServerConfig::default()
    };
    let server = TestServer::start(export, config);
    let mut stuck = Client::open(&server.socket, Mode::Structured, false).unwrap();
    // Far more reply bytes than the socket buffers hold.
    let started = Instant::now();
    for i in 0..64u64 {
        stuck
            .send(0, CMD_READ, (i % 16) * (1 << 20), 1 << 20, &[])
            .unwrap();
    }
    let mut other = Client::open(&server.socket, Mode::Structured, false).unwrap();
    for i in 0..20u64 {
        assert_eq!(other.write(i * 4096, &pattern(i as u8, 4096)).unwrap(), 0);
        std::thread::sleep(Duration::from_millis(20));
    }
    // The stuck client's socket is shut by the server: draining it ends in
    // EOF (or a reset) well before 30 s.
    assert!(
        closed_by_server(&mut stuck.stream),
        "the server kept a client that reads nothing"
    );
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(300), "dropped after {took:?}");
    assert!(
        took < Duration::from_secs(20),
        "dropped only after {took:?}"
    );
    assert_eq!(other.read(0, 4096).unwrap().unwrap(), pattern(0, 4096));
}
