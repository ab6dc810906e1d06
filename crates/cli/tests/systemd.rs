//! Fitting systemd (issue 18): the units in `contrib/systemd/` pass
//! `systemd-analyze verify` with no warning, `cairn serve` tells a
//! `Type=notify` service manager READY=1 once its socket accepts (and
//! STOPPING=1 at SIGTERM), and socket activation through
//! `systemd-socket-activate` serves NBD on the socket systemd made, and
//! exits cleanly by itself once idle for `--idle-exit-secs`.
//! Needs systemd-analyze and systemd-socket-activate (package systemd);
//! skips without them, fails under CI=true.

mod common;

use std::io::Read;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

fn contrib(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../contrib/systemd")
        .join(name)
}

/// The first bytes an NBD server sends: it accepts and speaks NBD.
fn greets_as_nbd(socket: &Path) -> bool {
    let Ok(mut s) = UnixStream::connect(socket) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    let mut magic = [0u8; 8];
    s.read_exact(&mut magic).is_ok() && &magic == b"NBDMAGIC"
}

#[test]
fn units_pass_systemd_analyze_verify_without_warnings() {
    if !require_tools("systemd_units", &["systemd-analyze"]) {
        return;
    }
    let ctx = Ctx::new("systemd_units");
    // The units name /usr/bin/cairn; verify checks that it is executable,
    // so point them at the binary under test.
    for unit in ["cairn@.service", "cairn@.socket"] {
        let text = std::fs::read_to_string(contrib(unit)).expect("reading a unit");
        assert!(
            unit.ends_with(".socket") || text.contains("ExecStart=/usr/bin/cairn serve"),
            "{unit} starts /usr/bin/cairn serve"
        );
        std::fs::write(ctx.path(unit), text.replace("/usr/bin/cairn", CAIRN)).unwrap();
    }
    // An instance of each template, as `systemctl start cairn@fast` loads it.
    let out = run_ok(
        tool("systemd-analyze")
            .arg("verify")
            .arg("--man=no")
            .arg(ctx.path("cairn@fast.service"))
            .arg(ctx.path("cairn@fast.socket")),
        TOOL_TIMEOUT,
    );
    let warnings = stderr(&out);
    assert!(
        warnings.trim().is_empty(),
        "systemd-analyze verify warns about the units:\n{warnings}"
    );
}

#[test]
fn serve_notifies_ready_once_its_socket_accepts_and_stopping_at_sigterm() {
    let ctx = Ctx::new("systemd_notify");
    let (cache, _origin) = ctx.setup(8 << 20, 16 << 20);
    let notify_path = ctx.path("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).expect("binding the notify socket");
    notify
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let socket = ctx.path("nbd.sock");
    let mut cmd = ctx.cmd(&[
        "serve",
        "--cache",
        &cache.to_string_lossy(),
        "--socket",
        &socket.to_string_lossy(),
    ]);
    cmd.env("NOTIFY_SOCKET", &notify_path)
        .env("CAIRN_LOG", "info");
    let mut daemon = ctx.spawn("serve", &mut cmd);
    let mut messages = String::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut buf = [0u8; 4096];
    while !messages.lines().any(|l| l == "READY=1") {
        assert!(
            Instant::now() < deadline,
            "no READY=1 within 60 s (got {messages:?}); log:\n{}",
            daemon.log_text()
        );
        assert!(
            daemon.try_status().is_none(),
            "serve exited: {}",
            daemon.log_text()
        );
        if let Ok(n) = notify.recv(&mut buf) {
            messages.push_str(&String::from_utf8_lossy(&buf[..n]));
            messages.push('\n');
        }
    }
    // READY means accepting: no wait, no retry.
    assert!(
        greets_as_nbd(&socket),
        "READY=1 came before the socket accepted NBD clients"
    );
    assert!(
        messages.contains("STATUS=serving on"),
        "a status line: {messages:?}"
    );
    daemon.signal(libc::SIGTERM);
    let mut stopping = false;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !stopping && Instant::now() < deadline {
        if let Ok(n) = notify.recv(&mut buf) {
            stopping = String::from_utf8_lossy(&buf[..n])
                .lines()
                .any(|l| l == "STOPPING=1");
        }
    }
    assert!(stopping, "no STOPPING=1 after SIGTERM");
    let status = daemon
        .wait_timeout(Duration::from_secs(60))
        .expect("serve exits after SIGTERM");
    assert!(status.success(), "{status:?}: {}", daemon.log_text());
}

#[test]
fn socket_activation_serves_on_the_socket_systemd_made() {
    if !require_tools("systemd_socket_activation", &["systemd-socket-activate"]) {
        return;
    }
    let ctx = Ctx::new("systemd_socket");
    let (cache, _origin) = ctx.setup(8 << 20, 16 << 20);
    let socket = ctx.path("activated.nbd");
    // systemd-socket-activate binds the socket, waits for a connection,
    // then runs the daemon with LISTEN_FDS=1 and the socket as fd 3.
    let mut cmd = tool("systemd-socket-activate");
    cmd.arg("-l")
        .arg(&socket)
        .arg("-E")
        .arg(format!("CAIRN_RUNTIME_DIR={}", ctx.runtime.display()))
        .arg("-E")
        .arg("CAIRN_LOG=info")
        .arg(CAIRN)
        .args([
            "serve",
            "--cache",
            &cache.to_string_lossy(),
            "--idle-exit-secs",
            "5",
        ]);
    let mut activator = ctx.spawn("systemd-socket-activate", &mut cmd);
    wait_for_path(&socket, &mut activator);
    // The first client starts the daemon; it answers on the inherited
    // socket, and the next clients (within the idle grace) find it still
    // there.
    assert!(
        greets_as_nbd(&socket),
        "no NBD greeting on the activated socket; log:\n{}",
        activator.log_text()
    );
    let uri = nbd_unix_uri(&socket);
    if require_python_nbd("systemd_socket_activation") {
        let data = pattern(0x51, 64 << 10);
        nbd_write(&uri, 4096, &data, true);
        assert_same_bytes("read back", &nbd_read(&uri, 4096, data.len()), &data);
    }
    let st = ctx.status(&cache);
    assert_eq!(st["cache_state"], "ok", "{st}");
    assert!(greets_as_nbd(&socket), "still serving between clients");
    // No client for the grace: a clean exit by itself (flush, checkpoint).
    let status = activator
        .wait_timeout(Duration::from_secs(60))
        .expect("the daemon exits once idle");
    assert!(status.success(), "{status:?}: {}", activator.log_text());
    let log = activator.log_text();
    assert!(
        log.contains("no client for the idle grace") && log.contains("clean shutdown"),
        "an idle exit, cleanly: {log}"
    );
}
