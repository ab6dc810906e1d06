//! Block status that tells the truth (issue 18): `NBD_CMD_BLOCK_STATUS`
//! reports the origin's holes (SEEK_DATA/SEEK_HOLE of a file origin), the
//! discards and write-zeroes cairn still tracks, and data wherever data may
//! be (cached blocks, dirty or clean), so `nbdinfo --map` shows a sparse
//! volume as sparse and `nbdcopy` reads only its data. Needs nbdinfo,
//! nbdcopy and python3-libnbd; skips without them, fails under CI=true.

mod common;

use common::*;

const MIB: u64 = 1 << 20;

/// `nbdinfo --map`: (offset, length, description) per extent.
fn map(uri: &str) -> Vec<(u64, u64, String)> {
    let out = run_ok(tool("nbdinfo").arg("--map").arg(uri), TOOL_TIMEOUT);
    stdout(&out)
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let offset = w.next()?.parse().ok()?;
            let length = w.next()?.parse().ok()?;
            let _flags = w.next()?;
            Some((offset, length, w.collect::<Vec<_>>().join(" ")))
        })
        .collect()
}

/// The description of the extent holding byte `at`.
fn state_at(map: &[(u64, u64, String)], at: u64) -> &str {
    map.iter()
        .find(|(o, l, _)| *o <= at && at < o + l)
        .map(|(_, _, d)| d.as_str())
        .unwrap_or_else(|| panic!("no extent covers {at}: {map:?}"))
}

/// A sparse file of `size` bytes holding `data` at `at` only.
fn sparse_file(ctx: &Ctx, name: &str, size: u64, at: u64, data: &[u8]) -> std::path::PathBuf {
    use std::io::{Seek, SeekFrom, Write};
    let path = ctx.file(name, size);
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(data).unwrap();
    f.sync_all().unwrap();
    path
}

/// `nbdcopy` of the whole volume: the copy's bytes, and how many bytes the
/// daemon read to make it (status `read_bytes` before and after).
fn copy_volume(ctx: &Ctx, cache: &std::path::Path, uri: &str) -> (Vec<u8>, u64) {
    let before = ctx.status(cache);
    let copy = ctx.path("copy.img");
    run_ok(tool("nbdcopy").arg(uri).arg(&copy), TOOL_TIMEOUT);
    let after = ctx.status(cache);
    let read = u64_of(&after, "read_bytes") - u64_of(&before, "read_bytes");
    (std::fs::read(&copy).unwrap(), read)
}

#[test]
fn block_status_shows_origin_holes_tracked_zeroes_and_cached_data() {
    if !require_tools("block_status", &["nbdinfo", "nbdcopy"])
        || !require_python_nbd("block_status")
    {
        return;
    }
    let ctx = Ctx::new("block_status");
    let size = 64 * MIB;
    // A sparse origin: data only in [8 MiB, 10 MiB).
    let origin = sparse_file(
        &ctx,
        "origin.img",
        size,
        8 * MIB,
        &pattern(0x42, 2 * MIB as usize),
    );
    let cache = ctx.file("cache.img", 16 * MIB);
    ctx.format(&cache, &origin.to_string_lossy(), &[]);
    let sock = ctx.path("nbd.sock");
    // Write-back held: the discards and zeroes stay tracked by cairn.
    let server = ctx.serve(&cache, &sock, &["--no-writeback"]);
    let uri = server.uri();

    let m = map(&uri);
    assert_eq!(state_at(&m, 0), "hole,zero", "{m:?}");
    assert_eq!(state_at(&m, 8 * MIB), "data", "{m:?}");
    assert_eq!(state_at(&m, 10 * MIB - 1), "data", "{m:?}");
    assert_eq!(state_at(&m, 20 * MIB), "hole,zero", "{m:?}");
    assert_eq!(
        m.iter().map(|e| e.1).sum::<u64>(),
        size,
        "the map covers the volume"
    );

    // A write into a hole is data (dirty, in the cache only); a discard of
    // the origin's data reads as zeroes, and a write-zeroes is zero.
    let written = pattern(0x43, MIB as usize);
    nbd_write(&uri, 32 * MIB, &written, true);
    // libnbd's trim and zero take (count, offset).
    let script = format!(
        "import nbd\nh = nbd.NBD()\nh.connect_uri({uri:?})\nh.trim({}, {})\nh.zero({}, {})\nh.flush()\n",
        MIB,
        8 * MIB,
        2 * MIB,
        48 * MIB
    );
    run_ok(
        std::process::Command::new(python()).arg("-c").arg(&script),
        TOOL_TIMEOUT,
    );
    let m = map(&uri);
    assert_eq!(state_at(&m, 32 * MIB), "data", "{m:?}");
    assert_eq!(state_at(&m, 33 * MIB - 1), "data", "{m:?}");
    assert_eq!(state_at(&m, 33 * MIB), "hole,zero", "{m:?}");
    assert_eq!(
        state_at(&m, 8 * MIB),
        "hole,zero",
        "a tracked discard: {m:?}"
    );
    assert_eq!(state_at(&m, 9 * MIB), "data", "{m:?}");
    assert_eq!(
        state_at(&m, 48 * MIB),
        "zero",
        "a tracked write-zeroes: {m:?}"
    );
    assert_eq!(state_at(&m, 50 * MIB), "hole,zero", "{m:?}");
    assert!(nbd_read(&uri, 8 * MIB, MIB as usize)
        .iter()
        .all(|&b| b == 0));

    // nbdcopy reads only the data: 1 MiB of the origin's and the 1 MiB
    // written, not 64 MiB.
    let (copy, read) = copy_volume(&ctx, &cache, &uri);
    assert!(
        read <= 4 * MIB,
        "nbdcopy read {read} bytes of a volume with 2 MiB of data"
    );
    let _ = std::io::Write::write_all(
        &mut std::io::stderr(),
        format!("block status: nbdcopy of a 64 MiB volume with 2 MiB of data read {read} bytes\n")
            .as_bytes(),
    );
    let mut image = vec![0u8; size as usize];
    image[9 * MIB as usize..10 * MIB as usize]
        .copy_from_slice(&pattern(0x42, 2 * MIB as usize)[MIB as usize..]);
    image[32 * MIB as usize..33 * MIB as usize].copy_from_slice(&written);
    assert_same_bytes("the copy", &copy, &image);
}

/// The same over an NBD origin: the origin's own block status (asked on a
/// side connection of nbdkit's file plugin) shows its holes through cairn.
#[test]
fn block_status_shows_the_holes_of_an_nbd_origin() {
    if !require_tools("block_status_nbd", &["nbdinfo", "nbdcopy", "nbdkit"]) {
        return;
    }
    let ctx = Ctx::new("block_status_nbd");
    let size = 64 * MIB;
    let origin = sparse_file(
        &ctx,
        "origin.img",
        size,
        40 * MIB,
        &pattern(0x44, MIB as usize),
    );
    let origin_sock = ctx.path("origin.sock");
    let _nbdkit = start_nbdkit(&ctx, &origin_sock, &["file", &origin.to_string_lossy()]);
    let origin_uri = format!("nbd+unix:///?socket={}", origin_sock.display());
    let cache = ctx.file("cache.img", 16 * MIB);
    ctx.format(&cache, &origin_uri, &[]);
    let sock = ctx.path("nbd.sock");
    let server = ctx.serve(&cache, &sock, &[]);
    let uri = server.uri();

    let m = map(&uri);
    assert_eq!(state_at(&m, 0), "hole,zero", "{m:?}");
    assert_eq!(state_at(&m, 40 * MIB), "data", "{m:?}");
    assert_eq!(state_at(&m, 41 * MIB - 1), "data", "{m:?}");
    assert_eq!(state_at(&m, 41 * MIB), "hole,zero", "{m:?}");
    assert_eq!(m.iter().map(|e| e.1).sum::<u64>(), size, "{m:?}");

    // A write into a hole is data at once (dirty in the cache), and stays
    // data after write-back reached the origin.
    let written = pattern(0x45, MIB as usize);
    nbd_write(&uri, 4 * MIB, &written, true);
    assert_eq!(state_at(&map(&uri), 4 * MIB), "data");
    assert!(
        eventually(std::time::Duration::from_secs(30), || u64_of(
            &ctx.status(&cache),
            "dirty_blocks"
        ) == 0),
        "write-back did not drain"
    );
    assert_eq!(state_at(&map(&uri), 4 * MIB), "data");

    let (copy, read) = copy_volume(&ctx, &cache, &uri);
    assert!(
        read <= 4 * MIB,
        "nbdcopy read {read} bytes of a volume with 2 MiB of data"
    );
    let mut image = vec![0u8; size as usize];
    image[4 * MIB as usize..5 * MIB as usize].copy_from_slice(&written);
    image[40 * MIB as usize..41 * MIB as usize].copy_from_slice(&pattern(0x44, MIB as usize));
    assert_same_bytes("the copy", &copy, &image);
}
