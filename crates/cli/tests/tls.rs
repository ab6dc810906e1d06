//! TLS on the NBD server (issue 17), with real clients: nbdinfo, nbdcopy
//! and nbdsh (libnbd, GnuTLS) and qemu-img / qemu-io (qemu's tls-creds
//! objects), over the Unix socket and TCP, with pre-shared keys made by
//! psktool and X.509 certificates made by openssl at test time. And the
//! refusals: clear-text clients under --tls=require get no export and no
//! data, a wrong key, an unknown user, a missing or foreign client
//! certificate are refused, and clear text pipelined after STARTTLS is
//! never taken. Skips without the tools, fails under CI=true.

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use cairn_nbd_proto::proto::{
    OPT_EXPORT_NAME, OPT_GO, OPT_STARTTLS, OPT_STRUCTURED_REPLY, REP_ERR_TLS_REQD,
};
use common::raw_nbd::{go_data, greet, option, read_option_reply};
use common::tls::{psk_file, qemu_psk_dir, Pki};
use common::*;

const MIB: u64 = 1 << 20;
const VOLUME_BYTES: u64 = 64 * MIB;

fn tools_present(test: &str) -> bool {
    require_tools(
        test,
        &[
            "nbdinfo", "nbdcopy", "nbdsh", "qemu-img", "qemu-io", "psktool", "openssl",
        ],
    ) && require_python_nbd(test)
}

fn nbdinfo_size(uri: &str) -> Result<u64, String> {
    let out = run(tool("nbdinfo").arg("--size").arg(uri), TOOL_TIMEOUT);
    if !out.status.success() {
        return Err(stderr(&out));
    }
    stdout(&out)
        .trim()
        .parse()
        .map_err(|_| format!("nbdinfo printed {:?}", stdout(&out)))
}

/// 8 MiB of a pattern in with nbdcopy (several connections), back out,
/// compared.
fn nbdcopy_round_trip(ctx: &Ctx, uri: &str, seed: u64) {
    let data = pattern(seed, 8 * MIB as usize);
    let src = ctx.path(&format!("copy-in-{seed}.bin"));
    let back = ctx.path(&format!("copy-out-{seed}.bin"));
    std::fs::write(&src, &data).expect("writing the source");
    // A raw file smaller than the volume: nbdcopy writes its length.
    run_ok(tool("nbdcopy").arg(&src).arg(uri), TOOL_TIMEOUT);
    run_ok(tool("nbdcopy").arg(uri).arg(&back), TOOL_TIMEOUT);
    let got = read_range(&back, 0, data.len());
    assert_same_bytes("nbdcopy through TLS", &got, &data);
}

fn nbdsh_round_trip(uri: &str) {
    let script = "\
import os
d = os.urandom(65536)
h.pwrite(d, 1048576)
h.flush()
assert h.pread(65536, 1048576) == d
assert h.get_size() == 67108864
print('nbdsh ok')
";
    // nbdsh -u refuses URIs that name local files (the key, the
    // certificates) unless allowed first.
    let connect = format!("h.set_uri_allow_local_file(True)\nh.connect_uri({uri:?})");
    let out = run_ok(
        tool("nbdsh").args(["-c", &connect, "-c", script]),
        TOOL_TIMEOUT,
    );
    assert!(stdout(&out).contains("nbdsh ok"), "{}", describe(&out));
}

/// qemu-img info and qemu-io through `object` (a tls-creds-* object
/// with id tls0) to the server `server_opts` names.
fn qemu_round_trip(object: &str, server_opts: &str) {
    let image = format!("driver=nbd,{server_opts},tls-creds=tls0");
    let out = run_ok(
        tool("qemu-img").args(["info", "--object", object, "--image-opts", &image]),
        TOOL_TIMEOUT,
    );
    assert!(
        stdout(&out).contains(&format!("({VOLUME_BYTES} bytes)")),
        "{}",
        describe(&out)
    );
    let out = run_ok(
        tool("qemu-io").args([
            "--object",
            object,
            "--image-opts",
            &image,
            "-c",
            "write -P 0x5c 2M 1M",
            "-c",
            "flush",
            "-c",
            "read -P 0x5c 2M 1M",
        ]),
        TOOL_TIMEOUT,
    );
    let text = stdout(&out);
    assert!(
        text.contains("wrote 1048576/1048576") && text.contains("read 1048576/1048576"),
        "{}",
        describe(&out)
    );
    assert!(!text.contains("Pattern verification failed"), "{text}");
}

fn nbd_counter(ctx: &Ctx, cache: &Path, name: &str) -> u64 {
    u64_of(&ctx.status(cache), name)
}

#[test]
fn psk_serves_libnbd_and_qemu_clients_over_unix_and_tcp() {
    const T: &str = "tls_psk";
    if !tools_present(T) {
        return;
    }
    let ctx = Ctx::new(T);
    let (cache, _origin) = ctx.setup(32 * MIB, VOLUME_BYTES);
    let keys = psk_file(&ctx, "keys.psk", "alice");
    let wrong_key = psk_file(&ctx, "wrong.psk", "alice");
    let other_user = psk_file(&ctx, "bob.psk", "bob");
    let qemu_dir = qemu_psk_dir(&ctx, &keys, "qemu-psk");
    let keys_s = keys.to_string_lossy().into_owned();
    let socket = ctx.path("tls.sock");
    let mut server = ctx.serve(&cache, &socket, &["--tls-psk", &keys_s]);
    let unix = |user: &str, file: &Path| {
        format!(
            "nbds+unix://{user}@/?socket={}&tls-psk-file={}",
            socket.display(),
            file.display()
        )
    };

    assert_eq!(nbdinfo_size(&unix("alice", &keys)), Ok(VOLUME_BYTES));
    nbdcopy_round_trip(&ctx, &unix("alice", &keys), 1);
    nbdsh_round_trip(&unix("alice", &keys));
    let object = format!(
        "tls-creds-psk,id=tls0,endpoint=client,username=alice,dir={}",
        qemu_dir.display()
    );
    qemu_round_trip(
        &object,
        &format!("server.type=unix,server.path={}", socket.display()),
    );
    let established = nbd_counter(&ctx, &cache, "nbd_tls_handshakes");
    assert!(established >= 4, "TLS handshakes counted: {established}");

    // Refused: the wrong key, a user with no key, clear text.
    for (what, uri) in [
        ("a wrong key", unix("alice", &wrong_key)),
        ("an unknown user", unix("bob", &other_user)),
        ("clear text", nbd_unix_uri(&socket)),
    ] {
        assert!(nbdinfo_size(&uri).is_err(), "{what} was served");
    }
    assert!(nbd_counter(&ctx, &cache, "nbd_tls_handshake_failures") >= 2);
    clear_text_gets_no_export(&socket);
    // Nothing reached the volume from the refused clients, and the
    // server still serves.
    nbdsh_round_trip(&unix("alice", &keys));
    server.terminate();

    let (mut tcp, addr) = ctx.serve_tcp(&cache, &["--tls-psk", &keys_s]);
    let tcp_uri = format!("nbds://alice@{addr}/?tls-psk-file={}", keys.display());
    assert_eq!(nbdinfo_size(&tcp_uri), Ok(VOLUME_BYTES));
    nbdcopy_round_trip(&ctx, &tcp_uri, 2);
    nbdsh_round_trip(&tcp_uri);
    let (host, port) = addr.split_once(':').expect("host:port");
    qemu_round_trip(
        &object,
        &format!("server.type=inet,server.host={host},server.port={port}"),
    );
    assert!(
        nbdinfo_size(&format!("nbd://{addr}")).is_err(),
        "clear text over TCP was served"
    );
    tcp.terminate(Duration::from_secs(60));
}

/// Under --tls=require a clear-text client gets ERR_TLS_REQD for GO and
/// a closed connection for EXPORT_NAME: no size, no data.
fn clear_text_gets_no_export(socket: &Path) {
    let mut s = UnixStream::connect(socket).expect("connect");
    assert!(greet(&mut s));
    s.write_all(&option(OPT_GO, &go_data(""))).expect("GO");
    let (opt, reply, _) = read_option_reply(&mut s).expect("a reply to GO");
    assert_eq!((opt, reply), (OPT_GO, REP_ERR_TLS_REQD));
    s.write_all(&option(OPT_EXPORT_NAME, b""))
        .expect("EXPORT_NAME");
    let mut rest = Vec::new();
    let _ = std::io::Read::read_to_end(&mut s, &mut rest);
    assert!(
        rest.is_empty(),
        "EXPORT_NAME in clear text got {} bytes",
        rest.len()
    );
}

#[test]
fn x509_serves_certified_clients_and_refuses_the_others() {
    const T: &str = "tls_x509";
    if !tools_present(T) {
        return;
    }
    let ctx = Ctx::new(T);
    let (cache, _origin) = ctx.setup(32 * MIB, VOLUME_BYTES);
    let pki = Pki::make(&ctx);
    let server_dir = pki.server.to_string_lossy().into_owned();

    // TCP, client certificates required.
    let (mut tcp, addr) = ctx.serve_tcp(
        &cache,
        &["--tls-certificates", &server_dir, "--tls-verify-peer"],
    );
    let uri = |dir: &Path| {
        format!(
            "nbds://localhost:{}/?tls-certificates={}",
            addr.split_once(':').map_or("", |(_, p)| p),
            dir.display()
        )
    };
    assert_eq!(nbdinfo_size(&uri(&pki.client)), Ok(VOLUME_BYTES));
    nbdcopy_round_trip(&ctx, &uri(&pki.client), 3);
    nbdsh_round_trip(&uri(&pki.client));
    let object = format!(
        "tls-creds-x509,id=tls0,endpoint=client,dir={}",
        pki.client.display()
    );
    let port = addr.split_once(':').map_or("", |(_, p)| p).to_string();
    qemu_round_trip(
        &object,
        &format!("server.type=inet,server.host=localhost,server.port={port}"),
    );
    for (what, dir) in [
        ("a client without a certificate", &pki.no_cert),
        ("a certificate of another CA", &pki.rogue_client),
    ] {
        assert!(nbdinfo_size(&uri(dir)).is_err(), "{what} was served");
    }
    // GnuTLS keeps a certificate the server's CA list does not name to
    // itself; OpenSSL's client (python's ssl) sends it anyway, so the
    // server's verification is what refuses it. The good certificate
    // through the same script is the control.
    assert_eq!(raw_tls_go(&addr, &pki.client), "GOT 20");
    let rogue = raw_tls_go(&addr, &pki.rogue_client);
    assert!(rogue.starts_with("REFUSED") || rogue == "GOT 0", "{rogue}");
    assert!(
        nbdinfo_size(&format!("nbd://{addr}")).is_err(),
        "clear text was served"
    );
    tcp.terminate(Duration::from_secs(60));

    // The Unix socket, --tls=on without peer verification: a client with
    // no certificate of its own gets TLS, and clear text is still served.
    let socket = ctx.path("x509.sock");
    let mut server = ctx.serve(
        &cache,
        &socket,
        &["--tls=on", "--tls-certificates", &server_dir],
    );
    let unix = format!(
        "nbds+unix:///?socket={}&tls-certificates={}",
        socket.display(),
        pki.no_cert.display()
    );
    assert_eq!(nbdinfo_size(&unix), Ok(VOLUME_BYTES));
    nbdcopy_round_trip(&ctx, &unix, 4);
    nbdsh_round_trip(&unix);
    let out = run_ok(tool("nbdinfo").arg(&unix), TOOL_TIMEOUT);
    assert!(stdout(&out).contains("with TLS"), "{}", describe(&out));
    let out = run_ok(tool("nbdinfo").arg(nbd_unix_uri(&socket)), TOOL_TIMEOUT);
    assert!(stdout(&out).contains("without TLS"), "{}", describe(&out));
    qemu_round_trip(
        &format!(
            "tls-creds-x509,id=tls0,endpoint=client,dir={}",
            pki.no_cert.display()
        ),
        &format!(
            "server.type=unix,server.path={},tls-hostname=localhost",
            socket.display()
        ),
    );
    clear_text_after_starttls_is_refused(&socket);
    garbage_instead_of_a_client_hello_is_refused(&socket);
    // And the server still serves.
    assert_eq!(nbdinfo_size(&unix), Ok(VOLUME_BYTES));
    server.terminate();
}

/// STARTTLS by hand, then TLS with python's ssl (OpenSSL) presenting the
/// certificate in `dir`, then NBD_OPT_GO; "GOT n" (bytes of the first
/// reply header) or "REFUSED why".
fn raw_tls_go(addr: &str, dir: &Path) -> String {
    const SCRIPT: &str = r#"
import socket, ssl, struct, sys
host, port, d = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def recvall(s, n):
    b = b''
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            break
        b += c
    return b
s = socket.create_connection((host, port), timeout=20)
assert recvall(s, 18)[:8] == b'NBDMAGIC'
s.sendall(struct.pack('>I', 3))
s.sendall(b'IHAVEOPT' + struct.pack('>II', 5, 0))
h = recvall(s, 20)
assert struct.unpack('>I', h[12:16])[0] == 1, h
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.load_verify_locations(d + '/ca-cert.pem')
ctx.load_cert_chain(d + '/client-cert.pem', d + '/client-key.pem')
try:
    t = ctx.wrap_socket(s, server_hostname='localhost')
    t.sendall(b'IHAVEOPT' + struct.pack('>II', 7, 6) + struct.pack('>IH', 0, 0))
    print('GOT', len(recvall(t, 20)))
except (ssl.SSLError, OSError) as e:
    print('REFUSED', e)
"#;
    let (host, port) = addr.split_once(':').expect("host:port");
    let dir = dir.to_string_lossy();
    let out = run_ok(
        std::process::Command::new(python()).args(["-c", SCRIPT, host, port, &dir]),
        TOOL_TIMEOUT,
    );
    stdout(&out).trim().to_string()
}

/// CVE-2021-3716's shape: STARTTLS with clear text right behind it. The
/// server must not answer the clear text as if it came through TLS: it
/// hangs up without acknowledging STARTTLS.
fn clear_text_after_starttls_is_refused(socket: &Path) {
    let mut s = UnixStream::connect(socket).expect("connect");
    assert!(greet(&mut s));
    let mut burst = option(OPT_STARTTLS, &[]);
    burst.extend(option(OPT_STRUCTURED_REPLY, &[]));
    burst.extend(option(OPT_GO, &go_data("")));
    s.write_all(&burst).expect("burst");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut rest = Vec::new();
    let _ = std::io::Read::read_to_end(&mut s, &mut rest);
    assert!(rest.is_empty(), "the server answered {} bytes", rest.len());
}

/// STARTTLS acknowledged, then bytes that are no TLS at all: the
/// handshake fails and the connection closes, nothing is answered.
fn garbage_instead_of_a_client_hello_is_refused(socket: &Path) {
    let mut s = UnixStream::connect(socket).expect("connect");
    assert!(greet(&mut s));
    s.write_all(&option(OPT_STARTTLS, &[])).expect("STARTTLS");
    let (opt, reply, _) = read_option_reply(&mut s).expect("STARTTLS reply");
    assert_eq!(
        (opt, reply),
        (OPT_STARTTLS, cairn_nbd_proto::proto::REP_ACK)
    );
    s.write_all(&pattern(9, 4096)).expect("garbage");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut rest = Vec::new();
    let _ = std::io::Read::read_to_end(&mut s, &mut rest);
    // At most a TLS alert (a 7-byte record), never NBD.
    assert!(rest.len() <= 7, "the server answered {} bytes", rest.len());
}

#[test]
fn tls_settings_that_cannot_work_are_refused_with_the_fix() {
    let ctx = Ctx::new("tls_settings");
    let (cache, _origin) = ctx.setup(16 * MIB, 64 * MIB);
    let c = cache.to_string_lossy().into_owned();
    let sock = ctx.path("s.sock").to_string_lossy().into_owned();
    let missing = ctx.path("nowhere").to_string_lossy().into_owned();
    let empty_dir = ctx.path("empty");
    std::fs::create_dir_all(&empty_dir).expect("dir");
    let empty = empty_dir.to_string_lossy().into_owned();
    let bad_psk = ctx.path("bad.psk");
    std::fs::write(&bad_psk, "alice:not-hex\n").expect("psk");
    let bad_psk = bad_psk.to_string_lossy().into_owned();
    for (args, needles) in [
        (
            vec!["--tls=require"],
            vec!["--tls-certificates", "--tls-psk"],
        ),
        (vec!["--tls=off", "--tls-psk", &bad_psk], vec!["--tls=off"]),
        (vec!["--tls-psk", &missing], vec!["nowhere"]),
        (vec!["--tls-psk", &bad_psk], vec!["bad.psk:1", "psktool"]),
        (vec!["--tls-certificates", &empty], vec!["server-cert.pem"]),
        (vec!["--tls-verify-peer"], vec!["--tls-certificates"]),
    ] {
        let mut all = vec!["serve", "--cache", &c, "--socket", &sock];
        all.extend(args.iter().copied());
        let out = run(&mut ctx.cmd(&all), TOOL_TIMEOUT);
        assert_clean_failure(&out, &needles);
    }
}

/// cairn in front of an `nbds+unix://` origin that nbdkit serves with
/// `--tls=require --tls-psk`: fio writes and verifies through the cache,
/// `cairn flush` drains, the origin file equals the volume; the daemon
/// started again from the identity recorded at format time (TLS
/// parameters included) still verifies. A clear-text URI is refused with
/// the fix named.
#[test]
fn nbds_origin_behind_nbdkit_tls_require() {
    const T: &str = "tls_origin";
    if !require_tools(T, &["nbdkit", "fio", "psktool"]) || !require_python_nbd(T) {
        return;
    }
    let ctx = Ctx::new(T);
    let keys = psk_file(&ctx, "keys.psk", "alice");
    let origin_file = ctx.path("origin.img");
    std::fs::write(&origin_file, pattern(0x51, VOLUME_BYTES as usize)).expect("origin");
    let origin_socket = ctx.path("origin.sock");
    let tls_psk = format!("--tls-psk={}", keys.display());
    let file_arg = format!("file={}", origin_file.display());
    let mut nbdkit = start_nbdkit(
        &ctx,
        &origin_socket,
        &["--tls=require", &tls_psk, "file", &file_arg],
    );
    let cache = ctx.file("cache.img", 32 * MIB);
    let c = cache.to_string_lossy().into_owned();

    let clear = nbd_unix_uri(&origin_socket);
    let out = ctx.cairn(&["format", "--cache", &c, "--origin", &clear]);
    assert_clean_failure(&out, &["NBD_REP_ERR_TLS_REQD", "nbds"]);

    let origin_uri = format!(
        "nbds+unix://alice@/?socket={}&tls-psk-file={}",
        origin_socket.display(),
        keys.display()
    );
    ctx.format(&cache, &origin_uri, &[]);
    let st = ctx.status(&cache);
    let recorded = st["origin"].as_str().unwrap_or_default().to_string();
    assert!(
        recorded.starts_with("nbds+unix:///") && recorded.contains("tls-username=alice"),
        "{st}"
    );

    let socket = ctx.path("cairn.sock");
    let mut server = ctx.serve(&cache, &socket, &[]);
    let uri = server.uri();
    let fio = |args: &[String]| {
        run(
            tool("fio").current_dir(&ctx.dir.path).args(args),
            TOOL_TIMEOUT,
        )
    };
    let out = fio(&fio_verified_args(&uri, 7, false));
    assert!(out.status.success(), "fio write pass: {}", describe(&out));
    let out = fio(&fio_verified_args(&uri, 7, true));
    assert!(out.status.success(), "fio verify pass: {}", describe(&out));
    // Data the cache never held comes from the origin, through TLS.
    let far = 40 * MIB;
    assert_same_bytes(
        "origin data read through TLS",
        &nbd_read(&uri, far, MIB as usize),
        &pattern(0x51, VOLUME_BYTES as usize)[far as usize..(far + MIB) as usize],
    );
    let out = ctx.flush(&cache);
    assert!(
        stdout(&out).contains("write-back complete"),
        "{}",
        describe(&out)
    );
    let volume = nbd_read(&uri, 0, VOLUME_BYTES as usize);
    assert_same_bytes(
        "origin file after the drain",
        &std::fs::read(&origin_file).expect("origin"),
        &volume,
    );
    server.kill9();

    // Started again with no --origin: reopened from the recorded identity.
    let server = ctx.serve(&cache, &socket, &[]);
    let out = fio(&fio_verified_args(&server.uri(), 7, true));
    assert!(
        out.status.success(),
        "verify after restart: {}",
        describe(&out)
    );
    drop(server);
    nbdkit.terminate(Duration::from_secs(30));
}

/// An `nbds://` origin over TCP with X.509: nbdkit with
/// `--tls=require --tls-certificates --tls-verify-peer`, cairn presenting
/// the client certificate of `tls-certificates=DIR` and checking the
/// server's against its CA and the host name. Writes through the cache
/// reach the origin at the drain; a directory without a client
/// certificate, and one that does not trust the server, are refused.
#[test]
fn nbds_tcp_origin_with_x509() {
    const T: &str = "tls_origin_x509";
    if !require_tools(T, &["nbdkit", "openssl"]) || !require_python_nbd(T) {
        return;
    }
    let ctx = Ctx::new(T);
    let pki = Pki::make(&ctx);
    let origin_file = ctx.path("origin.img");
    std::fs::write(&origin_file, pattern(0x61, VOLUME_BYTES as usize)).expect("origin");
    let port = free_port();
    let (port_s, certs, file_arg) = (
        port.to_string(),
        format!("--tls-certificates={}", pki.server.display()),
        format!("file={}", origin_file.display()),
    );
    let mut nbdkit = ctx.spawn(
        "nbdkit-tls",
        tool("nbdkit").args([
            "-f",
            "-i",
            "127.0.0.1",
            "-p",
            &port_s,
            "--tls=require",
            &certs,
            "--tls-verify-peer",
            "file",
            &file_arg,
        ]),
    );
    assert!(
        eventually(Duration::from_secs(30), || std::net::TcpStream::connect((
            "127.0.0.1",
            port
        ))
        .is_ok()),
        "nbdkit did not listen: {}",
        nbdkit.log_text()
    );
    let cache = ctx.file("cache.img", 32 * MIB);
    let c = cache.to_string_lossy().into_owned();
    let origin = |dir: &Path| {
        format!(
            "nbds://localhost:{port}/?tls-certificates={}",
            dir.display()
        )
    };
    for (what, dir, needle) in [
        (
            "no client certificate",
            &pki.no_cert,
            "ended the TLS session",
        ),
        (
            "a CA that did not sign the server",
            &pki.trusts_rogue,
            "certificate",
        ),
    ] {
        let out = ctx.cairn(&["format", "--cache", &c, "--origin", &origin(dir)]);
        assert!(!out.status.success(), "{what}: formatted");
        assert_clean_failure(&out, &[needle]);
    }
    ctx.format(&cache, &origin(&pki.client), &[]);
    let socket = ctx.path("cairn.sock");
    let server = ctx.serve(&cache, &socket, &[]);
    let uri = server.uri();
    let data = pattern(0x62, 2 * MIB as usize);
    nbd_write(&uri, 5 * MIB, &data, true);
    assert_same_bytes(
        "origin data through TLS",
        &nbd_read(&uri, 20 * MIB, MIB as usize),
        &pattern(0x61, VOLUME_BYTES as usize)[20 * MIB as usize..21 * MIB as usize],
    );
    let out = ctx.flush(&cache);
    assert!(
        stdout(&out).contains("write-back complete"),
        "{}",
        describe(&out)
    );
    assert_same_bytes(
        "origin file after the drain",
        &read_range(&origin_file, 5 * MIB, data.len()),
        &data,
    );
    drop(server);
    nbdkit.terminate(Duration::from_secs(30));
}
