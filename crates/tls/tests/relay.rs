//! The relay and both handshakes in-process: a server and a client over a
//! socket pair, each behind its relay, moving data both ways at once; the
//! refusals; and a peer that stops reading ending the relay at its stall
//! limit instead of holding the thread forever.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use cairn_tls::{spawn_relay, ClientCredentials, ServerCredentials, TlsAcceptor, TlsConnector};

fn key_file(name: &str, text: &str) -> PathBuf {
    // Tests run in parallel: a file of their own each.
    static SERIAL: AtomicU64 = AtomicU64::new(0);
    let n = SERIAL.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("cairn-tls-test-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

const ALICE: &str = "alice:000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n";

fn psk_pair(
    server_keys: &str,
    client_keys: &str,
    user: &str,
) -> (Result<UnixStream, String>, Result<UnixStream, String>) {
    let server_file = key_file(&format!("server-{user}.psk"), server_keys);
    let client_file = key_file(&format!("client-{user}.psk"), client_keys);
    let acceptor = TlsAcceptor::new(&ServerCredentials::Psk { file: server_file }).unwrap();
    let connector = TlsConnector::new(&ClientCredentials::Psk {
        file: client_file,
        username: user.to_string(),
    });
    let (a, b) = UnixStream::pair().unwrap();
    for s in [&a, &b] {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    }
    let server = thread::spawn(move || {
        let (tls, summary) = acceptor.accept(a).map_err(|e| e.to_string())?;
        assert_eq!(summary.peer.as_deref(), Some("alice"));
        assert_eq!(summary.version, "TLSv1.3");
        tls.get_ref().set_read_timeout(None).unwrap();
        spawn_relay(
            tls,
            "test-server-relay".into(),
            Some(Duration::from_secs(2)),
        )
        .map(|(plain, _outcome)| plain)
        .map_err(|e| e.to_string())
    });
    let client = (|| {
        let connector = connector.map_err(|e| e.to_string())?;
        let (tls, _) = connector.connect(b).map_err(|e| e.to_string())?;
        tls.get_ref().set_read_timeout(None).unwrap();
        spawn_relay(
            tls,
            "test-client-relay".into(),
            Some(Duration::from_secs(2)),
        )
        .map(|(plain, _outcome)| plain)
        .map_err(|e| e.to_string())
    })();
    (server.join().unwrap(), client)
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ seed)
        .collect()
}

#[test]
fn data_crosses_both_ways_at_once_and_eof_follows() {
    let (server, client) = psk_pair(ALICE, ALICE, "alice");
    let (mut server, mut client) = (server.unwrap(), client.unwrap());
    const LEN: usize = 24 << 20;
    let up = pattern(1, LEN);
    let down = pattern(2, LEN);
    // Both sides write everything before reading anything: the relays
    // must keep both directions moving, or this deadlocks.
    let mut server_w = server.try_clone().unwrap();
    let down_w = down.clone();
    let writer = thread::spawn(move || {
        server_w.write_all(&down_w).unwrap();
        server_w.shutdown(std::net::Shutdown::Write).unwrap();
    });
    let mut client_w = client.try_clone().unwrap();
    let up_w = up.clone();
    let writer2 = thread::spawn(move || {
        client_w.write_all(&up_w).unwrap();
        client_w.shutdown(std::net::Shutdown::Write).unwrap();
    });
    let reader = thread::spawn(move || {
        let mut got = Vec::new();
        server.read_to_end(&mut got).unwrap();
        got
    });
    let mut got_down = Vec::new();
    client.read_to_end(&mut got_down).unwrap();
    let got_up = reader.join().unwrap();
    writer.join().unwrap();
    writer2.join().unwrap();
    assert!(
        got_up == up,
        "client to server: {} of {LEN} bytes, or changed",
        got_up.len()
    );
    assert!(
        got_down == down,
        "server to client: {} of {LEN} bytes, or changed",
        got_down.len()
    );
}

#[test]
fn a_wrong_key_or_an_unknown_user_is_refused() {
    let other = "alice:ff0102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n";
    let (server, client) = psk_pair(ALICE, other, "alice");
    assert!(server.is_err(), "the server accepted a wrong key");
    assert!(
        client.is_err(),
        "the client finished a handshake with a wrong key"
    );
    let bob = "bob:000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n";
    let (server, _client) = psk_pair(ALICE, bob, "bob");
    assert!(server.is_err(), "the server accepted an unknown user");
}

#[test]
fn a_peer_that_stops_reading_ends_the_relay_at_its_stall_limit() {
    let (server, client) = psk_pair(ALICE, ALICE, "alice");
    let (mut server, _client_never_reads) = (server.unwrap(), client.unwrap());
    server
        .set_write_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let start = Instant::now();
    let chunk = vec![0x5au8; 1 << 20];
    // The client's relay stops taking bytes once its pair is full; the
    // server's relay then waits on the client's TLS socket, and after its
    // 2 s stall limit gives up and closes the server's pair.
    let ended = loop {
        if let Err(e) = server.write_all(&chunk) {
            break e;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the relay never gave up"
        );
    };
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(25),
        "ended after {waited:?}: {ended}"
    );
}
