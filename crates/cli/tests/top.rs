//! `cairn top` (issue 18) against a real daemon under fio load: `--once`
//! prints one frame with the interval's IOPS, MB/s, hit ratio, dirty share,
//! write-back and latency per operation; the live view runs in tmux, is
//! captured with `capture-pane` into the test directory (the screenshot),
//! and quits on `q`; without a daemon it says so and fails. Needs fio and
//! tmux; skips without them, fails under CI=true.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn top_shows_a_daemon_under_load_once_and_live() {
    if !require_tools("top", &["fio", "tmux"]) {
        return;
    }
    let ctx = Ctx::new("top");
    let (cache, _origin) = ctx.setup(16 << 20, 64 << 20);
    let c = cache.to_string_lossy().into_owned();

    let offline = ctx.cairn(&["top", "--cache", &c, "--once"]);
    assert!(!offline.status.success());
    assert!(
        stderr(&offline).contains("no daemon serves"),
        "{}",
        describe(&offline)
    );

    let sock = ctx.path("nbd.sock");
    let server = ctx.serve(&cache, &sock, &[]);
    let mut fio = ctx.spawn(
        "fio",
        tool("fio").args([
            "--name=top",
            "--ioengine=nbd",
            &format!("--uri={}", server.uri()),
            "--rw=randrw",
            "--bs=4k",
            "--size=32M",
            "--iodepth=8",
            "--runtime=30",
            "--time_based",
            "--fsync=32",
        ]),
    );
    std::thread::sleep(Duration::from_secs(2));

    let out = ctx.cairn_ok(&["top", "--cache", &c, "--once"]);
    let frame = stdout(&out);
    for needle in [
        "cairn top",
        "IOPS",
        "hit ratio",
        "dirty",
        "write-back",
        "latency",
        "read",
        "write",
        "flush",
        "p99",
    ] {
        assert!(
            frame.contains(needle),
            "the frame lacks {needle:?}:\n{frame}"
        );
    }
    let write_iops: f64 = frame
        .lines()
        .find_map(|l| {
            let l = l.trim_matches(|c| c == '│' || c == ' ');
            l.strip_prefix("write")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no write row:\n{frame}"));
    assert!(write_iops > 0.0, "fio is writing:\n{frame}");
    std::fs::write(ctx.path("top-once.txt"), &frame).unwrap();

    // The live view, in a terminal: tmux, 100x24, captured after a few
    // refreshes, then quit with q.
    let session = format!("cairn-top-{}", std::process::id());
    let command = format!(
        "CAIRN_RUNTIME_DIR={} {CAIRN} top --cache {c}",
        ctx.runtime.display()
    );
    run_ok(
        tool("tmux").args([
            "new-session",
            "-d",
            "-s",
            &session,
            "-x",
            "100",
            "-y",
            "24",
            &command,
        ]),
        TOOL_TIMEOUT,
    );
    let captured = (0..40)
        .find_map(|_| {
            std::thread::sleep(Duration::from_millis(250));
            let out = run(
                tool("tmux").args(["capture-pane", "-p", "-t", &session]),
                TOOL_TIMEOUT,
            );
            let screen = stdout(&out);
            screen.contains("latency over the last").then_some(screen)
        })
        .unwrap_or_else(|| panic!("cairn top drew no frame in tmux"));
    let shot = ctx.path("top-screenshot.txt");
    std::fs::write(&shot, &captured).unwrap();
    let _ = std::io::Write::write_all(
        &mut std::io::stderr(),
        format!("top: tmux screenshot in {}:\n{captured}\n", shot.display()).as_bytes(),
    );
    run_ok(
        tool("tmux").args(["send-keys", "-t", &session, "q"]),
        TOOL_TIMEOUT,
    );
    let gone = eventually(Duration::from_secs(10), || {
        !run(
            tool("tmux").args(["has-session", "-t", &session]),
            TOOL_TIMEOUT,
        )
        .status
        .success()
    });
    if !gone {
        let _ = run(
            tool("tmux").args(["kill-session", "-t", &session]),
            TOOL_TIMEOUT,
        );
    }
    assert!(gone, "cairn top did not quit on q");
    fio.kill9();
}

/// Without a terminal `cairn top` prints plain ASCII text a script or a log
/// can take: one frame with `--once`, a frame every interval without it.
/// (`--once` printed the drawn frame, box drawing and gauge blocks
/// included; without `--once` it took over a terminal it did not have.)
/// Needs no tools.
#[test]
fn top_prints_plain_ascii_without_a_terminal() {
    let ctx = Ctx::new("top_plain");
    let (cache, _origin) = ctx.setup(16 << 20, 64 << 20);
    let c = cache.to_string_lossy().into_owned();
    let mut server = ctx.serve(&cache, &ctx.path("nbd.sock"), &[]);
    let plain = |text: &str, what: &str| {
        assert!(text.is_ascii(), "{what} is not ASCII:\n{text}");
        for needle in [
            "cairn top: ",
            "mode writeback",
            "IOPS",
            "hit ratio",
            "dirty",
            "write-back",
            "latency over the last",
        ] {
            assert!(text.contains(needle), "{what} lacks {needle:?}:\n{text}");
        }
    };

    let out = ctx.cairn_ok(&["top", "--cache", &c, "--once", "--interval-ms", "200"]);
    let frame = stdout(&out);
    plain(&frame, "the --once frame");
    assert!(!frame.contains("q: quit"), "{frame}");

    let mut top = ctx
        .cmd(&["top", "--cache", &c, "--interval-ms", "200"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting cairn top");
    std::thread::sleep(Duration::from_millis(1500));
    let running = top.try_wait().expect("cairn top's status").is_none();
    let _ = top.kill();
    let out = top.wait_with_output().expect("cairn top's output");
    assert!(
        running,
        "cairn top without a terminal exited: {}",
        describe(&out)
    );
    let text = stdout(&out);
    plain(&text, "the frames into a pipe");
    let frames = text.matches("cairn top: ").count();
    assert!(
        (3..=8).contains(&frames),
        "{frames} frames in 1.5 s at 200 ms:\n{text}"
    );
    assert!(server.terminate().success());
}
