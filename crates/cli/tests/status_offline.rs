//! `cairn status` with no daemon serving the cache: the offline view, from
//! the cache device alone opened read-only. It must work with the origin
//! unreachable (a stopped nbdkit here), show the dirty blocks of a log a
//! `kill -9` left to replay, write nothing to the cache (its sha256 is the
//! same after), and refuse while a daemon holds the cache; with a daemon
//! answering, status still goes to it.

mod common;

use std::path::Path;

use common::*;

const MIB: u64 = 1 << 20;

/// The sha256 of `path`'s bytes, by `sha256sum`.
fn sha256(path: &Path) -> String {
    let out = run_ok(tool("sha256sum").arg(path), TOOL_TIMEOUT);
    stdout(&out)
        .split_whitespace()
        .next()
        .expect("sha256sum printed a digest")
        .to_string()
}

/// nbdkit's file plugin over a fresh `origin.img` of `size` bytes.
fn nbdkit_origin(ctx: &Ctx, size: u64) -> (Proc, std::path::PathBuf) {
    let file = ctx.file("origin.img", size);
    let socket = ctx.path("origin.sock");
    let file_arg = format!("file={}", file.display());
    let proc = start_nbdkit(ctx, &socket, &["file", &file_arg]);
    (proc, socket)
}

/// Format over an nbdkit origin, write through a daemon, `kill -9` it (a
/// log that needs replay), stop the origin; then `status`, `status
/// --json`, `status --volume` and `volume list` answer from the cache,
/// show the dirty blocks, and leave the cache's bytes as they were.
#[test]
fn offline_status_needs_no_origin_and_writes_nothing() {
    let test = "status_offline";
    if !require_tools(test, &["nbdkit"]) || !require_python_nbd(test) {
        return;
    }
    let ctx = Ctx::new(test);
    let (mut nbdkit, origin_socket) = nbdkit_origin(&ctx, 16 * MIB);
    let uri = nbd_unix_uri(&origin_socket);
    let cache = ctx.file("cache.img", 8 * MIB);
    ctx.format(&cache, &uri, &[]);
    let c = cache.to_string_lossy().into_owned();
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &["--no-writeback"]);
    // 16 blocks, flushed; then 8 more, flushed; then the daemon dies.
    nbd_write(&server.uri(), 0, &pattern(1, 64 << 10), true);
    nbd_write(&server.uri(), MIB, &pattern(2, 32 << 10), true);
    server.kill9();
    nbdkit.kill9();
    assert!(origin_socket.exists(), "a killed nbdkit leaves its socket");
    let dirty = 16 + 8;

    let before = sha256(&cache);
    let st = ctx.status(&cache);
    assert_eq!(st["served"], false, "{st}");
    assert_eq!(st["view"], "offline", "{st}");
    assert_eq!(u64_of(&st, "dirty_blocks"), dirty, "{st}");
    assert_eq!(st["origin"], uri, "{st}");
    assert_eq!(u64_of(&st, "volume_size_bytes"), 16 * MIB, "{st}");
    assert_eq!(u64_of(&st, "block_size_bytes"), 4096, "{st}");
    // An 8 MiB cache is too small for 1 MiB records.
    assert_eq!(u64_of(&st, "record_data_max_bytes"), 256 << 10, "{st}");
    assert_eq!(st["mode"], "writeback", "{st}");
    assert!(u64_of(&st, "log_used_blocks") >= dirty, "{st}");
    assert!(u64_of(&st, "cache_blocks") > 0, "{st}");
    // What only a running daemon knows is null, not made up.
    for key in ["origin_state", "reads", "writes", "read_hit_ratio"] {
        assert!(st[key].is_null(), "{key} offline: {st}");
    }
    assert!(st.get("nbd_requests").is_none(), "{st}");
    let volumes = st["volumes"].as_array().expect("volumes");
    assert_eq!(volumes.len(), 1, "{st}");
    assert_eq!(volumes[0]["dirty_blocks"], dirty, "{st}");
    assert!(volumes[0]["origin_state"].is_null(), "{st}");
    assert!(volumes[0].get("connections").is_none(), "{st}");

    let out = ctx.cairn_ok(&["status", "--cache", &c]);
    let human = stdout(&out);
    assert!(
        human.contains("not served (offline view") && human.contains(&format!("{dirty} dirty")),
        "{human}"
    );
    // A query's answer comes alone: the recovery's INFO lines stay out.
    let noise = stderr(&out);
    assert!(!noise.contains(" INFO "), "status logged: {noise}");
    let one = json_in(&stdout(
        &ctx.cairn_ok(&["status", "--cache", &c, "--volume", "", "--json"]),
    ));
    assert_eq!(one["dirty_blocks"], dirty, "{one}");
    assert_eq!(one["cache"]["served"], false, "{one}");
    let list = stdout(&ctx.cairn_ok(&["volume", "list", "--cache", &c]));
    assert!(list.contains(&uri), "{list}");
    assert_eq!(
        sha256(&cache),
        before,
        "an offline status changed the cache"
    );

    // The daemon, with its origin back, recovers what the offline view
    // said.
    let _ = std::fs::remove_file(&origin_socket);
    let file_arg = format!("file={}", ctx.path("origin.img").display());
    let _nbdkit = start_nbdkit(&ctx, &origin_socket, &["file", &file_arg]);
    let mut server = ctx.serve(&cache, &sock, &["--no-writeback"]);
    let live = ctx.status(&cache);
    assert_eq!(live["served"], true, "{live}");
    assert_eq!(u64_of(&live, "dirty_blocks"), dirty, "{live}");
    assert!(server.terminate().success());
}

/// While a daemon serves the cache, status goes to it (live figures); a
/// status that cannot reach its admin socket (another runtime directory)
/// is refused, naming why, rather than reading a cache being written.
#[test]
fn status_goes_to_the_daemon_and_never_reads_a_held_cache() {
    let ctx = Ctx::new("status_held");
    let (cache, _origin) = ctx.setup(32 * MIB, 64 * MIB);
    let c = cache.to_string_lossy().into_owned();
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &[]);
    let st = ctx.status(&cache);
    assert_eq!(st["served"], true, "{st}");
    assert!(st.get("view").is_none(), "{st}");
    assert_eq!(st["origin_state"], "ok", "{st}");
    assert!(st["reads"].is_u64(), "{st}");

    let other_run = ctx.path("other-run");
    std::fs::create_dir(&other_run).expect("mkdir");
    for args in [
        vec!["status", "--cache", &c],
        vec!["volume", "list", "--cache", &c],
    ] {
        let mut cmd = ctx.cmd(&args);
        cmd.env("CAIRN_RUNTIME_DIR", &other_run);
        let out = run(&mut cmd, TOOL_TIMEOUT);
        assert_clean_failure(
            &out,
            &[
                "held by another process",
                "no daemon answered",
                "CAIRN_RUNTIME_DIR",
            ],
        );
    }
    assert!(server.proc.try_status().is_none(), "the daemon died");
    assert!(server.terminate().success());
    // Stopped cleanly: the offline view.
    assert_eq!(ctx.status(&cache)["served"], false);
}
