//! Property "fuzz" test: random and mutated byte streams (seeded from
//! valid sessions) through the codec harness, which mirrors the server's
//! reader. Checks: no panic, the codec never asks to buffer more than the
//! limits, no allocation sized from a client claim, and the outcome does
//! not depend on how the stream is chunked.
//!
//! Case count: CAIRN_FUZZ_CASES (per strategy), default 20000.

mod common;

use std::cell::Cell;
use std::io::Write;
use std::sync::Arc;

use cairn_nbd_proto::codec::harness::{self, HarnessReport};
use cairn_nbd_proto::codec::{
    BlockSizes, ExportCatalog, ExportInfo, ExportList, Limits, TlsPolicy,
};
use cairn_nbd_proto::proto::*;
use common::*;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

mod peak_alloc;
use peak_alloc::peak_allocation;

fn cases() -> u32 {
    std::env::var("CAIRN_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000)
}

/// Printed straight to the process's stderr so it shows even when the
/// test harness captures output.
fn report(name: &str, ran: u64, stats: &Stats) {
    let _ = writeln!(
        std::io::stderr().lock(),
        "fuzz {name}: {ran} cases ran ({} reached transmission, {} through TLS, {} requests executed, {} rejected, {} protocol errors, peak allocation {} bytes)",
        stats.transmission, stats.tls, stats.executed, stats.rejected, stats.protocol_errors, stats.peak_alloc_bytes
    );
}

#[derive(Default)]
struct Stats {
    transmission: u64,
    executed: u64,
    rejected: u64,
    protocol_errors: u64,
    tls: u64,
    peak_alloc_bytes: usize,
    /// Sessions per export id reached (several-export runs).
    per_export: std::collections::BTreeMap<u64, u64>,
}

fn export(size_bytes: u64, extended_headers: bool) -> ExportInfo {
    ExportInfo {
        id: 0,
        name: "disk".to_string(),
        description: None,
        size_bytes,
        read_only: false,
        block_sizes: BlockSizes::default(),
        extended_headers,
    }
}

fn small_limits() -> Limits {
    Limits {
        max_option_bytes: 1024,
        max_name_bytes: 256,
        max_options: 16,
        max_payload_bytes: 4096,
        max_discard_bytes: 8192,
        max_block_status_extents: 8,
    }
}

/// One run: the harness over `input` whole and chunked, with invariants.
fn check(
    stats: &mut Stats,
    info: &ExportInfo,
    limits: &Limits,
    input: &[u8],
    chunks: &[usize],
) -> Result<(), TestCaseError> {
    check_tls(stats, info, limits, TlsPolicy::Off, input, &[], chunks)
}

/// [`check`] with a TLS policy: `clear` before STARTTLS, `through_tls`
/// after its (simulated) handshake.
fn check_tls(
    stats: &mut Stats,
    info: &ExportInfo,
    limits: &Limits,
    tls: TlsPolicy,
    clear: &[u8],
    through_tls: &[u8],
    chunks: &[usize],
) -> Result<(), TestCaseError> {
    let catalog = Arc::new(ExportList::single(info.clone()));
    let ext = info.extended_headers;
    check_catalog(
        stats,
        catalog,
        ext,
        limits,
        tls,
        (clear, through_tls),
        chunks,
    )
}

/// [`check_tls`] over a catalog of exports; `input` is what the client
/// sends before and through TLS.
fn check_catalog(
    stats: &mut Stats,
    catalog: Arc<dyn ExportCatalog>,
    extended_headers: bool,
    limits: &Limits,
    tls: TlsPolicy,
    (clear, through_tls): (&[u8], &[u8]),
    chunks: &[usize],
) -> Result<(), TestCaseError> {
    let input_len = clear.len() + through_tls.len();
    let run = |chunks: &[usize]| {
        let catalog = catalog.clone();
        harness::run_catalog(
            catalog,
            extended_headers,
            limits,
            tls,
            clear,
            through_tls,
            chunks,
        )
    };
    let ((whole, chunked), peak) = peak_allocation(|| (run(&[]), run(chunks)));

    // Input copies (the harness buffer) may reach the input size; anything
    // much larger was sized from a claimed length.
    let bound = 2 * input_len + 16 + limits.max_option_bytes as usize + 64 * 1024;
    prop_assert!(
        peak <= bound,
        "allocated {} bytes for a {}-byte input",
        peak,
        input_len
    );
    prop_assert!(whole.peak_buffer_bytes <= 16 + limits.max_option_bytes as usize);
    prop_assert!(chunked.peak_buffer_bytes <= 16 + limits.max_option_bytes as usize);
    // Clear text after STARTTLS ends the session either way, but how
    // far it got (the ACK sent or not) depends on what was buffered.
    let strip = |r: HarnessReport| match r.end {
        harness::HarnessEnd::ClearTextAfterStartTls => HarnessReport {
            peak_buffer_bytes: 0,
            options: 0,
            reply_bytes: 0,
            ..r
        },
        _ => HarnessReport {
            peak_buffer_bytes: 0,
            ..r
        },
    };
    prop_assert_eq!(strip(whole.clone()), strip(chunked));
    if tls == TlsPolicy::Required {
        prop_assert!(!whole.reached_transmission || whole.tls_established);
    }
    if tls == TlsPolicy::Off {
        prop_assert!(!whole.tls_established);
    }
    stats.tls += whole.tls_established as u64;

    stats.peak_alloc_bytes = stats.peak_alloc_bytes.max(peak);
    stats.transmission += whole.reached_transmission as u64;
    stats.executed += whole.executed as u64;
    stats.rejected += whole.rejected as u64;
    stats.protocol_errors += matches!(whole.end, harness::HarnessEnd::Protocol(_)) as u64;
    if let Some(id) = whole.export_id {
        *stats.per_export.entry(id).or_default() += 1;
    }
    Ok(())
}

fn chunking() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..64, 0..6)
}

/// A random request, payload included for writes.
fn arb_request(extended: bool) -> impl Strategy<Value = Vec<u8>> {
    let command = prop_oneof![
        6 => 0u16..8,
        1 => any::<u16>(),
    ];
    let flags = prop_oneof![
        4 => Just(0u16),
        4 => 0u16..64,
        1 => any::<u16>(),
    ];
    let offset = prop_oneof![
        4 => (0u64..64).prop_map(|b| b * 512),
        1 => any::<u64>(),
        1 => Just(u64::MAX - 511),
    ];
    let length = prop_oneof![
        4 => (0u64..16).prop_map(|b| b * 512),
        1 => 0u64..5000,
        1 => Just(0xffff_ffffu64),
        1 => any::<u64>(),
    ];
    (flags, command, any::<u64>(), offset, length).prop_map(
        move |(flags, command, cookie, offset, length)| {
            let length = if extended {
                length
            } else {
                length & 0xffff_ffff
            };
            let mut r = request(extended, flags, command, cookie, offset, length);
            // Supply the payload for plausible writes so the stream stays framed.
            let carries = command == CMD_WRITE || (extended && flags & CMD_FLAG_PAYLOAD_LEN != 0);
            if carries && length <= 8192 {
                r.resize(r.len() + length as usize, 0xa5);
            }
            r
        },
    )
}

/// A valid negotiation (with a random option mix) followed by requests.
fn arb_session() -> impl Strategy<Value = Vec<u8>> {
    let mode = 0u8..3;
    (
        mode,
        any::<bool>(),
        any::<bool>(),
        prop::collection::vec(0u8..8, 0..4),
    )
        .prop_flat_map(|(mode, meta, export_name, extra)| {
            let extended = mode == 2;
            prop::collection::vec(arb_request(extended), 0..8).prop_map(move |requests| {
                let mut out = client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
                for e in &extra {
                    out.extend(match e {
                        0 => option(OPT_LIST, &[]),
                        1 => option(OPT_INFO, &info_data("disk", &[INFO_NAME, INFO_BLOCK_SIZE])),
                        2 => option(OPT_STARTTLS, &[]),
                        3 => option(OPT_LIST_META_CONTEXT, &meta_data("", &["base:"])),
                        4 => option(0x99, b"whatever"),
                        5 => option(OPT_INFO, &info_data("missing", &[])),
                        6 => option(OPT_PEEK_EXPORT, &[]),
                        _ => option(OPT_GO, &info_data("wrong", &[])),
                    });
                }
                match mode {
                    1 => out.extend(option(OPT_STRUCTURED_REPLY, &[])),
                    2 => out.extend(option(OPT_EXTENDED_HEADERS, &[])),
                    _ => {}
                }
                if meta {
                    out.extend(option(
                        OPT_SET_META_CONTEXT,
                        &meta_data("", &[BASE_ALLOCATION]),
                    ));
                }
                if export_name && !extended {
                    out.extend(option(OPT_EXPORT_NAME, b"disk"));
                } else {
                    out.extend(option(OPT_GO, &info_data("", &[INFO_BLOCK_SIZE])));
                }
                for r in requests {
                    out.extend(r);
                }
                out
            })
        })
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip { at: usize, mask: u8 },
    Overwrite32 { at: usize, value: u32 },
    Insert { at: usize, bytes: Vec<u8> },
    Remove { at: usize, len: usize },
    Truncate { at: usize },
}

fn arb_mutation() -> impl Strategy<Value = Mutation> {
    let interesting = prop_oneof![
        Just(0u32),
        Just(1),
        Just(0xffff_ffff),
        Just(0x7fff_ffff),
        Just(4096),
        Just(4097),
        Just(1025),
        Just(0x0200_0001),
        Just(IHAVEOPT as u32),
        Just(REQUEST_MAGIC),
        Just(EXTENDED_REQUEST_MAGIC),
        any::<u32>(),
    ];
    prop_oneof![
        3 => (any::<usize>(), 1u8..=255).prop_map(|(at, mask)| Mutation::Flip { at, mask }),
        3 => (any::<usize>(), interesting).prop_map(|(at, value)| Mutation::Overwrite32 { at, value }),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => (any::<usize>(), 1usize..32).prop_map(|(at, len)| Mutation::Remove { at, len }),
        1 => any::<usize>().prop_map(|at| Mutation::Truncate { at }),
    ]
}

fn apply(mut input: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        if input.is_empty() {
            break;
        }
        let n = input.len();
        match m {
            Mutation::Flip { at, mask } => input[at % n] ^= mask,
            Mutation::Overwrite32 { at, value } => {
                let at = at % n;
                for (i, b) in value.to_be_bytes().iter().enumerate() {
                    if at + i < n {
                        input[at + i] = *b;
                    }
                }
            }
            Mutation::Insert { at, bytes } => {
                let at = at % (n + 1);
                input.splice(at..at, bytes.iter().copied());
            }
            Mutation::Remove { at, len } => {
                let at = at % n;
                let end = (at + len).min(n);
                input.drain(at..end);
            }
            Mutation::Truncate { at } => input.truncate(at % n),
        }
    }
    input
}

fn run_strategy<S: Strategy>(
    name: &str,
    strategy: S,
    body: impl Fn(&mut Stats, S::Value) -> Result<(), TestCaseError>,
) -> Stats
where
    S::Value: std::fmt::Debug,
{
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    });
    // The runner takes an Fn closure, hence the cells.
    let stats = std::cell::RefCell::new(Stats::default());
    let ran = Cell::new(0u64);
    let result = runner.run(&strategy, |value| {
        ran.set(ran.get() + 1);
        body(&mut stats.borrow_mut(), value)
    });
    report(name, ran.get(), &stats.borrow());
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
    stats.into_inner()
}

#[test]
fn fuzz_random_bytes() {
    let strategy = (
        prop::collection::vec(any::<u8>(), 0..2048),
        chunking(),
        any::<bool>(),
    );
    run_strategy("random bytes", strategy, |stats, (tail, chunks, small)| {
        let limits = if small {
            small_limits()
        } else {
            Limits::default()
        };
        let info = export(1 << 20, true);
        // Raw garbage, and garbage after a valid greeting reply (client
        // flags) so the option parser sees it too.
        check(stats, &info, &limits, &tail, &chunks)?;
        let mut input = client_flags(FLAG_C_FIXED_NEWSTYLE);
        input.extend_from_slice(&tail);
        check(stats, &info, &limits, &input, &chunks)
    });
}

#[test]
fn fuzz_mutated_sessions() {
    let strategy = (
        arb_session(),
        prop::collection::vec(arb_mutation(), 0..6),
        chunking(),
        any::<bool>(),
        any::<bool>(),
    );
    run_strategy(
        "mutated sessions",
        strategy,
        |stats, (session, mutations, chunks, small, ext)| {
            let limits = if small {
                small_limits()
            } else {
                Limits::default()
            };
            let info = export(1 << 20, ext);
            let input = apply(session, &mutations);
            check(stats, &info, &limits, &input, &chunks)
        },
    );
}

#[test]
fn fuzz_valid_session_then_garbage() {
    let strategy = (
        arb_session(),
        prop::collection::vec(any::<u8>(), 0..512),
        chunking(),
    );
    run_strategy(
        "valid session + random tail",
        strategy,
        |stats, (mut input, tail, chunks)| {
            input.extend(tail);
            check(
                stats,
                &export(1 << 30, true),
                &Limits::default(),
                &input,
                &chunks,
            )
        },
    );
}

/// Negotiation across STARTTLS, under each TLS policy: options (some that
/// TLS must make the server forget) in clear text, STARTTLS (or not, or
/// with clear text pipelined after it), then a session through TLS; both
/// halves mutated.
#[test]
fn fuzz_tls_negotiation() {
    let policy = prop_oneof![
        Just(TlsPolicy::Off),
        Just(TlsPolicy::Offered),
        Just(TlsPolicy::Required),
    ];
    let strategy = (
        policy,
        prop::collection::vec(0u8..9, 0..5),
        0u8..4,
        prop::collection::vec(arb_mutation(), 0..3),
        arb_session(),
        prop::collection::vec(arb_mutation(), 0..3),
        chunking(),
    );
    run_strategy(
        "TLS negotiation",
        strategy,
        |stats, (tls, before, starttls, clear_mutations, session, tls_mutations, chunks)| {
            let mut clear = client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
            for b in &before {
                clear.extend(match b {
                    0 => option(OPT_STRUCTURED_REPLY, &[]),
                    1 => option(OPT_EXTENDED_HEADERS, &[]),
                    2 => option(OPT_SET_META_CONTEXT, &meta_data("", &[BASE_ALLOCATION])),
                    3 => option(OPT_LIST, &[]),
                    4 => option(OPT_INFO, &info_data("", &[INFO_BLOCK_SIZE])),
                    5 => option(OPT_STARTTLS, b"data"),
                    6 => option(OPT_GO, &info_data("", &[])),
                    7 => option(OPT_EXPORT_NAME, b""),
                    _ => option(0x99, b"x"),
                });
            }
            match starttls {
                0 => {}
                1 | 2 => clear.extend(option(OPT_STARTTLS, &[])),
                // Pipelined clear text after STARTTLS: must never count.
                _ => {
                    clear.extend(option(OPT_STARTTLS, &[]));
                    clear.extend(option(OPT_GO, &info_data("", &[])));
                }
            }
            let clear = apply(clear, &clear_mutations);
            // Through TLS the client starts over with options (its flags
            // were sent before TLS).
            let through = apply(session[4..].to_vec(), &tls_mutations);
            check_tls(
                stats,
                &export(1 << 20, true),
                &small_limits(),
                tls,
                &clear,
                &through,
                &chunks,
            )
        },
    );
}

/// The names a several-export session picks from: each export's, a
/// missing one, a case variant, and one at the name limit.
const EXPORT_NAMES: [&str; 5] = ["", "a", "big", "missing", "A"];

/// Three exports (the default one named "", a small read-only one, one of
/// 1 TiB), optionally with "big" as the default instead.
fn several_exports(big_is_default: bool) -> ExportList {
    let export = |id, name: &str, description: Option<&str>, size_bytes, read_only| ExportInfo {
        id,
        name: name.to_string(),
        description: description.map(str::to_string),
        size_bytes,
        read_only,
        block_sizes: BlockSizes::default(),
        extended_headers: true,
    };
    let list = ExportList::new(vec![
        export(1, "", Some("the default"), 1 << 20, false),
        export(2, "a", Some("small, read-only"), 64 << 10, true),
        export(3, "big", None, 1 << 40, false),
    ]);
    match big_is_default {
        true => list.with_default("big"),
        false => list,
    }
}

/// A session over several exports: LIST, INFO, meta contexts and GO or
/// EXPORT_NAME, each naming one of [`EXPORT_NAMES`], then requests.
fn arb_several_export_session() -> impl Strategy<Value = Vec<u8>> {
    let name = 0usize..EXPORT_NAMES.len();
    any::<bool>()
        .prop_flat_map(move |export_name| {
            (
                prop::collection::vec((0u8..5, name.clone()), 0..6),
                Just(export_name),
                name.clone(),
                prop::collection::vec(arb_request(!export_name), 0..6),
            )
        })
        .prop_map(|(options, export_name, chosen, requests)| {
            let mut out = client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
            let extended = !export_name;
            if extended {
                out.extend(option(OPT_EXTENDED_HEADERS, &[]));
            }
            for (kind, n) in options {
                let n = EXPORT_NAMES[n];
                out.extend(match kind {
                    0 => option(OPT_LIST, &[]),
                    1 => option(OPT_INFO, &info_data(n, &[INFO_NAME, INFO_DESCRIPTION])),
                    2 => option(OPT_SET_META_CONTEXT, &meta_data(n, &[BASE_ALLOCATION])),
                    3 => option(OPT_LIST_META_CONTEXT, &meta_data(n, &[])),
                    _ => option(OPT_GO, &info_data(n, &[INFO_BLOCK_SIZE])),
                });
            }
            let n = EXPORT_NAMES[chosen];
            if export_name {
                out.extend(option(OPT_EXPORT_NAME, n.as_bytes()));
            } else {
                out.extend(option(OPT_GO, &info_data(n, &[INFO_BLOCK_SIZE])));
            }
            for r in requests {
                out.extend(r);
            }
            out
        })
}

/// Several exports: every session enters transmission with an export of
/// the catalog, as the catalog describes it (the harness checks), and
/// LIST replies stay bounded; the rest as for one export.
#[test]
fn fuzz_several_exports() {
    let strategy = (
        arb_several_export_session(),
        prop::collection::vec(arb_mutation(), 0..4),
        chunking(),
        any::<bool>(),
        any::<bool>(),
    );
    let stats = run_strategy(
        "several exports",
        strategy,
        |stats, (session, mutations, chunks, small, big_is_default)| {
            let limits = if small {
                small_limits()
            } else {
                Limits::default()
            };
            let catalog = Arc::new(several_exports(big_is_default));
            let input = apply(session, &mutations);
            check_catalog(
                stats,
                catalog,
                true,
                &limits,
                TlsPolicy::Off,
                (&input, &[]),
                &chunks,
            )
        },
    );
    let per_export = &stats.per_export;
    let _ = writeln!(
        std::io::stderr().lock(),
        "fuzz several exports: sessions per export id {per_export:?}"
    );
    for id in [1, 2, 3] {
        assert!(
            per_export.get(&id).copied().unwrap_or(0) > 0,
            "no session reached export {id}: {per_export:?}"
        );
    }
}
