//! Settings that persist (issue 18): `cairn set` stores policy settings in
//! the cache, offline and online; `serve` uses them after a restart, a
//! `serve` flag overrides one for that run only, and `status` shows each
//! with its source. Online, a change applies at once (checked by its
//! effect: n-hit promotion), but the page-cache setting, which waits for
//! the next start. Bad values are refused with the reason.

mod common;

use common::*;

fn setting(st: &serde_json::Value, name: &str) -> (serde_json::Value, String) {
    let s = &st["settings"][name];
    (
        s["value"].clone(),
        s["source"]
            .as_str()
            .unwrap_or_else(|| panic!("no {name}: {st}"))
            .to_string(),
    )
}

#[test]
fn settings_persist_flags_override_and_online_changes_apply_at_once() {
    let ctx = Ctx::new("settings");
    let (cache, _origin) = ctx.setup(8 << 20, 32 << 20);
    let c = cache.to_string_lossy().into_owned();

    // Nothing stored: the defaults.
    let st = ctx.status(&cache);
    assert_eq!(
        setting(&st, "sequential_cutoff_bytes"),
        (4194304.into(), "default".into())
    );

    // Offline.
    ctx.cairn_ok(&[
        "set",
        "--cache",
        &c,
        "--sequential-cutoff",
        "8M",
        "--writeback-high-pct",
        "70",
    ]);
    let st = ctx.status(&cache);
    assert_eq!(
        setting(&st, "sequential_cutoff_bytes"),
        (8388608.into(), "stored".into())
    );
    assert_eq!(
        setting(&st, "writeback_high_pct"),
        (70.into(), "stored".into())
    );

    // Refused: nothing named, watermarks out of order, out of range.
    for (args, needle) in [
        (vec![], "nothing to set"),
        (vec!["--writeback-low-pct", "90"], "must not exceed"),
        (vec!["--writeback-high-pct", "101"], "101"),
        (vec!["--promote-after", "0"], "0"),
    ] {
        let mut all = vec!["set", "--cache", &c];
        all.extend(args.iter().copied());
        let out = ctx.cairn(&all);
        assert!(!out.status.success(), "{all:?} was accepted");
        assert!(stderr(&out).contains(needle), "{all:?}: {}", describe(&out));
    }

    // A flag overrides for this run; online changes apply and are stored.
    let sock = ctx.path("nbd.sock");
    let mut server = ctx.serve(&cache, &sock, &["--writeback-high-pct", "60"]);
    let st = ctx.status(&cache);
    assert_eq!(
        setting(&st, "writeback_high_pct"),
        (60.into(), "flag".into())
    );
    assert_eq!(
        setting(&st, "sequential_cutoff_bytes"),
        (8388608.into(), "stored".into())
    );
    let out = ctx.cairn_ok(&[
        "set",
        "--cache",
        &c,
        "--promote-after",
        "2",
        "--page-cache-reads",
        "off",
        "--json",
    ]);
    let reply: serde_json::Value = serde_json::from_slice(&out.stdout).expect("set --json");
    assert_eq!(
        reply["restart_needed"],
        serde_json::json!(["page_cache_reads"]),
        "{reply}"
    );
    let st = ctx.status(&cache);
    assert_eq!(
        setting(&st, "promote_after_misses"),
        (2.into(), "stored".into())
    );
    assert_eq!(
        setting(&st, "page_cache_reads"),
        (true.into(), "default".into()),
        "the running daemon keeps the page-cache setting it opened with"
    );
    assert_eq!(
        setting(&st, "writeback_high_pct"),
        (60.into(), "flag".into()),
        "the flag still holds"
    );
    // A change that fits what is stored but not this run's flag (high 60)
    // is refused while serving, and nothing is stored.
    let clash = ctx.cairn(&["set", "--cache", &c, "--writeback-low-pct", "65"]);
    assert!(!clash.status.success(), "{}", describe(&clash));
    assert!(
        stderr(&clash).contains("must not exceed"),
        "{}",
        describe(&clash)
    );
    let st = ctx.status(&cache);
    assert_eq!(
        setting(&st, "writeback_low_pct"),
        (10.into(), "default".into()),
        "{st}"
    );
    // n-hit promotion at 2, live: the first miss of a block does not
    // promote it, the second does.
    let uri = server.uri();
    let promotions = |ctx: &Ctx| u64_of(&ctx.status(&cache), "promotions");
    let before = promotions(&ctx);
    nbd_read(&uri, 20 << 20, 4096);
    assert_eq!(promotions(&ctx), before, "promoted on the first miss");
    nbd_read(&uri, 20 << 20, 4096);
    assert_eq!(
        promotions(&ctx),
        before + 1,
        "not promoted on the second miss"
    );
    assert!(server.terminate().success());

    // After a restart without flags: everything stored, the flag gone.
    let mut server = ctx.serve(&cache, &sock, &[]);
    let st = ctx.status(&cache);
    assert_eq!(
        setting(&st, "writeback_high_pct"),
        (70.into(), "stored".into())
    );
    assert_eq!(
        setting(&st, "page_cache_reads"),
        (false.into(), "stored".into())
    );
    assert!(
        server.proc.log_text().contains("page_cache_reads=false"),
        "the engine opened with the stored setting: {}",
        server.proc.log_text()
    );
    ctx.cairn_ok(&[
        "set",
        "--cache",
        &c,
        "--reset",
        "writeback-high-pct",
        "--reset",
        "page-cache-reads",
    ]);
    let st = ctx.status(&cache);
    assert_eq!(
        setting(&st, "writeback_high_pct"),
        (50.into(), "default".into())
    );
    assert!(server.terminate().success());
    let st = ctx.status(&cache);
    assert_eq!(
        setting(&st, "page_cache_reads"),
        (true.into(), "default".into())
    );
    assert_eq!(
        setting(&st, "promote_after_misses"),
        (2.into(), "stored".into())
    );
}
