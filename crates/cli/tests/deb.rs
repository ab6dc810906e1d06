//! The Debian package (issue 18): `scripts/build-deb.sh --no-build` (cargo
//! deb) packs the binary under test with its manual pages, completions and
//! systemd units; unpacked with `dpkg -x` into a scratch root, the unpacked
//! `cairn --version` runs and `man -l` renders a page. Needs cargo-deb,
//! dpkg and man; skips without them, fails under CI=true.

mod common;

use std::path::Path;

use common::*;

#[test]
fn the_deb_unpacks_to_a_working_cairn_with_pages_and_units() {
    if !require_tools("deb", &["cargo-deb", "dpkg", "dpkg-deb", "man"]) {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // The script packs target/release/cairn: the binary under test.
    assert!(
        Path::new(CAIRN).ends_with("target/release/cairn"),
        "run the suite with --release (the package takes target/release/cairn; this is {CAIRN})"
    );
    let out = run_ok(
        std::process::Command::new("bash")
            .arg(root.join("scripts/build-deb.sh"))
            .arg("--no-build")
            .current_dir(&root),
        TOOL_TIMEOUT,
    );
    let deb = stdout(&out)
        .lines()
        .rev()
        .find(|l| l.trim_end().ends_with(".deb"))
        .map(|l| root.join(l.trim()))
        .unwrap_or_else(|| panic!("no .deb named: {}", describe(&out)));
    assert!(deb.is_file(), "{} missing", deb.display());
    let listing = stdout(&run_ok(tool("dpkg-deb").arg("-c").arg(&deb), TOOL_TIMEOUT));
    for path in [
        "./usr/bin/cairn",
        "./usr/share/man/man1/cairn.1",
        "./usr/share/man/man1/cairn-serve.1",
        "./usr/share/bash-completion/completions/cairn",
        "./usr/share/zsh/vendor-completions/_cairn",
        "./usr/share/fish/vendor_completions.d/cairn.fish",
        "./lib/systemd/system/cairn@.service",
        "./lib/systemd/system/cairn@.socket",
        "./usr/share/doc/cairn/README.md",
    ] {
        assert!(
            listing.lines().any(|l| l.contains(path)),
            "the package lacks {path}:\n{listing}"
        );
    }
    let ctx = Ctx::new("deb");
    let scratch = ctx.path("root");
    run_ok(tool("dpkg").arg("-x").arg(&deb).arg(&scratch), TOOL_TIMEOUT);
    let version = run_ok(
        std::process::Command::new(scratch.join("usr/bin/cairn")).arg("--version"),
        TOOL_TIMEOUT,
    );
    assert!(
        stdout(&version).starts_with("cairn "),
        "{}",
        describe(&version)
    );
    let page = std::fs::read_dir(scratch.join("usr/share/man/man1"))
        .expect("man1")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("cairn-serve.1"))
        })
        .expect("cairn-serve's page");
    let man = run_ok(
        tool("man").arg("-l").arg("-P").arg("cat").arg(&page),
        TOOL_TIMEOUT,
    );
    assert!(stdout(&man).contains("--cache"), "{}", describe(&man));
    let _ = std::io::Write::write_all(
        &mut std::io::stderr(),
        format!("deb: {}\n{listing}", deb.display()).as_bytes(),
    );
}
