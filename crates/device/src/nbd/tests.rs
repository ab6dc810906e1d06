//! The client against scripted servers, for handshake paths nbdkit cannot
//! show us. (The nbdkit tests are in `tests/nbd_client_nbdkit.rs`.)

use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cairn_nbd_proto::codec::option::{encode_option_reply, Info};
use cairn_nbd_proto::codec::reply::encode_simple;
use cairn_nbd_proto::codec::wire::COMPACT_REQUEST_BYTES;
use cairn_nbd_proto::codec::BlockSizes;
use cairn_nbd_proto::proto::{
    CMD_DISC, CMD_READ, FLAG_CAN_MULTI_CONN, FLAG_C_FIXED_NEWSTYLE, FLAG_C_NO_ZEROES,
    FLAG_FIXED_NEWSTYLE, FLAG_HAS_FLAGS, FLAG_NO_ZEROES, FLAG_READ_ONLY, FLAG_SEND_FLUSH, IHAVEOPT,
    NBDMAGIC, OPT_ABORT, OPT_EXPORT_NAME, OPT_GO, REP_ACK, REP_ERR_UNKNOWN, REP_ERR_UNSUP,
    REP_INFO,
};

use super::handshake::read_u64;
use super::{NbdDevice, NbdOptions};
use crate::{Device, DeviceError};

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

/// A fresh unix socket to script a server on.
fn fake_listener(tag: &str) -> (PathBuf, UnixListener) {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!(
        "cairn-nbd-fake-{tag}-{}-{}.sock",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    (path, listener)
}

/// A scripted server for handshake paths nbdkit cannot show us.
fn fake_server(
    script: impl FnOnce(&mut UnixStream) + Send + 'static,
) -> (PathBuf, std::thread::JoinHandle<()>) {
    let (path, listener) = fake_listener("one");
    let handle = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        script(&mut stream);
    });
    (path, handle)
}

fn greet(stream: &mut UnixStream, handshake_flags: u16) {
    stream.write_all(&NBDMAGIC.to_be_bytes()).unwrap();
    stream.write_all(&IHAVEOPT.to_be_bytes()).unwrap();
    stream.write_all(&handshake_flags.to_be_bytes()).unwrap();
    let client_flags = read_u32(stream).unwrap();
    assert_eq!(
        client_flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES),
        0
    );
}

fn read_option(stream: &mut UnixStream) -> (u32, Vec<u8>) {
    assert_eq!(read_u64(stream).unwrap(), IHAVEOPT);
    let option = read_u32(stream).unwrap();
    let len = read_u32(stream).unwrap();
    let mut data = vec![0u8; len as usize];
    stream.read_exact(&mut data).unwrap();
    (option, data)
}

fn option_reply(stream: &mut UnixStream, option: u32, reply: u32, data: &[u8]) {
    let mut out = Vec::new();
    encode_option_reply(&mut out, option, reply, data);
    stream.write_all(&out).unwrap();
}

fn info_reply(stream: &mut UnixStream, info: Info<'_>) {
    let mut payload = Vec::new();
    info.encode(&mut payload);
    option_reply(stream, OPT_GO, REP_INFO, &payload);
}

/// Serve reads of a zero export until the client disconnects.
fn serve_zeroes(stream: &mut UnixStream) {
    loop {
        let mut header = [0u8; COMPACT_REQUEST_BYTES];
        if stream.read_exact(&mut header).is_err() {
            return;
        }
        let command = u16::from_be_bytes([header[6], header[7]]);
        let len = u32::from_be_bytes([header[24], header[25], header[26], header[27]]);
        if command == CMD_DISC {
            return;
        }
        let cookie = u64::from_be_bytes(header[8..16].try_into().unwrap());
        let mut reply = Vec::new();
        encode_simple(&mut reply, cookie, 0);
        stream.write_all(&reply).unwrap();
        if command == CMD_READ {
            stream.write_all(&vec![0u8; len as usize]).unwrap();
        }
    }
}

fn quick() -> NbdOptions {
    NbdOptions {
        request_timeout_ms: 2_000,
        connect_timeout_ms: 2_000,
        ..NbdOptions::default()
    }
}

#[test]
fn falls_back_to_export_name_when_go_is_unsupported() {
    let (path, server) = fake_server(|stream| {
        greet(stream, FLAG_FIXED_NEWSTYLE);
        let (option, data) = read_option(stream);
        assert_eq!(option, OPT_GO);
        assert_eq!(&data[4..8], b"disk");
        option_reply(stream, OPT_GO, REP_ERR_UNSUP, b"");
        let (option, data) = read_option(stream);
        assert_eq!(option, OPT_EXPORT_NAME);
        assert_eq!(data, b"disk");
        stream.write_all(&(1u64 << 20).to_be_bytes()).unwrap();
        stream
            .write_all(&(FLAG_HAS_FLAGS | FLAG_SEND_FLUSH).to_be_bytes())
            .unwrap();
        // No NO_ZEROES was offered, so the 124 zero bytes follow.
        stream.write_all(&[0u8; 124]).unwrap();
        serve_zeroes(stream);
    });
    let uri = format!("nbd+unix:///disk?socket={}", path.display());
    let device = NbdDevice::open_with(&uri, quick()).unwrap();
    assert_eq!(device.size_bytes(), 1 << 20);
    let mut buf = vec![1u8; 4096];
    device.read_at(8192, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    device.flush().unwrap();
    drop(device);
    server.join().unwrap();
    let _ = std::fs::remove_file(&path);
}

#[test]
fn go_info_sets_size_and_block_limits() {
    let (path, server) = fake_server(|stream| {
        greet(stream, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        let (option, _) = read_option(stream);
        assert_eq!(option, OPT_GO);
        info_reply(
            stream,
            Info::BlockSize(BlockSizes {
                min_bytes: 4096,
                preferred_bytes: 4096,
                max_bytes: 65536,
            }),
        );
        info_reply(
            stream,
            Info::Export {
                size_bytes: 8 << 20,
                transmission_flags: FLAG_HAS_FLAGS | FLAG_READ_ONLY,
            },
        );
        option_reply(stream, OPT_GO, REP_ACK, b"");
        serve_zeroes(stream);
    });
    let uri = format!("nbd+unix:///?socket={}", path.display());
    let device = NbdDevice::open_with(&uri, quick()).unwrap();
    assert_eq!(device.size_bytes(), 8 << 20);
    assert_eq!(device.alignment_bytes(), 4096);
    assert!(device.is_read_only());
    assert!(matches!(
        device.write_at(0, &[0u8; 4096]),
        Err(DeviceError::Unsupported { .. })
    ));
    assert!(matches!(
        device.read_at(512, &mut [0u8; 512]),
        Err(DeviceError::Unsupported { .. })
    ));
    // A read larger than the 64 KiB payload limit is split.
    let mut big = vec![7u8; 200 << 10];
    device.read_at(0, &mut big).unwrap();
    assert!(big.iter().all(|&b| b == 0));
    assert_eq!(device.stats().requests, 4);
    drop(device);
    server.join().unwrap();
    let _ = std::fs::remove_file(&path);
}

#[test]
fn refused_export_is_a_clear_open_error() {
    let (path, server) = fake_server(|stream| {
        greet(stream, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        let (option, _) = read_option(stream);
        assert_eq!(option, OPT_GO);
        option_reply(stream, OPT_GO, REP_ERR_UNKNOWN, b"no such export here");
        let (option, _) = read_option(stream);
        assert_eq!(option, OPT_ABORT);
    });
    let uri = format!("nbd+unix:///missing?socket={}", path.display());
    let err = NbdDevice::open_with(&uri, quick())
        .err()
        .expect("open must fail");
    let text = err.to_string();
    assert!(matches!(err, DeviceError::Open { .. }), "{text}");
    assert!(text.contains("nbd+unix:///missing"), "{text}");
    assert!(text.contains("no such export here"), "{text}");
    assert!(text.contains("NBD_REP_ERR_UNKNOWN"), "{text}");
    server.join().unwrap();
    let _ = std::fs::remove_file(&path);
}

#[test]
fn non_nbd_server_is_refused() {
    let (path, server) = fake_server(|stream| {
        stream
            .write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            .unwrap();
    });
    let uri = format!("nbd+unix:///?socket={}", path.display());
    let err = NbdDevice::open_with(&uri, quick())
        .err()
        .expect("open must fail");
    assert!(err.to_string().contains("not an NBD server"), "{err}");
    server.join().unwrap();
    let _ = std::fs::remove_file(&path);
}

#[test]
fn silent_server_times_out_at_open() {
    let (path, server) = fake_server(|stream| {
        // Accept, then say nothing until the client gives up.
        let mut sink = [0u8; 1];
        let _ = stream.read(&mut sink);
    });
    let uri = format!("nbd+unix:///?socket={}", path.display());
    let options = NbdOptions {
        connect_timeout_ms: 200,
        ..quick()
    };
    let started = Instant::now();
    let err = NbdDevice::open_with(&uri, options)
        .err()
        .expect("open must fail");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "open took {:?}",
        started.elapsed()
    );
    assert!(matches!(err, DeviceError::Open { .. }), "{err}");
    server.join().unwrap();
    let _ = std::fs::remove_file(&path);
}

/// The handshake of a multi-conn export of 8 MiB of zeroes.
fn go_multi_conn(stream: &mut UnixStream) {
    greet(stream, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    let (option, _) = read_option(stream);
    assert_eq!(option, OPT_GO);
    info_reply(
        stream,
        Info::Export {
            size_bytes: 8 << 20,
            transmission_flags: FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_CAN_MULTI_CONN,
        },
    );
    option_reply(stream, OPT_GO, REP_ACK, b"");
}

/// A multi-conn export of zeroes whose first connection (the device's
/// main one) is served normally and whose second (a loop's own) is given
/// to `side` after its handshake, then closed.
fn main_and_loop_server(
    tag: &str,
    side: impl FnOnce(&mut UnixStream) + Send + 'static,
) -> (PathBuf, std::thread::JoinHandle<()>) {
    let (path, listener) = fake_listener(tag);
    let server = std::thread::spawn(move || {
        let (mut main, _) = listener.accept().unwrap();
        go_multi_conn(&mut main);
        let main_server = std::thread::spawn(move || serve_zeroes(&mut main));
        let (mut loop_conn, _) = listener.accept().unwrap();
        go_multi_conn(&mut loop_conn);
        side(&mut loop_conn);
        drop(loop_conn);
        main_server.join().unwrap();
    });
    (path, server)
}

#[test]
fn a_read_whose_loop_connection_breaks_is_asked_again_on_the_main_one() {
    // The loop's connection: take one read, then hang up on it.
    let (path, server) = main_and_loop_server("loop", |side| {
        let mut header = [0u8; COMPACT_REQUEST_BYTES];
        side.read_exact(&mut header).unwrap();
        assert_eq!(u16::from_be_bytes([header[6], header[7]]), CMD_READ);
    });
    let uri = format!("nbd+unix:///?socket={}", path.display());
    let device = std::sync::Arc::new(NbdDevice::open_with(&uri, quick()).unwrap());
    let reactor = cairn_io::Reactor::new(&cairn_io::ReactorOptions::default()).unwrap();
    let dev = std::sync::Arc::clone(&device);
    let inner = reactor.clone();
    let reads = reactor.run(async move {
        let mut reads = Vec::new();
        for round in 0..2 {
            let mut buf = vec![9u8; 4096];
            let result = dev.read_async(&inner, 4096, &mut buf).await;
            reads.push(result.map(|()| buf));
            if round == 0 {
                // The first miss opened the loop's connection meanwhile.
                let deadline = Instant::now() + Duration::from_secs(5);
                while dev.stats().loop_connections == 0 {
                    assert!(Instant::now() < deadline, "no loop connection");
                    inner.sleep(Duration::from_millis(5)).await;
                }
            }
        }
        reads
    });
    for read in reads {
        let buf = read.expect("the read is redone on the main connection");
        assert!(buf.iter().all(|&b| b == 0));
    }
    let stats = device.stats();
    assert_eq!(stats.loop_connections, 1, "{stats:?}");
    assert_eq!(stats.loop_reads, 0, "{stats:?}");
    assert_eq!(
        stats.connection_losses, 1,
        "the loop's connection: {stats:?}"
    );
    drop(device);
    server.join().unwrap();
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_loop_connection_that_stops_answering_times_out_and_reads_go_on() {
    // The loop's connection takes requests and never answers, until the
    // client gives up on it.
    let (path, server) = main_and_loop_server("stall", |side| {
        let mut sink = [0u8; 4096];
        while matches!(side.read(&mut sink), Ok(n) if n > 0) {}
    });
    let uri = format!("nbd+unix:///?socket={}", path.display());
    let options = NbdOptions {
        request_timeout_ms: 500,
        ..quick()
    };
    let device = std::sync::Arc::new(NbdDevice::open_with(&uri, options).unwrap());
    let reactor = cairn_io::Reactor::new(&cairn_io::ReactorOptions::default()).unwrap();
    let dev = std::sync::Arc::clone(&device);
    let inner = reactor.clone();
    let (stalled, waited, after) = reactor.run(async move {
        let mut buf = vec![9u8; 4096];
        dev.read_async(&inner, 0, &mut buf).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while dev.stats().loop_connections == 0 {
            assert!(Instant::now() < deadline, "no loop connection");
            inner.sleep(Duration::from_millis(5)).await;
        }
        let started = Instant::now();
        let stalled = dev.read_async(&inner, 4096, &mut buf).await;
        let waited = started.elapsed();
        // The loop's connection is gone: the next reads take the main one.
        let mut after = Vec::new();
        for i in 0..4u64 {
            let mut buf = vec![9u8; 4096];
            after.push(
                dev.read_async(&inner, i * 8192, &mut buf)
                    .await
                    .map(|()| buf),
            );
        }
        (stalled, waited, after)
    });
    let err = stalled.expect_err("the loop's connection never answered");
    assert!(err.to_string().contains("no reply within 500 ms"), "{err}");
    assert!(
        waited >= Duration::from_millis(450) && waited < Duration::from_secs(3),
        "the timeout took {waited:?}"
    );
    for read in after {
        let buf = read.expect("the main connection answers");
        assert!(buf.iter().all(|&b| b == 0));
    }
    let stats = device.stats();
    assert_eq!(stats.timeouts, 1, "{stats:?}");
    assert_eq!(stats.loop_reads, 0, "{stats:?}");
    drop(device);
    server.join().unwrap();
    let _ = std::fs::remove_file(&path);
}
