//! One cache, three volumes over three different origins (issue 16): a
//! local file, an `nbdkit file` export, and a slow `nbdkit` delay export.
//!
//! 1. `cairn format` on the file (volume `""`), `cairn volume add` of the
//!    two NBD origins offline, one more online while serving;
//!    `nbdinfo --list` shows every volume as an export with its size and
//!    description; an unknown name is refused.
//! 2. fio writes and flushes a verified 8 MiB region on all three at once
//!    (different seeds), then `kill -9` of the daemon.
//! 3. Restart: `fio --verify_only` on each volume: 0 errors, every block
//!    read; a negative control (another seed) reports errors.
//! 4. `cairn flush` drains every volume; each origin file then holds
//!    exactly what its volume reads (and no other volume's data).
//! 5. `cairn volume remove`: refused while a client is connected, done
//!    with `--force`; the origin keeps everything; the first volume stays.

mod common;

use std::path::{Path, PathBuf};

use common::*;

const MIB: u64 = 1 << 20;

/// An `nbdkit file` export of a fresh file, over a Unix socket.
struct NbdFile {
    file: PathBuf,
    socket: PathBuf,
    _proc: Proc,
}

impl NbdFile {
    fn start(ctx: &Ctx, name: &str, size_bytes: u64, filters: &[&str], params: &[&str]) -> NbdFile {
        let file = ctx.file(&format!("{name}.img"), size_bytes);
        let socket = ctx.path(&format!("{name}.sock"));
        let file_arg = format!("file={}", file.display());
        let mut args: Vec<&str> = filters.to_vec();
        args.push("file");
        args.push(&file_arg);
        args.extend_from_slice(params);
        let proc = start_nbdkit(ctx, &socket, &args);
        NbdFile {
            file,
            socket,
            _proc: proc,
        }
    }

    fn uri(&self) -> String {
        nbd_unix_uri(&self.socket)
    }
}

/// GET /metrics from `addr`.
fn http_metrics(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect to metrics");
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("send");
    let mut body = String::new();
    s.read_to_string(&mut body).expect("read metrics");
    body
}

/// `cairn volume add` of `name` on `origin`, which must succeed.
fn volume_add(ctx: &Ctx, cache: &str, name: &str, origin: &str, extra: &[&str]) {
    let mut args = vec![
        "volume", "add", "--cache", cache, "--name", name, "--origin", origin,
    ];
    args.extend_from_slice(extra);
    ctx.cairn_ok(&args);
}

fn export_uri(socket: &Path, name: &str) -> String {
    format!("nbd+unix:///{name}?socket={}", socket.display())
}

/// fio in a directory of the volume's own: fio keeps its verify state in
/// a file named after the job in the working directory, and the jobs of
/// the volumes run at once under one name.
fn fio(ctx: &Ctx, volume: &str, args: &[String]) -> std::process::Output {
    let dir = ctx.path(&format!(
        "fio-{}",
        if volume.is_empty() { "first" } else { volume }
    ));
    std::fs::create_dir_all(&dir).expect("fio directory");
    run(tool("fio").current_dir(&dir).args(args), TOOL_TIMEOUT)
}

/// fio's verified writes (or their verify pass) on every `(volume, uri,
/// seed)` at once; each must have succeeded with 8 MiB moved and no error.
fn fio_all(ctx: &Ctx, jobs: &[(&str, String, u64)], verify_only: bool) {
    std::thread::scope(|scope| {
        let runs: Vec<_> = jobs
            .iter()
            .map(|(volume, uri, seed)| {
                scope.spawn(move || {
                    let out = fio(ctx, volume, &fio_verified_args(uri, *seed, verify_only));
                    (uri, out)
                })
            })
            .collect();
        for run in runs {
            let (uri, out) = run.join().expect("fio thread");
            assert!(out.status.success(), "fio on {uri}: {}", describe(&out));
            let job = &json_in(&stdout(&out))["jobs"][0];
            assert_eq!(job["error"], 0, "{uri}: {job}");
            let moved = if verify_only { "read" } else { "write" };
            assert_eq!(job[moved]["io_bytes"], 8 * MIB, "{uri}: {job}");
        }
    });
}

#[test]
fn three_volumes_over_three_origins_survive_kill9_and_drain_to_their_own_origins() {
    if !require_tools("volumes", &["fio", "nbdkit", "nbdinfo"]) || !require_python_nbd("volumes") {
        return;
    }
    let ctx = Ctx::new("volumes");
    let cache = ctx.file("cache.img", 96 * MIB);
    let local = ctx.file("local.img", 16 * MIB);
    let fast = NbdFile::start(&ctx, "fast", 12 * MIB, &[], &[]);
    let slow = NbdFile::start(
        &ctx,
        "slow",
        10 * MIB,
        &["--filter=delay"],
        &["rdelay=5ms", "wdelay=5ms"],
    );
    ctx.format(&cache, &local.to_string_lossy(), &[]);
    let cache_arg = cache.to_string_lossy().to_string();
    volume_add(&ctx, &cache_arg, "fast", &fast.uri(), &[]);
    volume_add(&ctx, &cache_arg, "slow", &slow.uri(), &[]);
    let list = ctx.cairn_ok(&["volume", "list", "--cache", &cache_arg, "--json"]);
    let volumes: serde_json::Value = serde_json::from_str(&stdout(&list))
        .unwrap_or_else(|e| panic!("volume list --json ({e}): {}", describe(&list)));
    let names: Vec<&str> = volumes
        .as_array()
        .expect("a list")
        .iter()
        .map(|v| v["name"].as_str().expect("name"))
        .collect();
    assert_eq!(names, ["", "fast", "slow"], "{volumes}");
    assert_eq!(volumes[1]["size_bytes"], 12 * MIB);
    assert_eq!(volumes[2]["origin"], slow.uri());

    let sock = ctx.path("cairn.sock");
    let mut server = ctx.serve(&cache, &sock, &[]);
    // A fourth volume added while serving is exported at once.
    let late = ctx.file("late.img", 4 * MIB);
    volume_add(
        &ctx,
        &cache_arg,
        "late",
        &late.to_string_lossy(),
        &["--mode", "writethrough"],
    );
    let listed = run_ok(
        tool("nbdinfo").args(["--list", "--json", &server.uri()]),
        TOOL_TIMEOUT,
    );
    let listed = json_in(&stdout(&listed));
    let exports = listed["exports"].as_array().expect("exports");
    let size_of = |name: &str| {
        exports
            .iter()
            .find(|e| e["export-name"] == name)
            .unwrap_or_else(|| panic!("export {name:?} not listed: {listed}"))["export-size"]
            .clone()
    };
    assert_eq!(size_of(""), 16 * MIB);
    assert_eq!(size_of("fast"), 12 * MIB);
    assert_eq!(size_of("slow"), 10 * MIB);
    assert_eq!(size_of("late"), 4 * MIB);
    assert!(
        listed.to_string().contains("cairn volume 2 over"),
        "descriptions: {listed}"
    );
    let unknown = run(
        tool("nbdinfo").arg(export_uri(&sock, "nosuch")),
        TOOL_TIMEOUT,
    );
    assert!(!unknown.status.success(), "{}", describe(&unknown));
    let late_data = pattern(44, 64 << 10);
    nbd_write(&export_uri(&sock, "late"), 4096, &late_data, true);

    // Verified writes on the three volumes at once, then kill -9.
    let jobs: Vec<(&str, String, u64)> = [("", 11u64), ("fast", 22), ("slow", 33)]
        .iter()
        .map(|&(name, seed)| (name, export_uri(&sock, name), seed))
        .collect();
    fio_all(&ctx, &jobs, false);
    let st = ctx.status(&cache);
    let dirty: u64 = st["volumes"]
        .as_array()
        .expect("volumes in status")
        .iter()
        .map(|v| u64_of(v, "dirty_blocks"))
        .sum();
    assert_eq!(dirty, u64_of(&st, "dirty_blocks"), "{st}");
    server.kill9();

    // Restart: every volume verifies.
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut server = ctx.serve(&cache, &sock, &["--metrics", &metrics_addr]);
    fio_all(&ctx, &jobs, true);
    // Per-volume metrics carry the volume's name as a label.
    let text = http_metrics(&metrics_addr);
    for line in [
        format!(
            "cairn_volume_size_bytes{{volume=\"fast\",id=\"1\"}} {}",
            12 * MIB
        ),
        format!(
            "cairn_volume_size_bytes{{volume=\"\",id=\"0\"}} {}",
            16 * MIB
        ),
        "cairn_volume_connections{volume=\"late\",id=\"3\"} 0".to_string(),
        // Four volumes: a quarter of the log each, by default.
        "cairn_volume_dirty_share_pct{volume=\"fast\",id=\"1\"} 25".to_string(),
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "{line} missing in:\n{text}"
        );
    }
    assert!(
        text.contains("cairn_volume_info{volume=\"slow\",id=\"2\",origin=\"nbd+unix:"),
        "{text}"
    );
    assert!(
        text.contains("cairn_volume_dirty_limit_blocks{volume=\"fast\",id=\"1\"} "),
        "the other volumes hold blocks, so a limit applies: {text}"
    );
    let dirty: u64 = text
        .lines()
        .filter(|l| l.starts_with("cairn_volume_dirty_blocks{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    let total = text
        .lines()
        .find_map(|l| l.strip_prefix("cairn_dirty_blocks "))
        .and_then(|v| v.parse::<u64>().ok())
        .expect("cairn_dirty_blocks");
    assert_eq!(dirty, total, "per-volume dirty blocks add up:\n{text}");
    let one = ctx.cairn_ok(&[
        "status", "--cache", &cache_arg, "--volume", "slow", "--json",
    ]);
    let one = json_in(&stdout(&one));
    assert_eq!(one["name"], "slow", "{one}");
    assert_eq!(one["size_bytes"], 10 * MIB, "{one}");
    assert_eq!(one["cache"]["served"], true, "{one}");
    let unknown = ctx.cairn(&["status", "--cache", &cache_arg, "--volume", "nosuch"]);
    assert_clean_failure(&unknown, &["no volume is named"]);
    // Negative control: the verifier fails where fio never wrote (the
    // last 4 MiB of volume "fast"), so the passes above checked data.
    let mut never = fio_verified_args(&export_uri(&sock, "fast"), 22, true);
    never.retain(|a| !a.starts_with("--offset") && !a.starts_with("--size"));
    never.extend(["--offset=8M".to_string(), "--size=4M".to_string()]);
    let wrong = fio(&ctx, "never-written", &never);
    assert!(
        !wrong.status.success(),
        "fio verified a region it never wrote: {}",
        describe(&wrong)
    );
    // And the volumes hold their own data, not each other's.
    let firsts: Vec<Vec<u8>> = ["", "fast", "slow"]
        .iter()
        .map(|name| nbd_read(&export_uri(&sock, name), 0, MIB as usize))
        .collect();
    assert!(
        firsts[0] != firsts[1] && firsts[1] != firsts[2] && firsts[0] != firsts[2],
        "two volumes read the same data"
    );
    assert_same_bytes(
        "late after kill -9",
        &nbd_read(&export_uri(&sock, "late"), 4096, late_data.len()),
        &late_data,
    );

    // Drain: each origin then holds exactly its volume.
    let out = ctx.flush(&cache);
    assert!(
        stdout(&out).contains("write-back complete"),
        "{}",
        describe(&out)
    );
    let st = ctx.status(&cache);
    assert_eq!(u64_of(&st, "dirty_blocks"), 0, "{st}");
    for (name, origin) in [
        ("", &local),
        ("fast", &fast.file),
        ("slow", &slow.file),
        ("late", &late),
    ] {
        let size = std::fs::metadata(origin).expect("origin").len();
        let volume = nbd_read(&export_uri(&sock, name), 0, size as usize);
        let on_origin = std::fs::read(origin).expect("read origin");
        assert_same_bytes(&format!("origin of volume {name:?}"), &on_origin, &volume);
    }
    // Removal: refused while a client is connected to the export, done
    // with --force (the client is cut off); the origin keeps everything.
    let fast_data = nbd_read(&export_uri(&sock, "fast"), 0, 12 * MIB as usize);
    let mut holder = ctx.spawn(
        "holder",
        std::process::Command::new(python()).args([
            "-c",
            "import nbd, sys, time\nh = nbd.NBD()\nh.connect_uri(sys.argv[1])\nprint('connected', flush=True)\nfor _ in range(600):\n    try:\n        h.pread(4096, 0)\n    except Exception as e:\n        print('cut off:', e, flush=True)\n        break\n    time.sleep(0.1)",
            &export_uri(&sock, "fast"),
        ]),
    );
    assert!(
        eventually(std::time::Duration::from_secs(30), || holder
            .log_text()
            .contains("connected")),
        "the holding client never connected: {}",
        holder.log_text()
    );
    let refused = ctx.cairn(&["volume", "remove", "--cache", &cache_arg, "--name", "fast"]);
    assert_clean_failure(&refused, &["clients connected", "--force"]);
    ctx.cairn_ok(&[
        "volume", "remove", "--cache", &cache_arg, "--name", "fast", "--force",
    ]);
    assert!(
        eventually(std::time::Duration::from_secs(30), || holder
            .log_text()
            .contains("cut off")),
        "the client of the removed export was not cut off: {}",
        holder.log_text()
    );
    holder.kill9();
    assert_same_bytes(
        "origin of the removed volume",
        &std::fs::read(&fast.file).expect("read"),
        &fast_data,
    );
    let list = ctx.cairn_ok(&["volume", "list", "--cache", &cache_arg, "--json"]);
    assert!(!stdout(&list).contains("\"fast\""), "{}", describe(&list));
    let gone = run(tool("nbdinfo").arg(export_uri(&sock, "fast")), TOOL_TIMEOUT);
    assert!(
        !gone.status.success(),
        "the removed export still answers: {}",
        describe(&gone)
    );
    let first = ctx.cairn(&["volume", "remove", "--cache", &cache_arg, "--name", ""]);
    assert_clean_failure(&first, &["first volume"]);
    assert!(server.terminate().success());
}

/// The daemon writes back each volume on its own lane: while a write to
/// the "stuck" volume's origin takes 20 s (nbdkit's delay filter), data
/// written to the first volume afterwards reaches its origin, and the
/// stuck volume's is still on the cache. With one write-back step at a
/// time for the cache, the first volume waits the 20 s too.
#[test]
fn a_stuck_origin_does_not_hold_back_another_volumes_write_back() {
    if !require_tools("volumes", &["nbdkit"]) || !require_python_nbd("volumes") {
        return;
    }
    let ctx = Ctx::new("volumes-stuck");
    let cache = ctx.file("cache.img", 64 * MIB);
    let local = ctx.file("local.img", 8 * MIB);
    let stuck = NbdFile::start(&ctx, "stuck", 8 * MIB, &["--filter=delay"], &["wdelay=20"]);
    ctx.format(&cache, &local.to_string_lossy(), &[]);
    let cache_arg = cache.to_string_lossy().to_string();
    volume_add(&ctx, &cache_arg, "stuck", &stuck.uri(), &[]);
    let sock = ctx.path("cairn.sock");
    let mut server = ctx.serve(&cache, &sock, &[]);
    let stuck_data = pattern(71, 256 << 10);
    nbd_write(&export_uri(&sock, "stuck"), 0, &stuck_data, true);
    let dirty = |st: &serde_json::Value, i: usize| u64_of(&st["volumes"][i], "dirty_blocks");
    // Idle, write-back starts on the stuck volume within ~0.2 s; give it
    // time to be inside its origin's write.
    std::thread::sleep(std::time::Duration::from_secs(1));
    let first_data = pattern(72, 256 << 10);
    nbd_write(&export_uri(&sock, ""), 4096, &first_data, true);
    let mut st = ctx.status(&cache);
    for _ in 0..100 {
        if dirty(&st, 0) == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        st = ctx.status(&cache);
    }
    let volumes = &st["volumes"];
    assert_eq!(
        dirty(&st, 0),
        0,
        "the first volume is on its origin: {volumes}"
    );
    assert!(
        dirty(&st, 1) > 0,
        "the stuck volume's write-back is still held by its origin: {volumes}"
    );
    let on_origin = std::fs::read(&local).expect("read the first origin");
    assert!(
        on_origin[4096..4096 + first_data.len()] == first_data[..],
        "the first origin holds the data written through cairn"
    );
    server.kill9();
}

/// `cairn volume set` changes a volume's dirty share and mode after it was
/// added, offline and online: leaving write-back writes back that
/// volume's data first, the settings are stored (an offline list after a
/// kill -9 shows them), and wrong uses are refused with the reason.
#[test]
fn volume_set_changes_a_volumes_mode_and_dirty_share() {
    if !require_python_nbd("volumes") {
        return;
    }
    let ctx = Ctx::new("volumes-set");
    let cache = ctx.file("cache.img", 64 * MIB);
    let local = ctx.file("local.img", 8 * MIB);
    let second = ctx.file("second.img", 8 * MIB);
    ctx.format(&cache, &local.to_string_lossy(), &[]);
    let cache_arg = cache.to_string_lossy().to_string();
    volume_add(&ctx, &cache_arg, "second", &second.to_string_lossy(), &[]);
    let set = |args: &[&str]| {
        let mut all = vec!["volume", "set", "--cache", &cache_arg];
        all.extend_from_slice(args);
        ctx.cairn(&all)
    };
    let listed = |name: &str| {
        let out = ctx.cairn_ok(&["volume", "list", "--cache", &cache_arg, "--json"]);
        let all: serde_json::Value = serde_json::from_str(&stdout(&out)).expect("JSON");
        all.as_array()
            .expect("a list")
            .iter()
            .find(|v| v["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("{name:?} not listed: {all}"))
    };
    let out = set(&["--name", "second", "--dirty-share-pct", "10"]);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(
        stdout(&out).contains("dirty share 10%"),
        "{}",
        describe(&out)
    );
    assert_eq!(listed("second")["dirty_share_pct"], 10);
    assert_eq!(listed("second")["dirty_share_default"], false);
    for (args, reason) in [
        (
            &["--name", "second", "--dirty-share-pct", "0"][..],
            "1 to 100",
        ),
        (&["--name", "second"][..], "nothing to change"),
        (
            &["--name", "nosuch", "--mode", "writethrough"][..],
            "nosuch",
        ),
    ] {
        let out = set(args);
        assert!(!out.status.success(), "{args:?}: {}", describe(&out));
        assert!(
            stderr(&out).contains(reason),
            "{args:?}: {}",
            describe(&out)
        );
    }
    let sock = ctx.path("cairn.sock");
    let mut server = ctx.serve(&cache, &sock, &[]);
    let data = pattern(81, 128 << 10);
    nbd_write(&export_uri(&sock, "second"), 8192, &data, true);
    assert!(u64_of(&listed("second"), "dirty_blocks") > 0);
    let out = set(&["--name", "second", "--mode", "writethrough"]);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(
        stdout(&out).contains("32 dirty blocks written back first"),
        "{}",
        describe(&out)
    );
    let v = listed("second");
    assert_eq!(v["mode"], "writethrough", "{v}");
    assert_eq!(v["dirty_blocks"], 0, "{v}");
    let on_origin = std::fs::read(&second).expect("read the origin");
    assert!(on_origin[8192..8192 + data.len()] == data[..]);
    let out = set(&["--name", "second", "--dirty-share-pct", "default"]);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(stdout(&out).contains("(the default)"), "{}", describe(&out));
    server.kill9();
    let v = listed("second");
    assert_eq!(v["mode"], "writethrough", "stored: {v}");
    assert_eq!(v["dirty_share_default"], true, "stored: {v}");
    assert_eq!(
        listed("")["mode"],
        "writeback",
        "the first volume kept its mode"
    );
}
