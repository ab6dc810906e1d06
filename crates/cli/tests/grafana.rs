//! The Grafana dashboard (`contrib/grafana/cairn.json`, issue 18) queries
//! only metrics that a running daemon exports: every `cairn_*` name in its
//! panels' and variables' queries appears in `/metrics`, so no panel stays
//! empty because a metric was renamed.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::*;

fn get_metrics(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).expect("connect to metrics");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body
}

/// Every `cairn_...` identifier in `text`.
fn metric_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("cairn_") {
        let start = i + at;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        names.push(text[start..end].to_string());
        i = end;
    }
    names
}

fn queries(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr" | "query", serde_json::Value::String(q)) => out.push(q.clone()),
                    _ => queries(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| queries(v, out)),
        _ => {}
    }
}

#[test]
fn every_metric_the_dashboard_queries_is_exported() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../contrib/grafana/cairn.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("reading the dashboard"))
            .expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    queries(&dashboard, &mut exprs);
    assert!(exprs.len() >= 20, "the dashboard's queries: {exprs:?}");

    let ctx = Ctx::new("grafana");
    let (cache, _origin) = ctx.setup(8 << 20, 16 << 20);
    let sock = ctx.path("nbd.sock");
    let addr = format!("127.0.0.1:{}", free_port());
    let _server = ctx.serve(&cache, &sock, &["--metrics", &addr]);
    let exported = get_metrics(&addr);
    let exported_names: std::collections::BTreeSet<String> = exported
        .lines()
        .filter(|l| !l.starts_with('#'))
        .flat_map(|l| metric_names(l.split([' ', '{']).next().unwrap_or("")))
        .collect();
    let mut missing = Vec::new();
    for expr in &exprs {
        for name in metric_names(expr) {
            if !exported_names.contains(&name) {
                missing.push(format!("{name} (in {expr})"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics the daemon does not export:\n{}",
        missing.join("\n")
    );
}

/// Clients that connect to the metrics port and say nothing do not hold
/// back a scrape (they were served one at a time, each holding the others
/// for its whole read timeout), and only `GET /metrics` gets the metrics.
#[test]
fn silent_connections_do_not_hold_back_a_scrape() {
    let ctx = Ctx::new("metrics_silent");
    let (cache, _origin) = ctx.setup(8 << 20, 16 << 20);
    let sock = ctx.path("nbd.sock");
    let addr = format!("127.0.0.1:{}", free_port());
    let _server = ctx.serve(&cache, &sock, &["--metrics", &addr]);
    let silent: Vec<std::net::TcpStream> = (0..8)
        .map(|_| std::net::TcpStream::connect(&addr).expect("connect"))
        .collect();
    let started = std::time::Instant::now();
    let body = get_metrics(&addr);
    let took = started.elapsed();
    assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
    assert!(body.contains("cairn_"), "{body}");
    // The old server took at least 8 x 5 s here; the request head
    // timeout alone is 2 s.
    assert!(
        took < Duration::from_millis(1_500),
        "a scrape behind 8 silent connections took {took:?}"
    );
    drop(silent);

    let mut s = std::net::TcpStream::connect(&addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /nope HTTP/1.0\r\n\r\n").unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 404"), "{reply}");
    assert!(!reply.contains("cairn_"), "{reply}");
}
