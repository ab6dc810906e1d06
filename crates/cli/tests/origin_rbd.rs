//! cairn in front of a Ceph RBD image (issue 19), against a real
//! single-node cluster from `scripts/ceph-dev-cluster.sh`:
//!
//! 1. format over an image; a second client is refused while cairn holds
//!    the image's exclusive lock, and the refusal names the holder;
//! 2. fio writes a verified region (fsync'd), more load runs, `kill -9`;
//!    restart (the dead daemon's lock is taken over), `fio --verify_only`
//!    reports 0 errors; drain, stop, and `rbd export` of the image equals
//!    the volume read through cairn;
//! 3. the OSD frozen (SIGSTOP), and then its process stopped, while
//!    serving: cached reads still work, fsync'd writes are absorbed, status
//!    says the origin is failing; the OSD back, write-back drains, and the
//!    image holds every write;
//! 4. the image shrunk by another client while serving (librbd carries it
//!    out for the lock's holder): writes are absorbed and held, status
//!    says what happened and how to undo it; grown back, write-back
//!    drains and the image holds every write;
//! 5. the cluster blocklists cairn's client while it serves (as when
//!    another client breaks its lock): the writes acknowledged before are
//!    kept, new ones fail with EIO, status says the origin is fenced; a
//!    restart writes the kept ones back;
//! 6. with cairn stopped, another cache is still refused: the image's
//!    metadata holds this cache's claim; removed by hand, this cache is
//!    refused too until it is set again;
//! 7. the image deleted and made again under its name is refused;
//! 8. an image in a namespace of the pool (`rbd:POOL/NAMESPACE/IMAGE`):
//!    a missing namespace is named, and the namespace's image, not the
//!    default one of the same name, is claimed and written back.
//!
//! Needs ceph-mon, ceph-osd, ceph-mgr, ceph, rbd (Debian's ceph packages),
//! fio and nbdcopy; skips without them, fails under CI=true.

mod common;

use std::time::Duration;

use common::*;

const MIB: u64 = 1 << 20;
const VOLUME_BYTES: u64 = 128 * MIB;

fn fio(ctx: &Ctx, args: &[String]) -> serde_json::Value {
    let out = run(
        tool("fio").current_dir(&ctx.dir.path).args(args),
        TOOL_TIMEOUT,
    );
    assert!(out.status.success(), "fio: {}", describe(&out));
    let job = json_in(&stdout(&out))["jobs"][0].clone();
    assert_eq!(job["error"], 0, "{job}");
    job
}

/// The whole volume through cairn.
fn volume_image(ctx: &Ctx, uri: &str, name: &str) -> Vec<u8> {
    let path = ctx.path(name);
    run_ok(tool("nbdcopy").arg(uri).arg(&path), TOOL_TIMEOUT);
    std::fs::read(&path).unwrap()
}

fn image_export(ctx: &Ctx, ceph: &CephCluster, name: &str) -> Vec<u8> {
    let path = ctx.path(name);
    ceph.rbd(&["export", "rbd/vol", &path.to_string_lossy()]);
    std::fs::read(&path).unwrap()
}

fn wait_drained(ctx: &Ctx, cache: &std::path::Path) {
    ctx.flush(cache);
    assert!(
        eventually(Duration::from_secs(120), || {
            let st = ctx.status(cache);
            u64_of(&st, "dirty_blocks") == 0
        }),
        "write-back did not drain: {}",
        ctx.status(cache)
    );
}

/// An OSD outage (`verbs`: the cluster script's stop and start) while
/// cairn serves: a cached read still works, an fsync'd write is absorbed,
/// status says the origin is failing; after the OSD is back, write-back
/// drains and the image holds every write.
fn osd_outage(
    ctx: &Ctx,
    ceph: &CephCluster,
    cache: &std::path::Path,
    serve_args: &[&str],
    verbs: (&str, &str),
    round: u64,
) {
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(cache, &sock, serve_args);
    let uri = server.uri();
    let at = (64 + 8 * round) * MIB;
    let cached = pattern(0x19 + round, MIB as usize);
    nbd_write(&uri, at, &cached, true);
    assert_eq!(nbd_read(&uri, at, MIB as usize), cached);
    wait_drained(ctx, cache);
    ceph.script(verbs.0);
    assert_eq!(
        nbd_read(&uri, at, MIB as usize),
        cached,
        "a cached read while the OSD is out ({})",
        verbs.0
    );
    let absorbed_at = (96 + 8 * round) * MIB;
    let absorbed = pattern(0x20 + round, MIB as usize);
    nbd_write(&uri, absorbed_at, &absorbed, true);
    let failing = eventually(Duration::from_secs(60), || {
        ctx.status(cache)["origin_state"] == "failing"
    });
    let st = ctx.status(cache);
    ceph.script(verbs.1);
    assert!(
        failing,
        "{}: status says the origin is failing: {st}",
        verbs.0
    );
    assert!(u64_of(&st, "dirty_blocks") > 0, "{st}");
    wait_drained(ctx, cache);
    assert!(
        eventually(Duration::from_secs(60), || ctx.status(cache)
            ["origin_state"]
            == "ok"),
        "{}",
        ctx.status(cache)
    );
    let volume = volume_image(ctx, &uri, &format!("volume-{}.img", verbs.0));
    server.terminate();
    let export = image_export(ctx, ceph, &format!("export-{}.img", verbs.0));
    assert_same_bytes(&format!("rbd export after {}", verbs.1), &export, &volume);
    assert_same_bytes(
        "the write absorbed while the OSD was out",
        &export[absorbed_at as usize..(absorbed_at + MIB) as usize],
        &absorbed,
    );
}

/// The image grew while cairn was stopped (its id unchanged): served at
/// the volume's recorded size, and a later shrink back to that size is
/// no shrink of the volume, so writes and write-back go on.
fn image_grown_before_a_restart(
    ctx: &Ctx,
    ceph: &CephCluster,
    cache: &std::path::Path,
    serve_args: &[&str],
) {
    ceph.rbd(&["resize", "--size", "160M", "rbd/vol"]);
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(cache, &sock, serve_args);
    let uri = server.uri();
    let st = ctx.status(cache);
    assert_eq!(u64_of(&st, "volume_size_bytes"), 128 * MIB, "{st}");
    let first = pattern(0x41, MIB as usize);
    nbd_write(&uri, 100 * MIB, &first, true);
    wait_drained(ctx, cache);
    ceph.rbd(&[
        "resize",
        "--allow-shrink",
        "--size",
        "134217728B",
        "rbd/vol",
    ]);
    let second = pattern(0x42, MIB as usize);
    nbd_write(&uri, 110 * MIB, &second, true);
    wait_drained(ctx, cache);
    let st = ctx.status(cache);
    assert_eq!(st["origin_state"], "ok", "{st}");
    server.terminate();
    assert!(
        server.proc.log_text().contains("the origin grew"),
        "{}",
        server.proc.log_text()
    );
    let export = image_export(ctx, ceph, "export-grown.img");
    assert_eq!(
        export.len() as u64,
        128 * MIB,
        "the image is back at its size"
    );
    assert_same_bytes(
        "written while grown",
        &export[(100 * MIB) as usize..(101 * MIB) as usize],
        &first,
    );
    assert_same_bytes(
        "written after the shrink back",
        &export[(110 * MIB) as usize..(111 * MIB) as usize],
        &second,
    );
}

/// `rbd resize --allow-shrink` from another client while cairn serves: a
/// write inside the new size and one past it are absorbed and held,
/// status names the shrink and the command that undoes it; after it,
/// write-back drains and the image holds both.
fn image_shrunk_while_serving(
    ctx: &Ctx,
    ceph: &CephCluster,
    cache: &std::path::Path,
    serve_args: &[&str],
) {
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(cache, &sock, serve_args);
    let uri = server.uri();
    wait_drained(ctx, cache);
    ceph.rbd(&["resize", "--allow-shrink", "--size", "112M", "rbd/vol"]);
    // Status names the shrink before any request meets it.
    let named = eventually(Duration::from_secs(30), || {
        let st = ctx.status(cache);
        st["origin_state"] == "failing"
            && st["volumes"][0]["origin_error"]
                .as_str()
                .is_some_and(|e| e.contains("was shrunk"))
    });
    assert!(
        named,
        "status names the shrink at once: {}",
        ctx.status(cache)
    );
    let human = stdout(&ctx.cairn(&["status", "--cache", &cache.to_string_lossy()]));
    assert!(
        human.contains("origin of volume \"\": the image rbd/vol was shrunk"),
        "{human}"
    );
    let inside = pattern(0x31, MIB as usize);
    let past = pattern(0x32, MIB as usize);
    nbd_write(&uri, 100 * MIB, &inside, true);
    nbd_write(&uri, 120 * MIB, &past, true);
    let held = eventually(Duration::from_secs(60), || {
        ctx.status(cache)["volumes"][0]["origin_error"]
            .as_str()
            .is_some_and(|e| e.contains("was shrunk"))
    });
    let st = ctx.status(cache);
    assert!(held, "status names the shrink: {st}");
    let error = st["volumes"][0]["origin_error"]
        .as_str()
        .unwrap_or_default();
    assert!(
        error.contains("from 134217728 to 117440512 bytes")
            && error.contains("rbd resize --size 134217728B rbd/vol"),
        "the error says what happened and how to undo it: {error}"
    );
    assert!(u64_of(&st, "dirty_blocks") > 0, "writes are held: {st}");
    assert_eq!(nbd_read(&uri, 120 * MIB, MIB as usize), past);
    // Held means held inside the new end too: another client reading the
    // shrunk image (reads need no lock) sees none of the write there.
    let shrunk = image_export(ctx, ceph, "export-shrunk.img");
    assert_eq!(shrunk.len() as u64, 112 * MIB, "the image is shrunk");
    assert!(
        shrunk[(100 * MIB) as usize..(101 * MIB) as usize] != inside[..],
        "the write inside the shrunk image was held, not written back"
    );
    ceph.rbd(&["resize", "--size", "134217728B", "rbd/vol"]);
    wait_drained(ctx, cache);
    assert!(
        eventually(Duration::from_secs(60), || ctx.status(cache)
            ["origin_state"]
            == "ok"),
        "{}",
        ctx.status(cache)
    );
    let volume = volume_image(ctx, &uri, "volume-resized.img");
    server.terminate();
    let export = image_export(ctx, ceph, "export-resized.img");
    assert_same_bytes(
        "rbd export after the image's size came back",
        &export,
        &volume,
    );
    assert_same_bytes(
        "the write inside the shrunk image",
        &export[(100 * MIB) as usize..(101 * MIB) as usize],
        &inside,
    );
    assert_same_bytes(
        "the write past the shrunk image's end",
        &export[(120 * MIB) as usize..(121 * MIB) as usize],
        &past,
    );
}

/// `rbd status` names cairn's client as `watcher=ADDR client.N ...`; the
/// cluster blocklists that address, as it does a client whose lock another
/// client broke. cairn keeps what it acknowledged, refuses new writes
/// (EIO) and says so; a restart (a new client) writes the kept ones back.
fn blocklisted_while_serving(
    ctx: &Ctx,
    ceph: &CephCluster,
    cache: &std::path::Path,
    serve_args: &[&str],
) {
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(cache, &sock, serve_args);
    let uri = server.uri();
    wait_drained(ctx, cache);
    let status = stdout(&ceph.rbd(&["status", "rbd/vol"]));
    let watcher = status
        .split_whitespace()
        .find_map(|w| w.strip_prefix("watcher="))
        .unwrap_or_else(|| panic!("cairn watches the image: {status}"))
        .to_string();
    ceph.ceph(&["osd", "blocklist", "add", &watcher]);
    let kept = pattern(0x51, MIB as usize);
    nbd_write(&uri, 40 * MIB, &kept, true);
    let fenced = eventually(Duration::from_secs(60), || {
        ctx.status(cache)["origin_state"] == "fenced"
    });
    let st = ctx.status(cache);
    assert!(fenced, "status says the origin fenced cairn: {st}");
    assert_eq!(st["volumes"][0]["origin_state"], "fenced", "{st}");
    assert!(
        st["volumes"][0]["origin_error"]
            .as_str()
            .is_some_and(|e| e.contains("blocklisted this client")),
        "{st}"
    );
    let refused = try_nbd_write(&uri, 44 * MIB, &pattern(0x52, MIB as usize), true);
    assert!(
        !refused.status.success() && describe(&refused).contains("EIO"),
        "a write after the fence fails with EIO: {}",
        describe(&refused)
    );
    assert!(u64_of(&ctx.status(cache), "fenced_refusals") > 0);
    assert_eq!(nbd_read(&uri, 40 * MIB, MIB as usize), kept, "reads go on");
    server.terminate();
    let mut server = ctx.serve(cache, &sock, serve_args);
    wait_drained(ctx, cache);
    assert_eq!(ctx.status(cache)["origin_state"], "ok");
    let volume = volume_image(ctx, &server.uri(), "volume-fenced.img");
    server.terminate();
    ceph.ceph(&["osd", "blocklist", "rm", &watcher]);
    let export = image_export(ctx, ceph, "export-fenced.img");
    assert_same_bytes("rbd export after the restart", &export, &volume);
    assert_same_bytes(
        "the write acknowledged before the fence",
        &export[(40 * MIB) as usize..(41 * MIB) as usize],
        &kept,
    );
}

#[test]
fn rbd_origin_survives_kill9_and_a_stopped_osd() {
    if !require_ceph("origin_rbd") || !require_tools("origin_rbd", &["fio", "nbdcopy"]) {
        return;
    }
    let ctx = Ctx::new("origin_rbd");
    let ceph = CephCluster::start(&ctx);
    ceph.rbd(&["create", "--size", "128M", "rbd/vol"]);
    let spec = ceph.spec("vol");
    let cache = ctx.file("cache.img", 32 * MIB);
    ctx.format(&cache, &spec, &[]);
    let st = ctx.status(&cache);
    assert!(
        st["origin"]
            .as_str()
            .unwrap_or_default()
            .starts_with(&format!("{spec}#")),
        "the identity is the image and its id: {st}"
    );
    let sock = ctx.path("nbd.sock");
    // Requests to a silent OSD fail after 5 s instead of the default 30 s,
    // so the test sees a failing origin quickly.
    let serving_spec = format!("{spec}&timeout=5");
    let serve_args = ["--origin", serving_spec.as_str()];

    // 1. Exclusive: while cairn serves, another cache cannot take the image.
    let mut server = ctx.serve(&cache, &sock, &serve_args);
    let other = ctx.file("other.img", 32 * MIB);
    let refused = ctx.cairn(&[
        "format",
        "--cache",
        &other.to_string_lossy(),
        "--origin",
        &spec,
    ]);
    assert_clean_failure(&refused, &["locked by another client"]);

    // 2. kill -9 under load, restart, verify.
    let uri = server.uri();
    let job = fio(&ctx, &fio_verified_args(&uri, 19, false));
    assert_eq!(job["write"]["io_bytes"], 8 * MIB, "{job}");
    let mut load = ctx.spawn(
        "fio-load",
        tool("fio").current_dir(&ctx.dir.path).args([
            "--name=load",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=4",
            "--offset=16M",
            "--size=32M",
            "--fsync=1",
            "--time_based",
            "--runtime=30",
        ]),
    );
    std::thread::sleep(Duration::from_secs(3));
    server.kill9();
    let _ = load.wait_timeout(Duration::from_secs(60));
    let mut server = ctx.serve(&cache, &sock, &serve_args);
    let uri = server.uri();
    let job = fio(&ctx, &fio_verified_args(&uri, 19, true));
    assert_eq!(
        job["read"]["io_bytes"],
        8 * MIB,
        "every verified block read: {job}"
    );
    wait_drained(&ctx, &cache);
    let volume = volume_image(&ctx, &uri, "volume-1.img");
    assert_eq!(volume.len() as u64, VOLUME_BYTES);
    server.terminate();
    assert_same_bytes(
        "rbd export after kill -9, restart and drain",
        &image_export(&ctx, &ceph, "export-1.img"),
        &volume,
    );

    // 3. The OSD frozen (SIGSTOP), then the OSD process stopped and
    //    started again, while cairn serves.
    osd_outage(
        &ctx,
        &ceph,
        &cache,
        &serve_args,
        ("pause-osd", "resume-osd"),
        0,
    );
    osd_outage(
        &ctx,
        &ceph,
        &cache,
        &serve_args,
        ("stop-osd", "start-osd"),
        1,
    );

    // 4. Another client shrinks the image while cairn serves it.
    image_shrunk_while_serving(&ctx, &ceph, &cache, &serve_args);

    // 4b. The image grows while cairn is stopped, then is shrunk back.
    image_grown_before_a_restart(&ctx, &ceph, &cache, &serve_args);

    // 5. The cluster blocklists cairn while it serves.
    blocklisted_while_serving(&ctx, &ceph, &cache, &serve_args);

    // 6. The image is this cache's from format on, served or not: Ceph
    //    hands its exclusive lock to the next client once a crashed
    //    holder's watch times out, and a second cache writing there would
    //    be rolled back by this one's replay. With cairn stopped, another
    //    cache is refused, naming this one and the way to release it.
    let claim = stdout(&ceph.rbd(&["image-meta", "get", "rbd/vol", "cairn.cache"]));
    let claim = claim.trim().to_string();
    assert!(
        claim.contains("cache=") && claim.contains("cache.img"),
        "the claim names the cache: {claim:?}"
    );
    let refused = ctx.cairn(&[
        "format",
        "--cache",
        &other.to_string_lossy(),
        "--origin",
        &spec,
    ]);
    assert_clean_failure(
        &refused,
        &[
            "belongs to another cairn cache",
            &claim,
            "rbd image-meta remove rbd/vol cairn.cache",
        ],
    );
    // Released by hand, the image is refused to this cache too (another
    // may have written there since) until claimed again.
    ceph.rbd(&["image-meta", "remove", "rbd/vol", "cairn.cache"]);
    let refused = ctx.cairn(&["flush", "--cache", &cache.to_string_lossy()]);
    assert_clean_failure(&refused, &["carries no claim by this cache"]);
    ceph.rbd(&["image-meta", "set", "rbd/vol", "cairn.cache", &claim]);
    // Claimed again, the cache opens on it (status alone opens no origin).
    ctx.flush(&cache);
    let st = ctx.status(&cache);
    assert_eq!(u64_of(&st, "dirty_blocks"), 0, "{st}");

    // 7. An image deleted and made again under the same name is another
    //    origin: its id differs, and the cache refuses it.
    ceph.rbd(&["rm", "rbd/vol"]);
    ceph.rbd(&["create", "--size", "128M", "rbd/vol"]);
    let refused = ctx.cairn(&["flush", "--cache", &cache.to_string_lossy()]);
    assert_clean_failure(&refused, &["formatted for origin"]);

    // 8. An image in a namespace of the pool, named like the one above.
    image_in_a_namespace(&ctx, &ceph);
}

/// `rbd:POOL/NAMESPACE/IMAGE`: the namespace's image is the one written,
/// claimed and checked, not the default namespace's image of that name.
fn image_in_a_namespace(ctx: &Ctx, ceph: &CephCluster) {
    let missing = ceph.spec("nosuch/vol");
    let cache = ctx.file("ns-cache.img", 32 * MIB);
    let refused = ctx.cairn(&[
        "format",
        "--cache",
        &cache.to_string_lossy(),
        "--origin",
        &missing,
    ]);
    assert_clean_failure(&refused, &["namespace \"nosuch\"", "rbd namespace ls rbd"]);
    ceph.rbd(&["namespace", "create", "rbd/tenant"]);
    ceph.rbd(&["create", "--size", "64M", "rbd/tenant/vol"]);
    let spec = ceph.spec("tenant/vol");
    ctx.format(&cache, &spec, &[]);
    let st = ctx.status(&cache);
    assert!(
        st["origin"]
            .as_str()
            .unwrap_or_default()
            .starts_with("rbd:rbd/tenant/vol?"),
        "the identity names the namespace: {st}"
    );
    let claim = stdout(&ceph.rbd(&["image-meta", "get", "rbd/tenant/vol", "cairn.cache"]));
    assert!(
        claim.contains("ns-cache.img"),
        "claimed in the namespace: {claim:?}"
    );
    let sock = ctx.path("ns.sock");
    let mut server = ctx.serve(&cache, &sock, &[]);
    let uri = server.uri();
    let data = pattern(0x77, MIB as usize);
    nbd_write(&uri, 3 * MIB, &data, true);
    wait_drained(ctx, &cache);
    server.terminate();
    let path = ctx.path("export-ns.img");
    ceph.rbd(&["export", "rbd/tenant/vol", &path.to_string_lossy()]);
    let export = std::fs::read(&path).unwrap();
    assert_eq!(export.len() as u64, 64 * MIB);
    assert_same_bytes(
        "the namespace's image holds the write",
        &export[(3 * MIB) as usize..(4 * MIB) as usize],
        &data,
    );
    let default_ns = image_export(ctx, ceph, "export-default-ns.img");
    assert!(
        default_ns[(3 * MIB) as usize..(4 * MIB) as usize] != data[..],
        "the default namespace's image of the same name is untouched"
    );

    // The device formatted again for another image: the first image's
    // claim is from an earlier cache on this same device, and its refusal
    // says so rather than naming the device as another cache.
    ceph.rbd(&["create", "--size", "64M", "rbd/tenant/other"]);
    ctx.format(&cache, &ceph.spec("tenant/other"), &["--force"]);
    let refused = ctx.cairn(&[
        "format",
        "--force",
        "--cache",
        &cache.to_string_lossy(),
        "--origin",
        &spec,
    ]);
    assert_clean_failure(
        &refused,
        &[
            "an earlier cache on this same device",
            "rbd image-meta remove rbd/tenant/vol cairn.cache",
        ],
    );
}
