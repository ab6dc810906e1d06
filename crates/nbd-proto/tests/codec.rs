//! Codec tests, one group per bad-input class in NBD-NOTES.md, plus the
//! happy paths they are measured against. Pure: no sockets.

mod common;

use std::sync::Arc;

use cairn_nbd_proto::codec::harness::{self, HarnessEnd};
use cairn_nbd_proto::codec::reply::{
    encode_block_status, encode_read_prefix, read_prefix_bytes, Descriptor,
};
use cairn_nbd_proto::codec::{
    decode_request, BlockSizes, Command, ExportCatalog, ExportInfo, ExportList, Limits,
    Negotiation, NegotiationStep, ProtocolError, ReplyMode, ReplyTo, RequestAction, RequestDecode,
    Session, TlsPolicy, MAX_LISTED_EXPORTS,
};
use cairn_nbd_proto::proto::*;
use common::*;

mod peak_alloc;
use peak_alloc::peak_allocation;

// ------------------------------------------------------------ helpers ---

const SIZE: u64 = 1 << 20;

fn export() -> ExportInfo {
    ExportInfo {
        id: 0,
        name: "disk".to_string(),
        description: Some("test disk".to_string()),
        size_bytes: SIZE,
        read_only: false,
        block_sizes: BlockSizes::default(),
        extended_headers: true,
    }
}

fn limits() -> Limits {
    Limits::default()
}

#[derive(Debug)]
struct Driven {
    steps: Vec<NegotiationStep>,
    error: Option<ProtocolError>,
    consumed: usize,
    replies: Vec<OptReply>,
    out: Vec<u8>,
}

/// Run negotiation over `input` until it needs more, ends or fails.
fn drive(neg: &mut Negotiation, input: &[u8]) -> Driven {
    let mut d = Driven {
        steps: vec![],
        error: None,
        consumed: 0,
        replies: vec![],
        out: vec![],
    };
    loop {
        match neg.step(&input[d.consumed..], &mut d.out) {
            Err(e) => {
                d.error = Some(e);
                break;
            }
            Ok(step) => {
                let stop = match &step {
                    NegotiationStep::NeedMore { .. } => true,
                    NegotiationStep::Consumed { bytes } => {
                        d.consumed += bytes;
                        false
                    }
                    NegotiationStep::Transmission { bytes, .. }
                    | NegotiationStep::Aborted { bytes }
                    | NegotiationStep::StartTls { bytes } => {
                        d.consumed += bytes;
                        true
                    }
                };
                d.steps.push(step);
                if stop {
                    break;
                }
            }
        }
    }
    d.replies = parse_option_replies(&d.out);
    d
}

fn parse_option_replies(mut out: &[u8]) -> Vec<OptReply> {
    let mut v = Vec::new();
    while out.len() >= 20 && out[0..8] == OPTION_REPLY_MAGIC.to_be_bytes() {
        let len = u32::from_be_bytes(out[16..20].try_into().unwrap()) as usize;
        v.push(OptReply {
            option: u32::from_be_bytes(out[8..12].try_into().unwrap()),
            reply_type: u32::from_be_bytes(out[12..16].try_into().unwrap()),
            data: out[20..20 + len].to_vec(),
        });
        out = &out[20 + len..];
    }
    v
}

fn negotiating() -> Negotiation {
    let mut n = Negotiation::new(export(), limits());
    let d = drive(
        &mut n,
        &client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES),
    );
    assert!(d.error.is_none());
    n
}

fn session(mode: ReplyMode) -> Session {
    Session {
        size_bytes: SIZE,
        transmission_flags: 0,
        mode,
        base_allocation: true,
        block_sizes_agreed: false,
        block_sizes: BlockSizes::default(),
        read_only: false,
        tls: false,
        export_id: 0,
        export_name: String::new(),
    }
}

fn decode(session: &Session, bytes: &[u8]) -> Result<RequestDecode, ProtocolError> {
    decode_request(bytes, session, &limits())
}

fn action(session: &Session, bytes: &[u8]) -> RequestAction {
    match decode(session, bytes).expect("decodes") {
        RequestDecode::Request {
            header_bytes,
            action,
        } => {
            assert_eq!(header_bytes, session.request_header_bytes());
            action
        }
        other => panic!("expected a request, got {other:?}"),
    }
}

fn rejected(a: &RequestAction) -> (u32, u64) {
    match a {
        RequestAction::Reject {
            errno,
            discard_bytes,
            ..
        } => (*errno, *discard_bytes),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

fn executed(a: RequestAction) -> cairn_nbd_proto::codec::Request {
    match a {
        RequestAction::Execute(r) => r,
        other => panic!("expected execution, got {other:?}"),
    }
}

// --------------------------------------------- handshake: bad input ---

#[test]
fn unknown_client_flags_disconnect() {
    for flags in [1 << 2, 1 << 31, 0xffff_ffff, FLAG_C_FIXED_NEWSTYLE | 1 << 5] {
        let mut n = Negotiation::new(export(), limits());
        let d = drive(&mut n, &client_flags(flags));
        assert_eq!(d.error, Some(ProtocolError::BadClientFlags { flags }));
        assert!(d.out.is_empty(), "nothing is sent to such a client");
    }
}

#[test]
fn unknown_option_magic_disconnects() {
    let mut n = negotiating();
    let d = drive(&mut n, b"NOTMAGIC\0\0\0\x07\0\0\0\0");
    assert!(matches!(
        d.error,
        Some(ProtocolError::BadOptionMagic { .. })
    ));
    // Refused as soon as the 8 magic bytes are in, without waiting for the
    // rest of a header.
    let mut n = negotiating();
    let d = drive(&mut n, b"GARBAGE!");
    assert!(matches!(
        d.error,
        Some(ProtocolError::BadOptionMagic { .. })
    ));
}

#[test]
fn commands_before_negotiation_ends_disconnect() {
    // A READ request where an option should be.
    let mut n = negotiating();
    let d = drive(&mut n, &request(false, 0, CMD_READ, 1, 0, 512));
    assert!(
        matches!(d.error, Some(ProtocolError::BadOptionMagic { .. })),
        "{:?}",
        d.error
    );
    // The same before client flags: the request magic is an unknown flag set.
    let mut n = Negotiation::new(export(), limits());
    let d = drive(&mut n, &request(false, 0, CMD_WRITE, 1, 0, 512));
    assert!(matches!(
        d.error,
        Some(ProtocolError::BadClientFlags { .. })
    ));
}

#[test]
fn option_length_0xffffffff_fails_without_allocating_it() {
    for opt in [OPT_GO, OPT_INFO, OPT_LIST, OPT_SET_META_CONTEXT, 0x1234] {
        let mut n = negotiating();
        let (d, peak_bytes) = peak_allocation(|| drive(&mut n, &option_header(opt, 0xffff_ffff)));
        assert_eq!(
            d.error,
            Some(ProtocolError::OptionTooLong {
                option: opt,
                length_bytes: 0xffff_ffff,
                max_bytes: limits().max_option_bytes
            })
        );
        // Refused on the header alone: it never asked for the data.
        assert!(d.steps.is_empty(), "{:?}", d.steps);
        assert!(
            peak_bytes < 4096,
            "allocated {peak_bytes} bytes for a bogus length"
        );
    }
    // Just over the limit is refused too; at the limit it waits for data.
    let max = limits().max_option_bytes;
    let mut n = negotiating();
    assert!(drive(&mut n, &option_header(0x1234, max + 1))
        .error
        .is_some());
    let mut n = negotiating();
    let d = drive(&mut n, &option_header(0x1234, max));
    assert_eq!(
        d.steps,
        vec![NegotiationStep::NeedMore {
            min_total_bytes: 16 + max as usize
        }]
    );
}

#[test]
fn export_name_longer_than_4096_fails_without_allocating() {
    for length in [4097u32, 65535, 0xffff_ffff] {
        let mut n = negotiating();
        let (d, peak_bytes) =
            peak_allocation(|| drive(&mut n, &option_header(OPT_EXPORT_NAME, length)));
        assert_eq!(
            d.error,
            Some(ProtocolError::ExportNameTooLong {
                length_bytes: length,
                max_bytes: 4096
            })
        );
        assert!(peak_bytes < 4096, "allocated {peak_bytes} bytes");
    }
    // A 4096-byte name is legal framing (but unknown here).
    let mut n = negotiating();
    let d = drive(&mut n, &option(OPT_EXPORT_NAME, &[b'x'; 4096]));
    assert!(matches!(d.error, Some(ProtocolError::UnknownExport { .. })));
}

#[test]
fn go_with_name_length_0xffffffff_is_refused_and_negotiation_continues() {
    // The CVE-2022-26495 shape: a small option whose inner name length is
    // huge. It must be an ordinary error reply, not an allocation.
    let mut data = Vec::new();
    be32(&mut data, 0xffff_ffff);
    data.extend_from_slice(b"abcd\0\0");
    let mut input = option(OPT_GO, &data);
    // And a name longer than 4096 that really is in the option.
    let mut long = Vec::new();
    be32(&mut long, 5000);
    long.extend_from_slice(&[b'a'; 5000]);
    be16(&mut long, 0);
    input.extend(option(OPT_INFO, &long));
    // A name length that overruns the option.
    let mut overrun = Vec::new();
    be32(&mut overrun, 100);
    overrun.extend_from_slice(b"short");
    input.extend(option(OPT_GO, &overrun));
    // A request count that does not match.
    let mut count = info_data("", &[]);
    count.truncate(count.len() - 2);
    be16(&mut count, 3);
    input.extend(option(OPT_GO, &count));
    input.extend(option(OPT_GO, &info_data("", &[])));

    let mut n = negotiating();
    let (d, peak_bytes) = peak_allocation(|| drive(&mut n, &input));
    assert!(peak_bytes < 64 * 1024, "allocated {peak_bytes} bytes");
    let types: Vec<u32> = d.replies.iter().map(|r| r.reply_type).collect();
    assert_eq!(
        types,
        vec![
            REP_ERR_TOO_BIG,
            REP_ERR_TOO_BIG,
            REP_ERR_INVALID,
            REP_ERR_INVALID,
            REP_INFO,
            REP_INFO,
            REP_ACK
        ]
    );
    assert!(matches!(
        d.steps.last(),
        Some(NegotiationStep::Transmission { .. })
    ));
    assert_eq!(d.consumed, input.len());
}

#[test]
fn meta_context_with_absurd_counts_is_refused_without_allocating() {
    let mut n = negotiating();
    drive(&mut n, &option(OPT_STRUCTURED_REPLY, &[]));
    let mut data = Vec::new();
    be32(&mut data, 0);
    be32(&mut data, 0xffff_ffff); // query count
    be32(&mut data, 15);
    data.extend_from_slice(BASE_ALLOCATION.as_bytes());
    let mut input = option(OPT_SET_META_CONTEXT, &data);
    let mut huge_query = Vec::new();
    be32(&mut huge_query, 0);
    be32(&mut huge_query, 1);
    be32(&mut huge_query, 0xffff_fff0);
    input.extend(option(OPT_LIST_META_CONTEXT, &huge_query));
    let (d, peak_bytes) = peak_allocation(|| drive(&mut n, &input));
    assert!(peak_bytes < 4096, "allocated {peak_bytes} bytes");
    let types: Vec<u32> = d.replies.iter().map(|r| r.reply_type).collect();
    assert_eq!(types, vec![REP_ERR_INVALID, REP_ERR_TOO_BIG]);
}

#[test]
fn unknown_options_get_unsup_and_parsing_continues() {
    let mut n = negotiating();
    let mut input = option(0x7777, b"ignored payload");
    input.extend(option(OPT_PEEK_EXPORT, &[]));
    input.extend(option(OPT_STARTTLS, &[]));
    input.extend(option(OPT_STARTTLS, b"x"));
    input.extend(option(OPT_LIST, &[]));
    input.extend(option(OPT_LIST, b"junk"));
    let d = drive(&mut n, &input);
    assert!(d.error.is_none());
    let got: Vec<(u32, u32)> = d.replies.iter().map(|r| (r.option, r.reply_type)).collect();
    assert_eq!(
        got,
        vec![
            (0x7777, REP_ERR_UNSUP),
            (OPT_PEEK_EXPORT, REP_ERR_UNSUP),
            // Without TLS: POLICY, never TLS_REQD.
            (OPT_STARTTLS, REP_ERR_POLICY),
            (OPT_STARTTLS, REP_ERR_INVALID),
            (OPT_LIST, REP_SERVER),
            (OPT_LIST, REP_ACK),
            (OPT_LIST, REP_ERR_INVALID),
        ]
    );
    // The name, then the description as the free text after it.
    assert_eq!(&d.replies[4].data[..4], &4u32.to_be_bytes());
    assert_eq!(&d.replies[4].data[4..8], b"disk");
    assert_eq!(&d.replies[4].data[8..], b"test disk");
    assert_eq!(d.consumed, input.len());
}

#[test]
fn structured_reply_injected_after_refused_starttls_stays_plaintext() {
    // CVE-2021-3716 shape: STARTTLS immediately followed by more options.
    // With no TLS on offer, each is answered in order on the same stream.
    let mut n = negotiating();
    let mut input = option(OPT_STARTTLS, &[]);
    input.extend(option(OPT_STRUCTURED_REPLY, &[]));
    input.extend(option(OPT_GO, &info_data("", &[])));
    let d = drive(&mut n, &input);
    let types: Vec<u32> = d.replies.iter().map(|r| r.reply_type).collect();
    assert_eq!(
        types,
        vec![REP_ERR_POLICY, REP_ACK, REP_INFO, REP_INFO, REP_ACK]
    );
    match d.steps.last() {
        Some(NegotiationStep::Transmission { session, .. }) => {
            assert_eq!(session.mode, ReplyMode::Structured)
        }
        other => panic!("{other:?}"),
    }
}

fn negotiating_with(tls: TlsPolicy) -> Negotiation {
    let mut n = Negotiation::with_tls(export(), limits(), tls);
    let d = drive(
        &mut n,
        &client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES),
    );
    assert!(d.error.is_none());
    n
}

#[test]
fn tls_required_answers_nothing_but_starttls_and_abort_before_tls() {
    let mut n = negotiating_with(TlsPolicy::Required);
    let mut input = option(OPT_LIST, &[]);
    input.extend(option(OPT_STRUCTURED_REPLY, &[]));
    input.extend(option(OPT_INFO, &info_data("", &[])));
    input.extend(option(OPT_GO, &info_data("", &[])));
    input.extend(option(
        OPT_SET_META_CONTEXT,
        &meta_data("", &[BASE_ALLOCATION]),
    ));
    let d = drive(&mut n, &input);
    assert!(d.error.is_none(), "{:?}", d.error);
    assert_eq!(d.consumed, input.len());
    assert!(
        d.replies.iter().all(|r| r.reply_type == REP_ERR_TLS_REQD),
        "{:?}",
        d.replies
    );
    assert_eq!(d.replies.len(), 5);
    assert!(!n.tls_active());

    // EXPORT_NAME cannot be refused with a reply: the connection ends,
    // and no export size leaks.
    let d = drive(&mut n, &option(OPT_EXPORT_NAME, b""));
    assert_eq!(d.error, Some(ProtocolError::TlsRequired));
    assert!(d.out.is_empty());

    // ABORT is still answered.
    let mut n = negotiating_with(TlsPolicy::Required);
    let d = drive(&mut n, &option(OPT_ABORT, &[]));
    assert!(matches!(
        d.steps.last(),
        Some(NegotiationStep::Aborted { .. })
    ));
}

#[test]
fn starttls_is_acked_then_the_session_goes_on_through_tls() {
    for policy in [TlsPolicy::Offered, TlsPolicy::Required] {
        let mut n = negotiating_with(policy);
        let d = drive(&mut n, &option(OPT_STARTTLS, &[]));
        assert!(matches!(
            d.steps.last(),
            Some(NegotiationStep::StartTls { .. })
        ));
        assert_eq!(d.replies.len(), 1);
        assert_eq!(d.replies[0].reply_type, REP_ACK);
        // Until the caller says the handshake is done, nothing is parsed.
        let mut out = Vec::new();
        assert_eq!(
            n.step(&option(OPT_GO, &info_data("", &[])), &mut out),
            Err(ProtocolError::AfterEnd)
        );
        n.tls_established();
        assert!(n.tls_active());
        let mut input = option(OPT_STARTTLS, &[]);
        input.extend(option(OPT_GO, &info_data("", &[])));
        let d = drive(&mut n, &input);
        assert_eq!(d.replies[0].reply_type, REP_ERR_INVALID, "second STARTTLS");
        match d.steps.last() {
            Some(NegotiationStep::Transmission { session, .. }) => assert!(session.tls),
            other => panic!("{other:?}"),
        }
    }
    // Offered: clear text is still served, and says so.
    let mut n = negotiating_with(TlsPolicy::Offered);
    let d = drive(&mut n, &option(OPT_GO, &info_data("", &[])));
    match d.steps.last() {
        Some(NegotiationStep::Transmission { session, .. }) => assert!(!session.tls),
        other => panic!("{other:?}"),
    }
}

#[test]
fn what_was_negotiated_before_starttls_is_forgotten() {
    // CVE-2021-3716: a man in the middle injects options in clear text
    // before the client's STARTTLS; none of them may survive into the
    // TLS session.
    let mut n = negotiating_with(TlsPolicy::Offered);
    let mut input = option(OPT_EXTENDED_HEADERS, &[]);
    input.extend(option(
        OPT_SET_META_CONTEXT,
        &meta_data("", &[BASE_ALLOCATION]),
    ));
    input.extend(option(OPT_STARTTLS, &[]));
    let d = drive(&mut n, &input);
    assert_eq!(d.consumed, input.len());
    assert!(matches!(
        d.steps.last(),
        Some(NegotiationStep::StartTls { .. })
    ));
    n.tls_established();
    let d = drive(&mut n, &option(OPT_GO, &info_data("", &[])));
    match d.steps.last() {
        Some(NegotiationStep::Transmission { session, .. }) => {
            assert_eq!(session.mode, ReplyMode::Simple);
            assert!(!session.base_allocation);
            assert!(session.tls);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn clear_text_pipelined_after_starttls_ends_the_connection() {
    let mut n = negotiating_with(TlsPolicy::Offered);
    let mut input = option(OPT_STARTTLS, &[]);
    input.extend(option(OPT_STRUCTURED_REPLY, &[]));
    let d = drive(&mut n, &input);
    assert_eq!(
        d.error,
        Some(ProtocolError::DataAfterStartTls { bytes: 16 })
    );
    assert!(d.out.is_empty(), "no ACK: the client gets no TLS either");
    let mut out = Vec::new();
    assert_eq!(
        n.step(&option(OPT_GO, &info_data("", &[])), &mut out),
        Err(ProtocolError::AfterEnd)
    );
}

#[test]
fn negotiation_options_with_data_or_in_wrong_order_are_refused() {
    let mut n = negotiating();
    let mut input = option(OPT_SET_META_CONTEXT, &meta_data("", &[BASE_ALLOCATION]));
    input.extend(option(OPT_STRUCTURED_REPLY, b"data"));
    input.extend(option(OPT_EXTENDED_HEADERS, b"data"));
    input.extend(option(OPT_EXTENDED_HEADERS, &[]));
    input.extend(option(OPT_STRUCTURED_REPLY, &[]));
    let d = drive(&mut n, &input);
    let types: Vec<u32> = d.replies.iter().map(|r| r.reply_type).collect();
    assert_eq!(
        types,
        vec![
            REP_ERR_INVALID,
            REP_ERR_INVALID,
            REP_ERR_INVALID,
            REP_ACK,
            REP_ERR_EXT_HEADER_REQD
        ]
    );
    // EXPORT_NAME is forbidden once extended headers are on.
    let d = drive(&mut n, &option(OPT_EXPORT_NAME, b""));
    assert_eq!(d.error, Some(ProtocolError::ExportNameAfterExtendedHeaders));
}

#[test]
fn extended_headers_can_be_switched_off() {
    let mut info = export();
    info.extended_headers = false;
    let mut n = Negotiation::new(info, limits());
    let mut input = client_flags(FLAG_C_FIXED_NEWSTYLE);
    input.extend(option(OPT_EXTENDED_HEADERS, &[]));
    input.extend(option(OPT_STRUCTURED_REPLY, &[]));
    let d = drive(&mut n, &input);
    let types: Vec<u32> = d.replies.iter().map(|r| r.reply_type).collect();
    assert_eq!(types, vec![REP_ERR_UNSUP, REP_ACK]);
}

#[test]
fn meta_context_list_and_set() {
    let mut n = negotiating();
    let mut input = option(OPT_STRUCTURED_REPLY, &[]);
    input.extend(option(OPT_LIST_META_CONTEXT, &meta_data("", &[])));
    input.extend(option(
        OPT_LIST_META_CONTEXT,
        &meta_data("disk", &["base:", "x-other:thing"]),
    ));
    input.extend(option(
        OPT_SET_META_CONTEXT,
        &meta_data("", &["base:", "nope:x"]),
    ));
    input.extend(option(
        OPT_SET_META_CONTEXT,
        &meta_data("other", &[BASE_ALLOCATION]),
    ));
    input.extend(option(
        OPT_SET_META_CONTEXT,
        &meta_data("disk", &[BASE_ALLOCATION, BASE_ALLOCATION]),
    ));
    input.extend(option(
        OPT_GO,
        &info_data("disk", &[INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE, 999]),
    ));
    let d = drive(&mut n, &input);
    let got: Vec<(u32, u32)> = d.replies.iter().map(|r| (r.option, r.reply_type)).collect();
    assert_eq!(
        got[..10],
        [
            (OPT_STRUCTURED_REPLY, REP_ACK),
            (OPT_LIST_META_CONTEXT, REP_META_CONTEXT),
            (OPT_LIST_META_CONTEXT, REP_ACK),
            (OPT_LIST_META_CONTEXT, REP_META_CONTEXT),
            (OPT_LIST_META_CONTEXT, REP_ACK),
            // "base:" selects nothing in SET; unknown namespaces are ignored.
            (OPT_SET_META_CONTEXT, REP_ACK),
            (OPT_SET_META_CONTEXT, REP_ERR_UNKNOWN),
            (OPT_SET_META_CONTEXT, REP_META_CONTEXT),
            (OPT_SET_META_CONTEXT, REP_ACK),
            (OPT_GO, REP_INFO),
        ]
    );
    assert_eq!(&d.replies[1].data[4..], BASE_ALLOCATION.as_bytes());
    let infos: Vec<&[u8]> = d
        .replies
        .iter()
        .filter(|r| r.option == OPT_GO && r.reply_type == REP_INFO)
        .map(|r| &r.data[..])
        .collect();
    assert!(infos
        .iter()
        .any(|i| i[0..2] == INFO_NAME.to_be_bytes() && &i[2..] == b"disk"));
    assert!(infos
        .iter()
        .any(|i| i[0..2] == INFO_DESCRIPTION.to_be_bytes() && &i[2..] == b"test disk"));
    match d.steps.last() {
        Some(NegotiationStep::Transmission { session, .. }) => {
            assert!(session.base_allocation);
            assert!(session.block_sizes_agreed);
            assert_ne!(session.transmission_flags & FLAG_SEND_DF, 0);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn info_reports_export_flags_and_block_sizes() {
    let mut n = negotiating();
    let mut input = option(OPT_INFO, &info_data("nope", &[]));
    input.extend(option(OPT_INFO, &info_data("", &[INFO_BLOCK_SIZE])));
    let d = drive(&mut n, &input);
    assert_eq!(d.replies[0].reply_type, REP_ERR_UNKNOWN);
    let export_info = &d.replies[1].data;
    assert_eq!(export_info.len(), 12);
    assert_eq!(
        u64::from_be_bytes(export_info[2..10].try_into().unwrap()),
        SIZE
    );
    let flags = u16::from_be_bytes([export_info[10], export_info[11]]);
    for f in [
        FLAG_HAS_FLAGS,
        FLAG_SEND_FLUSH,
        FLAG_SEND_FUA,
        FLAG_SEND_TRIM,
        FLAG_SEND_WRITE_ZEROES,
        FLAG_CAN_MULTI_CONN,
        FLAG_SEND_CACHE,
        FLAG_SEND_FAST_ZERO,
    ] {
        assert_ne!(flags & f, 0, "flag {f:#x} missing from {flags:#x}");
    }
    assert_eq!(flags & (FLAG_ROTATIONAL | FLAG_READ_ONLY | FLAG_SEND_DF), 0);
    let bs = &d.replies[2].data;
    assert_eq!(bs.len(), 14);
    assert_eq!(&bs[0..2], &INFO_BLOCK_SIZE.to_be_bytes());
    assert_eq!(u32::from_be_bytes(bs[2..6].try_into().unwrap()), 512);
    assert_eq!(u32::from_be_bytes(bs[6..10].try_into().unwrap()), 4096);
    assert_eq!(
        u32::from_be_bytes(bs[10..14].try_into().unwrap()),
        32 * 1024 * 1024
    );
    assert_eq!(d.replies[3].reply_type, REP_ACK);
    assert!(!n.is_done(), "INFO does not end negotiation");
}

#[test]
fn export_name_reply_with_and_without_zeroes() {
    for (flags, expected) in [
        (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES, 10),
        (FLAG_C_FIXED_NEWSTYLE, 134),
    ] {
        let mut n = Negotiation::new(export(), limits());
        let mut input = client_flags(flags);
        input.extend(option(OPT_EXPORT_NAME, b"disk"));
        let d = drive(&mut n, &input);
        assert_eq!(d.out.len(), expected);
        assert_eq!(u64::from_be_bytes(d.out[0..8].try_into().unwrap()), SIZE);
        match d.steps.last() {
            Some(NegotiationStep::Transmission { session, .. }) => {
                assert_eq!(session.mode, ReplyMode::Simple);
                assert!(!session.block_sizes_agreed);
            }
            other => panic!("{other:?}"),
        }
    }
    let mut n = negotiating();
    let d = drive(&mut n, &option(OPT_EXPORT_NAME, b"missing"));
    assert!(matches!(d.error, Some(ProtocolError::UnknownExport { .. })));
    assert!(
        d.out.is_empty(),
        "EXPORT_NAME failure is a disconnect, not a reply"
    );
}

#[test]
fn abort_is_acked_and_ends_negotiation() {
    let mut n = negotiating();
    let d = drive(&mut n, &option(OPT_ABORT, b"ignored"));
    assert!(matches!(
        d.steps.last(),
        Some(NegotiationStep::Aborted { .. })
    ));
    assert_eq!(d.replies[0].reply_type, REP_ACK);
    assert!(n.is_done());
    assert_eq!(
        n.step(b"more", &mut Vec::new()),
        Err(ProtocolError::AfterEnd)
    );
}

#[test]
fn endless_options_are_cut_off() {
    let mut n = negotiating();
    let mut input = Vec::new();
    for _ in 0..=limits().max_options {
        input.extend(option(OPT_LIST, &[]));
    }
    let d = drive(&mut n, &input);
    assert_eq!(
        d.error,
        Some(ProtocolError::TooManyOptions {
            max: limits().max_options
        })
    );
}

#[test]
fn data_pipelined_during_negotiation_is_handled_in_order() {
    // CVE-2017-7539 / CVE-2017-9524: a client that sends everything at
    // once. The bytes after GO belong to transmission.
    let read = request(true, 0, CMD_READ, 9, 4096, 512);
    let input = session_bytes(true, true, true, std::slice::from_ref(&read));
    let mut n = Negotiation::new(export(), limits());
    let d = drive(&mut n, &input);
    let session = match d.steps.last() {
        Some(NegotiationStep::Transmission { session, .. }) => session.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(session.mode, ReplyMode::Extended);
    assert_eq!(&input[d.consumed..], &read[..]);
    let r = executed(action(&session, &input[d.consumed..]));
    assert_eq!(r.command, Command::Read { length_bytes: 512 });
    assert_eq!(r.reply_to.cookie, 9);
}

#[test]
fn feeding_one_byte_at_a_time_matches_feeding_everything() {
    let mut requests = Vec::new();
    let mut w = request(false, CMD_FLAG_FUA, CMD_WRITE, 1, 0, 1024);
    w.extend_from_slice(&[7u8; 1024]);
    requests.push(w);
    requests.push(request(false, 0, CMD_READ, 2, 0, 1024));
    requests.push(request(false, 0, 99, 3, 0, 0));
    requests.push(request(false, 0, CMD_DISC, 4, 0, 0));
    let input = session_bytes(true, false, true, &requests);
    // How much had to be buffered depends on the chunking; nothing else may.
    let run = |chunks: &[usize]| harness::HarnessReport {
        peak_buffer_bytes: 0,
        ..harness::run(&export(), &limits(), &input, chunks)
    };
    let whole = run(&[]);
    let bytewise = run(&[1]);
    let mixed = run(&[3, 1, 17, 2]);
    assert_eq!(whole, bytewise);
    assert_eq!(whole, mixed);
    assert_eq!(whole.end, HarnessEnd::Disconnected);
    assert_eq!((whole.executed, whole.rejected), (2, 1));
}

// ------------------------------------------ transmission: bad input ---

#[test]
fn requests_past_the_end_get_einval_or_enospc() {
    for mode in [
        ReplyMode::Simple,
        ReplyMode::Structured,
        ReplyMode::Extended,
    ] {
        let s = session(mode);
        let ext = s.extended();
        let past = |cmd, offset, len| action(&s, &request(ext, 0, cmd, 1, offset, len));
        assert_eq!(rejected(&past(CMD_READ, SIZE - 511, 512)), (NBD_EINVAL, 0));
        assert_eq!(rejected(&past(CMD_TRIM, SIZE, 1)), (NBD_EINVAL, 0));
        assert_eq!(
            rejected(&past(CMD_CACHE, SIZE + 4096, 4096)),
            (NBD_EINVAL, 0)
        );
        assert_eq!(
            rejected(&past(CMD_BLOCK_STATUS, SIZE, 512)),
            (NBD_EINVAL, 0)
        );
        assert_eq!(
            rejected(&past(CMD_WRITE_ZEROES, SIZE - 512, 1024)),
            (NBD_ENOSPC, 0)
        );
        // A write past the end is refused, and its payload still consumed.
        assert_eq!(
            rejected(&past(CMD_WRITE, SIZE - 512, 1024)),
            (NBD_ENOSPC, 1024)
        );
        // offset + length wrapping around u64 is past the end too.
        assert_eq!(
            rejected(&past(CMD_READ, u64::MAX - 10, 512)),
            (NBD_EINVAL, 0)
        );
        assert_eq!(rejected(&past(CMD_WRITE, u64::MAX, 512)), (NBD_ENOSPC, 512));
        // Exactly up to the end is fine.
        assert!(matches!(
            past(CMD_READ, SIZE - 512, 512),
            RequestAction::Execute(_)
        ));
    }
}

#[test]
fn zero_length_requests_are_accepted() {
    for mode in [
        ReplyMode::Simple,
        ReplyMode::Structured,
        ReplyMode::Extended,
    ] {
        let s = session(mode);
        let ext = s.extended();
        for cmd in [CMD_READ, CMD_WRITE, CMD_TRIM, CMD_WRITE_ZEROES, CMD_CACHE] {
            let r = executed(action(&s, &request(ext, 0, cmd, 5, 4096, 0)));
            assert_eq!(r.offset, 4096);
            assert_eq!(r.payload_bytes(), 0);
        }
        // At the very end of the export too.
        executed(action(&s, &request(ext, 0, CMD_READ, 5, SIZE, 0)));
        // Zero-length BLOCK_STATUS cannot be answered (descriptors are
        // non-empty): an error, not a disconnect.
        assert_eq!(
            rejected(&action(&s, &request(ext, 0, CMD_BLOCK_STATUS, 5, 0, 0))).0,
            NBD_EINVAL
        );
    }
}

#[test]
fn unknown_commands_and_flags_get_einval() {
    let s = session(ReplyMode::Structured);
    assert_eq!(
        rejected(&action(&s, &request(false, 0, 8, 1, 0, 512))),
        (NBD_EINVAL, 0)
    );
    assert_eq!(
        rejected(&action(&s, &request(false, 0, 0xffff, 1, 0, 512))),
        (NBD_EINVAL, 0)
    );
    assert_eq!(
        rejected(&action(&s, &request(false, 1 << 15, CMD_READ, 1, 0, 512))),
        (NBD_EINVAL, 0)
    );
    assert_eq!(
        rejected(&action(
            &s,
            &request(false, CMD_FLAG_REQ_ONE, CMD_READ, 1, 0, 512)
        )),
        (NBD_EINVAL, 0)
    );
    assert_eq!(
        rejected(&action(
            &s,
            &request(false, CMD_FLAG_NO_HOLE, CMD_TRIM, 1, 0, 512)
        )),
        (NBD_EINVAL, 0)
    );
    assert_eq!(
        rejected(&action(
            &s,
            &request(false, CMD_FLAG_DF, CMD_WRITE, 1, 0, 512)
        )),
        (NBD_EINVAL, 512)
    );
    // PAYLOAD_LEN is meaningless with compact headers.
    assert_eq!(
        rejected(&action(
            &s,
            &request(false, CMD_FLAG_PAYLOAD_LEN, CMD_WRITE, 1, 0, 16)
        )),
        (NBD_EINVAL, 16)
    );
    // DF needs structured replies.
    let simple = session(ReplyMode::Simple);
    assert_eq!(
        rejected(&action(
            &simple,
            &request(false, CMD_FLAG_DF, CMD_READ, 1, 0, 512)
        )),
        (NBD_EINVAL, 0)
    );
    // FUA is accepted on any command.
    executed(action(
        &s,
        &request(false, CMD_FLAG_FUA, CMD_READ, 1, 0, 512),
    ));
    executed(action(
        &s,
        &request(false, CMD_FLAG_DF, CMD_READ, 1, 0, 512),
    ));
    // Extended: an unknown command with a payload has it skipped.
    let e = session(ReplyMode::Extended);
    assert_eq!(
        rejected(&action(
            &e,
            &request(true, CMD_FLAG_PAYLOAD_LEN, 42, 1, 0, 100)
        )),
        (NBD_EINVAL, 100)
    );
    assert_eq!(
        rejected(&action(
            &e,
            &request(true, CMD_FLAG_PAYLOAD_LEN, CMD_BLOCK_STATUS, 1, 0, 8)
        )),
        (NBD_EINVAL, 8)
    );
}

#[test]
fn extended_write_carries_its_payload_with_or_without_payload_len() {
    let e = session(ReplyMode::Extended);
    for flags in [CMD_FLAG_PAYLOAD_LEN, 0, CMD_FLAG_FUA | CMD_FLAG_PAYLOAD_LEN] {
        let r = executed(action(&e, &request(true, flags, CMD_WRITE, 1, 512, 4096)));
        assert_eq!(r.payload_bytes(), 4096);
    }
    // 64-bit effect lengths for commands without payload.
    let mut big = session(ReplyMode::Extended);
    big.size_bytes = 1 << 40;
    let r = executed(action(
        &big,
        &request(true, 0, CMD_WRITE_ZEROES, 1, 0, 1 << 36),
    ));
    assert_eq!(
        r.command,
        Command::WriteZeroes {
            length_bytes: 1 << 36,
            fua: false,
            may_trim: true,
            fast_only: false
        }
    );
}

#[test]
fn lengths_over_the_maximum() {
    let s = session(ReplyMode::Simple);
    let max = limits().max_payload_bytes as u64;
    let mut big = session(ReplyMode::Simple);
    big.size_bytes = 1 << 40;
    assert_eq!(
        rejected(&action(&big, &request(false, 0, CMD_READ, 1, 0, max + 512))),
        (NBD_EINVAL, 0)
    );
    executed(action(&big, &request(false, 0, CMD_READ, 1, 0, max)));
    // A write over the maximum: refused, and its payload must be skipped.
    assert_eq!(
        rejected(&action(&s, &request(false, 0, CMD_WRITE, 1, 0, max + 1))),
        (NBD_EINVAL, max + 1)
    );
    // Too large even to skip: the session ends.
    let huge = 0xffff_fff0u64;
    assert_eq!(
        decode(&s, &request(false, 0, CMD_WRITE, 1, 0, huge)),
        Err(ProtocolError::PayloadTooLarge {
            length_bytes: huge,
            max_bytes: limits().max_discard_bytes
        })
    );
    let e = session(ReplyMode::Extended);
    assert!(decode(
        &e,
        &request(true, CMD_FLAG_PAYLOAD_LEN, CMD_WRITE, 1, 0, u64::MAX)
    )
    .is_err());
    // Trim and zero may exceed the payload maximum: they carry no data.
    executed(action(
        &big,
        &request(false, 0, CMD_TRIM, 1, 0, 0xffff_fe00),
    ));
}

#[test]
fn bad_request_magic_disconnects() {
    let s = session(ReplyMode::Simple);
    let mut garbage = request(false, 0, CMD_READ, 1, 0, 512);
    garbage[0] ^= 0xff;
    assert!(matches!(
        decode(&s, &garbage),
        Err(ProtocolError::BadRequestMagic { .. })
    ));
    // Refused on the magic alone.
    assert!(matches!(
        decode(&s, b"\0\0\0\0"),
        Err(ProtocolError::BadRequestMagic { .. })
    ));
    // The other header style is garbage too.
    let e = session(ReplyMode::Extended);
    assert!(matches!(
        decode(&e, &request(false, 0, CMD_READ, 1, 0, 512)),
        Err(ProtocolError::BadRequestMagic { .. })
    ));
    assert!(matches!(
        decode(&s, &request(true, 0, CMD_READ, 1, 0, 512)),
        Err(ProtocolError::BadRequestMagic { .. })
    ));
    // A partial header asks for the rest.
    assert_eq!(
        decode(&s, &request(false, 0, CMD_READ, 1, 0, 512)[..10]),
        Ok(RequestDecode::NeedMore {
            min_total_bytes: 28
        })
    );
}

#[test]
fn other_request_rules() {
    let mut s = session(ReplyMode::Structured);
    assert_eq!(
        rejected(&action(&s, &request(false, 0, CMD_FLUSH, 1, 0, 512))),
        (NBD_EINVAL, 0)
    );
    assert_eq!(
        executed(action(
            &s,
            &request(false, CMD_FLAG_FUA, CMD_FLUSH, 1, 0, 0)
        ))
        .command,
        Command::Flush
    );
    // BLOCK_STATUS needs a selected context.
    s.base_allocation = false;
    assert_eq!(
        rejected(&action(&s, &request(false, 0, CMD_BLOCK_STATUS, 1, 0, 512))).0,
        NBD_EINVAL
    );
    // Read-only exports refuse writes with EPERM.
    let mut ro = session(ReplyMode::Simple);
    ro.read_only = true;
    assert_eq!(
        rejected(&action(&ro, &request(false, 0, CMD_WRITE, 1, 0, 512))),
        (NBD_EPERM, 512)
    );
    assert_eq!(
        rejected(&action(&ro, &request(false, 0, CMD_TRIM, 1, 0, 512))).0,
        NBD_EPERM
    );
    executed(action(&ro, &request(false, 0, CMD_READ, 1, 0, 512)));
    // Alignment is enforced only for clients that asked for block sizes.
    let mut aligned = session(ReplyMode::Structured);
    executed(action(&aligned, &request(false, 0, CMD_WRITE, 1, 1, 3)));
    aligned.block_sizes_agreed = true;
    assert_eq!(
        rejected(&action(&aligned, &request(false, 0, CMD_WRITE, 1, 1, 512))),
        (NBD_EINVAL, 512)
    );
    assert_eq!(
        rejected(&action(&aligned, &request(false, 0, CMD_READ, 1, 512, 100))).0,
        NBD_EINVAL
    );
    executed(action(&aligned, &request(false, 0, CMD_READ, 1, 512, 1024)));
    executed(action(
        &aligned,
        &request(false, 0, CMD_BLOCK_STATUS, 1, 1, 100),
    ));
    executed(action(&aligned, &request(false, 0, CMD_CACHE, 1, 1, 100)));
    // An unaligned tail is reachable when the export size is unaligned.
    aligned.size_bytes = SIZE - 100;
    executed(action(
        &aligned,
        &request(false, 0, CMD_READ, 1, SIZE - 512, 412),
    ));
}

#[test]
fn mid_payload_disconnect_ends_the_stream_cleanly() {
    let mut w = request(false, 0, CMD_WRITE, 1, 0, 65536);
    w.extend_from_slice(&[1u8; 1000]); // the client vanishes after 1000 bytes
    let input = session_bytes(false, false, false, &[w]);
    for chunks in [&[][..], &[1][..], &[7, 300][..]] {
        let report = harness::run(&export(), &limits(), &input, chunks);
        assert_eq!(report.end, HarnessEnd::InputExhausted);
        assert_eq!(report.executed, 1);
    }
}

// ------------------------------------------------------ reply layout ---

#[test]
fn read_reply_prefixes() {
    let to = ReplyTo {
        cookie: 0x1122_3344_5566_7788,
        offset: 4096,
        command: CMD_READ,
    };
    for (mode, len) in [
        (ReplyMode::Simple, 16),
        (ReplyMode::Structured, 28),
        (ReplyMode::Extended, 40),
    ] {
        assert_eq!(read_prefix_bytes(mode), len);
        let mut prefix = vec![0xAA; 3];
        encode_read_prefix(&mut prefix, mode, to, 512);
        assert_eq!(prefix.drain(..3).collect::<Vec<_>>(), [0xAA; 3], "appended");
        assert_eq!(prefix.len(), len);
        match mode {
            ReplyMode::Simple => {
                assert_eq!(&prefix[0..4], &SIMPLE_REPLY_MAGIC.to_be_bytes());
                assert_eq!(&prefix[4..8], &[0; 4]);
                assert_eq!(&prefix[8..16], &to.cookie.to_be_bytes());
            }
            ReplyMode::Structured => {
                assert_eq!(&prefix[0..4], &STRUCTURED_REPLY_MAGIC.to_be_bytes());
                assert_eq!(&prefix[6..8], &REPLY_TYPE_OFFSET_DATA.to_be_bytes());
                assert_eq!(&prefix[16..20], &520u32.to_be_bytes());
                assert_eq!(&prefix[20..28], &4096u64.to_be_bytes());
            }
            ReplyMode::Extended => {
                assert_eq!(&prefix[0..4], &EXTENDED_REPLY_MAGIC.to_be_bytes());
                assert_eq!(&prefix[16..24], &4096u64.to_be_bytes());
                assert_eq!(&prefix[24..32], &520u64.to_be_bytes());
                assert_eq!(&prefix[32..40], &4096u64.to_be_bytes());
            }
        }
    }
}

#[test]
fn block_status_layouts() {
    let to = ReplyTo {
        cookie: 3,
        offset: 0,
        command: CMD_BLOCK_STATUS,
    };
    let d = [
        Descriptor {
            length_bytes: 4096,
            flags: STATE_ZERO,
        },
        Descriptor {
            length_bytes: 512,
            flags: 0,
        },
    ];
    let mut out = Vec::new();
    encode_block_status(&mut out, ReplyMode::Structured, to, 1, &d);
    assert_eq!(out.len(), 20 + 4 + 16);
    assert_eq!(&out[6..8], &REPLY_TYPE_BLOCK_STATUS.to_be_bytes());
    assert_eq!(&out[24..28], &4096u32.to_be_bytes());
    assert_eq!(&out[28..32], &STATE_ZERO.to_be_bytes());
    out.clear();
    encode_block_status(&mut out, ReplyMode::Extended, to, 1, &d);
    assert_eq!(out.len(), 32 + 8 + 32);
    assert_eq!(&out[6..8], &REPLY_TYPE_BLOCK_STATUS_EXT.to_be_bytes());
    assert_eq!(&out[36..40], &2u32.to_be_bytes());
    assert_eq!(&out[40..48], &4096u64.to_be_bytes());
}

// ------------------------------------------------------ several exports ---

const MIB: u64 = 1 << 20;

fn named(id: u64, name: &str, description: Option<&str>, size_bytes: u64) -> ExportInfo {
    ExportInfo {
        id,
        name: name.to_string(),
        description: description.map(str::to_string),
        size_bytes,
        read_only: false,
        block_sizes: BlockSizes::default(),
        extended_headers: true,
    }
}

/// Three exports of different sizes: the default one (named ""), a
/// read-only one with a description, and one without a description.
fn three_exports() -> ExportList {
    let mut alpha = named(2, "alpha", Some("Alpha volume"), 2 * MIB);
    alpha.read_only = true;
    ExportList::new(vec![
        named(1, "", Some("the default volume"), MIB),
        alpha,
        named(3, "beta", None, 3 * MIB),
    ])
}

fn negotiating_over(catalog: Arc<dyn ExportCatalog>) -> Negotiation {
    let mut n = Negotiation::with_catalog(catalog, limits(), TlsPolicy::Off, true);
    let d = drive(
        &mut n,
        &client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES),
    );
    assert!(d.error.is_none());
    n
}

/// (name, description) of each NBD_REP_SERVER, and whether an ACK ended them.
fn listed(replies: &[OptReply]) -> (Vec<(String, String)>, bool) {
    let mut servers = Vec::new();
    for r in replies {
        assert_eq!(r.option, OPT_LIST);
        if r.reply_type != REP_SERVER {
            return (servers, r.reply_type == REP_ACK);
        }
        let len = u32::from_be_bytes(r.data[0..4].try_into().unwrap()) as usize;
        let name = String::from_utf8(r.data[4..4 + len].to_vec()).unwrap();
        let text = String::from_utf8(r.data[4 + len..].to_vec()).unwrap();
        servers.push((name, text));
    }
    (servers, false)
}

/// INFO_EXPORT's size and flags, INFO_NAME and INFO_DESCRIPTION from the
/// REP_INFO replies of one INFO or GO.
fn infos(replies: &[OptReply]) -> (u64, u16, Option<String>, Option<String>) {
    let mut got = (0, 0, None, None);
    for r in replies.iter().filter(|r| r.reply_type == REP_INFO) {
        let text = || Some(String::from_utf8(r.data[2..].to_vec()).unwrap());
        match u16::from_be_bytes([r.data[0], r.data[1]]) {
            INFO_EXPORT => {
                got.0 = u64::from_be_bytes(r.data[2..10].try_into().unwrap());
                got.1 = u16::from_be_bytes([r.data[10], r.data[11]]);
            }
            INFO_NAME => got.2 = text(),
            INFO_DESCRIPTION => got.3 = text(),
            _ => {}
        }
    }
    got
}

#[test]
fn list_shows_every_export_with_its_description() {
    let mut n = negotiating_over(Arc::new(three_exports()));
    let d = drive(&mut n, &option(OPT_LIST, &[]));
    let (servers, acked) = listed(&d.replies);
    assert!(acked, "{:?}", d.replies);
    assert_eq!(
        servers,
        [
            ("".to_string(), "the default volume".to_string()),
            ("alpha".to_string(), "Alpha volume".to_string()),
            ("beta".to_string(), String::new()),
        ]
    );
    // No description: the reply is the name alone (4 + 4 bytes).
    assert_eq!(d.replies[2].data.len(), 8);
}

/// A read-only export does not offer the commands it refuses with EPERM
/// (trim, write-zeroes, fast zero, FUA), as nbdkit -r does not; it keeps
/// FLUSH and CACHE. A writable one offers them all.
#[test]
fn read_only_exports_advertise_no_write_commands() {
    const WRITES: [u16; 4] = [
        FLAG_SEND_FUA,
        FLAG_SEND_TRIM,
        FLAG_SEND_WRITE_ZEROES,
        FLAG_SEND_FAST_ZERO,
    ];
    let mut n = negotiating_over(Arc::new(three_exports()));
    let d = drive(&mut n, &option(OPT_INFO, &info_data("alpha", &[])));
    let (_, flags, _, _) = infos(&d.replies);
    assert_ne!(flags & FLAG_READ_ONLY, 0, "alpha is read-only");
    for f in [
        FLAG_HAS_FLAGS,
        FLAG_SEND_FLUSH,
        FLAG_SEND_CACHE,
        FLAG_CAN_MULTI_CONN,
    ] {
        assert_ne!(flags & f, 0, "flag {f:#x} missing from {flags:#x}");
    }
    for f in WRITES {
        assert_eq!(
            flags & f,
            0,
            "read-only export advertises {f:#x}: {flags:#x}"
        );
    }
    let d = drive(&mut n, &option(OPT_INFO, &info_data("beta", &[])));
    let (_, flags, _, _) = infos(&d.replies);
    assert_eq!(flags & FLAG_READ_ONLY, 0, "beta is writable");
    for f in WRITES {
        assert_ne!(flags & f, 0, "flag {f:#x} missing from {flags:#x}");
    }
}

#[test]
fn info_and_go_describe_the_export_named() {
    let mut n = negotiating_over(Arc::new(three_exports()));
    let want = [INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE];
    let d = drive(&mut n, &option(OPT_INFO, &info_data("alpha", &want)));
    let (size, flags, name, description) = infos(&d.replies);
    assert_eq!(d.replies.last().unwrap().reply_type, REP_ACK);
    assert_eq!(size, 2 * MIB);
    assert_ne!(flags & FLAG_READ_ONLY, 0, "alpha is read-only");
    assert_ne!(flags & FLAG_CAN_MULTI_CONN, 0);
    assert_eq!(name.as_deref(), Some("alpha"));
    assert_eq!(description.as_deref(), Some("Alpha volume"));

    // No description to give: none sent, though asked for.
    let d = drive(&mut n, &option(OPT_INFO, &info_data("beta", &want)));
    let (size, flags, name, description) = infos(&d.replies);
    assert_eq!((size, flags & FLAG_READ_ONLY), (3 * MIB, 0));
    assert_eq!((name.as_deref(), description), (Some("beta"), None));

    // The empty name is the export named "".
    let d = drive(&mut n, &option(OPT_INFO, &info_data("", &want)));
    let (size, _, name, description) = infos(&d.replies);
    assert_eq!(size, MIB);
    assert_eq!(name.as_deref(), Some(""));
    assert_eq!(description.as_deref(), Some("the default volume"));

    // Unknown: ERR_UNKNOWN, and the negotiation goes on to a GO.
    let mut input = option(OPT_INFO, &info_data("gamma", &want));
    input.extend(option(OPT_GO, &info_data("gamma", &[])));
    input.extend(option(OPT_GO, &info_data("beta", &[INFO_BLOCK_SIZE])));
    let d = drive(&mut n, &input);
    assert_eq!(d.replies[0].reply_type, REP_ERR_UNKNOWN);
    assert!(String::from_utf8_lossy(&d.replies[0].data).contains("gamma"));
    assert_eq!(d.replies[1].reply_type, REP_ERR_UNKNOWN);
    assert_eq!(infos(&d.replies[2..]).0, 3 * MIB);
    match d.steps.last() {
        Some(NegotiationStep::Transmission { session, .. }) => {
            assert_eq!(
                (session.export_id, session.export_name.as_str()),
                (3, "beta")
            );
            assert_eq!(session.size_bytes, 3 * MIB);
            assert!(!session.read_only);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn without_an_export_named_empty_the_empty_name_is_unknown() {
    let catalog = Arc::new(ExportList::new(vec![
        named(1, "a", None, MIB),
        named(2, "b", None, 2 * MIB),
    ]));
    let mut n = negotiating_over(catalog.clone());
    let mut input = option(OPT_GO, &info_data("", &[]));
    input.extend(option(OPT_EXPORT_NAME, b""));
    let d = drive(&mut n, &input);
    assert_eq!(d.replies[0].reply_type, REP_ERR_UNKNOWN);
    assert_eq!(
        d.error,
        Some(ProtocolError::UnknownExport {
            name: String::new()
        })
    );

    // A catalog may name a default: then the empty name is that export.
    let defaulted = Arc::new(ExportList::new(catalog.exports().to_vec()).with_default("b"));
    let mut n = negotiating_over(defaulted);
    let d = drive(&mut n, &option(OPT_INFO, &info_data("", &[INFO_NAME])));
    let (size, _, name, _) = infos(&d.replies);
    assert_eq!((size, name.as_deref()), (2 * MIB, Some("b")));
}

#[test]
fn export_name_selects_its_export_or_ends_the_session() {
    let mut n = negotiating_over(Arc::new(three_exports()));
    let d = drive(&mut n, &option(OPT_EXPORT_NAME, b"beta"));
    assert_eq!(d.out.len(), 10, "size and flags, no zeroes");
    assert_eq!(u64::from_be_bytes(d.out[0..8].try_into().unwrap()), 3 * MIB);
    match d.steps.last() {
        Some(NegotiationStep::Transmission { session, .. }) => assert_eq!(session.export_id, 3),
        other => panic!("{other:?}"),
    }

    let mut n = negotiating_over(Arc::new(three_exports()));
    let d = drive(&mut n, &option(OPT_EXPORT_NAME, b"gamma"));
    assert!(
        d.out.is_empty(),
        "EXPORT_NAME cannot be refused with a reply"
    );
    assert_eq!(
        d.error,
        Some(ProtocolError::UnknownExport {
            name: "gamma".to_string()
        })
    );
    assert!(n.is_done());
}

#[test]
fn base_allocation_holds_only_for_the_export_set_meta_context_named() {
    for (set, go, expected) in [
        ("alpha", "alpha", true),
        ("alpha", "beta", false),
        ("", "", true),
        ("beta", "", false),
    ] {
        let mut n = negotiating_over(Arc::new(three_exports()));
        let mut input = option(OPT_STRUCTURED_REPLY, &[]);
        input.extend(option(
            OPT_SET_META_CONTEXT,
            &meta_data(set, &[BASE_ALLOCATION]),
        ));
        input.extend(option(OPT_GO, &info_data(go, &[])));
        let d = drive(&mut n, &input);
        assert_eq!(d.replies[1].reply_type, REP_META_CONTEXT);
        match d.steps.last() {
            Some(NegotiationStep::Transmission { session, .. }) => {
                assert_eq!(session.base_allocation, expected, "SET {set:?}, GO {go:?}")
            }
            other => panic!("{other:?}"),
        }
    }
    // SET for an unknown export selects nothing.
    let mut n = negotiating_over(Arc::new(three_exports()));
    let mut input = option(OPT_STRUCTURED_REPLY, &[]);
    input.extend(option(
        OPT_SET_META_CONTEXT,
        &meta_data("gamma", &[BASE_ALLOCATION]),
    ));
    let d = drive(&mut n, &input);
    assert_eq!(d.replies[1].reply_type, REP_ERR_UNKNOWN);
}

/// A catalog whose exports change while a client negotiates.
struct Changing(std::sync::Mutex<Vec<ExportInfo>>);

impl ExportCatalog for Changing {
    fn lookup(&self, name: &[u8]) -> Option<ExportInfo> {
        let exports = self.0.lock().unwrap();
        exports.iter().find(|e| e.name.as_bytes() == name).cloned()
    }

    fn list(&self, visit: &mut dyn FnMut(&str, Option<&str>) -> bool) {
        for e in self.0.lock().unwrap().iter() {
            if !visit(&e.name, e.description.as_deref()) {
                return;
            }
        }
    }
}

#[test]
fn each_option_sees_the_catalog_as_it_is_then() {
    let catalog = Arc::new(Changing(std::sync::Mutex::new(vec![named(
        1, "old", None, MIB,
    )])));
    let mut n = negotiating_over(catalog.clone());
    let d = drive(&mut n, &option(OPT_LIST, &[]));
    assert_eq!(listed(&d.replies).0, [("old".to_string(), String::new())]);
    *catalog.0.lock().unwrap() = vec![named(2, "new", Some("added"), 2 * MIB)];
    let mut input = option(OPT_LIST, &[]);
    input.extend(option(OPT_GO, &info_data("old", &[])));
    input.extend(option(OPT_GO, &info_data("new", &[])));
    let d = drive(&mut n, &input);
    assert_eq!(
        listed(&d.replies[..2]).0,
        [("new".to_string(), "added".to_string())]
    );
    assert_eq!(d.replies[2].reply_type, REP_ERR_UNKNOWN, "removed since");
    match d.steps.last() {
        Some(NegotiationStep::Transmission { session, .. }) => assert_eq!(session.export_id, 2),
        other => panic!("{other:?}"),
    }
}

#[test]
fn list_is_bounded_in_count_and_length() {
    let mut exports: Vec<ExportInfo> = (0..MAX_LISTED_EXPORTS as u64 + 50)
        .map(|i| named(i + 10, &format!("vol{i}"), None, MIB))
        .collect();
    // A name no client could send back is left out; a long description
    // is cut at 4096 bytes (on a character boundary).
    exports.insert(0, named(1, &"n".repeat(MAX_STRING_BYTES + 1), None, MIB));
    exports.insert(1, named(2, "long", Some(&"é".repeat(3000)), MIB));
    let mut n = negotiating_over(Arc::new(ExportList::new(exports)));
    let (d, peak) = peak_allocation(|| drive(&mut n, &option(OPT_LIST, &[])));
    let (servers, acked) = listed(&d.replies);
    assert!(acked);
    assert_eq!(servers.len(), MAX_LISTED_EXPORTS);
    assert_eq!(servers[0].0, "long");
    assert_eq!(servers[0].1.len(), MAX_STRING_BYTES);
    assert_eq!(servers[1].0, "vol0");
    assert_eq!(
        servers.last().unwrap().0,
        format!("vol{}", MAX_LISTED_EXPORTS - 2)
    );
    assert!(peak < 1 << 20, "LIST allocated {peak} bytes");
}
