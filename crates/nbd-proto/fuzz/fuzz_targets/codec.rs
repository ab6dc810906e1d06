//! libFuzzer target for the NBD codec: the same harness the proptest fuzz
//! test runs (negotiation, request parsing, payload skipping, with its
//! invariant checks), over fuzzer-chosen bytes, limits and chunking.
//!
//! Byte 0 picks knobs, byte 1 the chunk size; the rest is the stream.
//! Knob 32 serves three exports (named "", "a" and "big") instead of one.

#![no_main]

use std::sync::Arc;

use cairn_nbd_proto::codec::harness::{self, HarnessReport};
use cairn_nbd_proto::codec::{BlockSizes, ExportInfo, ExportList, Limits, TlsPolicy};
use libfuzzer_sys::fuzz_target;

/// A valid start of session (client flags, STRUCTURED_REPLY or
/// EXTENDED_HEADERS, SET_META_CONTEXT base:allocation, GO) so the fuzzer
/// reaches the transmission phase without having to discover it.
fn preamble(extended: bool) -> Vec<u8> {
    use cairn_nbd_proto::codec::option::{
        encode_info_request, encode_meta_context_request, encode_option,
    };
    use cairn_nbd_proto::proto::*;
    let mut out = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes().to_vec();
    let mode = if extended { OPT_EXTENDED_HEADERS } else { OPT_STRUCTURED_REPLY };
    encode_option(&mut out, mode, &[]);
    let mut meta = Vec::new();
    encode_meta_context_request(&mut meta, "", &[BASE_ALLOCATION]);
    encode_option(&mut out, OPT_SET_META_CONTEXT, &meta);
    let mut go = Vec::new();
    encode_info_request(&mut go, "", &[INFO_BLOCK_SIZE]);
    encode_option(&mut out, OPT_GO, &go);
    out
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let (knobs, chunk) = (data[0], data[1] as usize);
    let limits = if knobs & 1 == 0 {
        Limits::default()
    } else {
        Limits {
            max_option_bytes: 1024,
            max_name_bytes: 256,
            max_options: 16,
            max_payload_bytes: 4096,
            max_discard_bytes: 8192,
            max_block_status_extents: 8,
        }
    };
    let info = ExportInfo {
        id: 0,
        name: "disk".to_string(),
        description: None,
        size_bytes: if knobs & 8 == 0 { 1 << 20 } else { u64::MAX >> 1 },
        read_only: knobs & 16 != 0,
        block_sizes: BlockSizes::default(),
        extended_headers: knobs & 2 != 0,
    };
    let mut input = Vec::new();
    if knobs & 4 != 0 {
        input = preamble(knobs & 2 != 0);
    }
    input.extend_from_slice(&data[2..]);

    let catalog = if knobs & 32 == 0 {
        ExportList::single(info.clone())
    } else {
        let named = |id: u64, name: &str, size_bytes: u64| ExportInfo {
            id,
            name: name.to_string(),
            description: Some(format!("export {id}")),
            size_bytes,
            ..info.clone()
        };
        ExportList::new(vec![
            named(1, "", info.size_bytes),
            named(2, "a", 4096),
            named(3, "big", u64::MAX >> 1),
        ])
    };
    let catalog = Arc::new(catalog);
    let ext = info.extended_headers;
    let run = |chunks: &[usize]| {
        harness::run_catalog(catalog.clone(), ext, &limits, TlsPolicy::Off, &input, &[], chunks)
    };
    let whole = run(&[]);
    let chunked = run(&[chunk.max(1), 1 + chunk / 7]);
    // Chunking may change how much had to be buffered, nothing else.
    let strip = |r: HarnessReport| HarnessReport { peak_buffer_bytes: 0, ..r };
    assert_eq!(strip(whole), strip(chunked));
});
