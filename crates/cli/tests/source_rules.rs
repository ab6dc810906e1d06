//! The workspace's source rules, checked with the scripts developers run
//! by hand: no file-level import cycles inside a crate, and no function in
//! `crates/*/src` over 100 lines without a reason written beside it.

use std::path::Path;
use std::process::Command;

fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .and_then(Path::parent)
        .expect("crates/cli sits two levels below the workspace root")
}

fn run_script(script: &str, args: &[&str]) {
    let root = workspace_root();
    let out = match Command::new("python3")
        .arg(root.join(script))
        .args(args)
        .current_dir(root)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "python3 is needed for {script} (CI=true): {e}"
            );
            eprintln!("skipping {script}: python3 not available ({e})");
            return;
        }
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{script} found problems:\n{text}");
}

#[test]
fn no_file_level_import_cycles() {
    run_script("scripts/import-cycles.py", &[]);
}

#[test]
fn no_function_over_100_lines_without_a_reason() {
    run_script("scripts/long-functions.py", &["100"]);
}

/// The README's quick start is `cargo run --release -- demo` at the
/// workspace root: with two binaries in the workspace, cargo refuses to
/// choose unless the default members hold only the cairn binary's crate.
#[test]
fn cargo_run_at_the_root_runs_cairn() {
    let manifest = std::fs::read_to_string(workspace_root().join("Cargo.toml")).unwrap();
    let line = manifest
        .lines()
        .find(|l| l.trim_start().starts_with("default-members"))
        .expect("the workspace Cargo.toml sets default-members");
    assert_eq!(
        line.split('=').nth(1).map(str::trim),
        Some(r#"["crates/cli"]"#),
        "{line}"
    );
}
