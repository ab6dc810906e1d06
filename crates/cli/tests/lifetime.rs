//! Lifetime counters (issue 18): each counter's total over every run of a
//! cache, persisted with the checkpoint, beside the since-start counters,
//! in `status --json` (`lifetime`) and the metrics (`cairn_lifetime_*`).

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::*;

fn lifetime(st: &serde_json::Value, name: &str) -> u64 {
    st["lifetime"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("no lifetime {name}: {st}"))
}

#[test]
fn lifetime_counters_survive_restarts_beside_the_since_start_ones() {
    if !require_python_nbd("lifetime") {
        return;
    }
    let ctx = Ctx::new("lifetime");
    let (cache, _origin) = ctx.setup(8 << 20, 32 << 20);
    let sock = ctx.path("nbd.sock");
    let mut total_writes = 0;
    for run in 0..3u64 {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut server = ctx.serve(&cache, &sock, &["--metrics", &addr]);
        let st = ctx.status(&cache);
        assert_eq!(u64_of(&st, "writes"), 0, "since start: run {run}");
        assert_eq!(
            lifetime(&st, "writes"),
            total_writes,
            "lifetime after {run} runs: {st}"
        );
        let uri = server.uri();
        for k in 0..=run {
            nbd_write(&uri, k * 65536, &pattern(run * 10 + k, 65536), true);
        }
        total_writes += run + 1;
        let st = ctx.status(&cache);
        assert_eq!(u64_of(&st, "writes"), run + 1);
        assert_eq!(lifetime(&st, "writes"), total_writes);
        let mut s = std::net::TcpStream::connect(&addr).expect("metrics");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        assert!(
            body.contains(&format!("cairn_lifetime_writes_total {total_writes}\n")),
            "metrics: {body}"
        );
        assert!(server.terminate().success());
    }
    // Offline too.
    let st = ctx.status(&cache);
    assert_eq!(lifetime(&st, "writes"), total_writes);
}
