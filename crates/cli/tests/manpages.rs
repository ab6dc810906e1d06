//! Manual pages and shell completions, generated from the command line's
//! definition (issue 18): `cairn manpages DIR` writes `cairn.1` and one
//! `cairn-COMMAND.1` per command that `man -l` renders, each naming its
//! options; `cairn completions bash|zsh|fish` prints a script the shell
//! accepts. Needs man (man-db) and bash; skips without them, fails under
//! CI=true.

mod common;

use common::*;

const COMMANDS: &[&str] = &[
    "format", "serve", "status", "flush", "check", "mode", "set", "warm", "top", "demo",
];

#[test]
fn manpages_render_with_man_and_name_every_option() {
    if !require_tools("manpages", &["man"]) {
        return;
    }
    let ctx = Ctx::new("manpages");
    let dir = ctx.path("man1");
    let out = ctx.cairn_ok(&["manpages", &dir.to_string_lossy()]);
    assert!(stdout(&out).contains("manual pages"), "{}", describe(&out));
    let pages: Vec<String> = std::iter::once("cairn".to_string())
        .chain(COMMANDS.iter().map(|c| format!("cairn-{c}")))
        .collect();
    for page in &pages {
        let path = dir.join(format!("{page}.1"));
        assert!(path.is_file(), "{} was not written", path.display());
        let rendered = run_ok(
            tool("man")
                .arg("-l")
                .arg("-P")
                .arg("cat")
                .arg(&path)
                .env("MANWIDTH", "100"),
            TOOL_TIMEOUT,
        );
        let text = stdout(&rendered);
        assert!(
            text.contains("NAME") && text.contains(page.as_str()),
            "{page}: {text}"
        );
        if page == "cairn-serve" {
            for option in [
                "--cache",
                "--socket",
                "--idle-exit-secs",
                "--origin-queue-depth",
            ] {
                assert!(
                    text.contains(option),
                    "cairn-serve(1) lacks {option}: {text}"
                );
            }
            assert!(text.contains("SIGTERM"), "the long help is in the page");
        }
        if page == "cairn" {
            for c in COMMANDS {
                assert!(
                    text.contains(&format!("cairn-{c}(1)")) || text.contains(c),
                    "cairn(1) names {c}"
                );
            }
        }
    }
}

#[test]
fn completion_scripts_parse_and_know_the_commands() {
    if !require_tools("completions", &["bash"]) {
        return;
    }
    let ctx = Ctx::new("completions");
    for shell in ["bash", "zsh", "fish"] {
        let out = ctx.cairn_ok(&["completions", shell]);
        let script = stdout(&out);
        assert!(
            script.contains("serve") && script.contains("cache"),
            "{shell}: {script}"
        );
        let file = ctx.path(&format!("cairn.{shell}"));
        std::fs::write(&file, &script).unwrap();
        // Each shell checks its own syntax where it is installed; bash is.
        let checker = match shell {
            "bash" => Some(("bash", vec!["-n"])),
            "zsh" => tool_path("zsh").map(|_| ("zsh", vec!["-n"])),
            "fish" => tool_path("fish").map(|_| ("fish", vec!["--no-execute"])),
            _ => None,
        };
        if let Some((sh, args)) = checker {
            run_ok(tool(sh).args(&args).arg(&file), TOOL_TIMEOUT);
        }
    }
    let bad = ctx.cairn(&["completions", "tcsh"]);
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("possible values"),
        "{}",
        describe(&bad)
    );
}
