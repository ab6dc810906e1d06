//! Drives the codec over an arbitrary byte stream the way the server's
//! reader does (negotiate, then parse requests and skip payloads), checking
//! invariants as it goes. The proptest fuzz test and the cargo-fuzz target
//! both run it; any violated invariant panics.

use std::sync::Arc;

use super::reply::{encode_error, encode_ok};
use super::wire;
use super::{
    decode_request, ExportCatalog, ExportInfo, ExportList, Limits, Negotiation, NegotiationStep,
    ProtocolError, RequestAction, RequestDecode, Session, TlsPolicy, MAX_LISTED_EXPORTS,
};
use crate::proto::MAX_STRING_BYTES;

/// How a harness run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HarnessEnd {
    /// Input ran out in the middle of a message (or between messages).
    InputExhausted,
    Protocol(ProtocolError),
    Aborted,
    Disconnected,
    /// Clear-text bytes followed an accepted STARTTLS: refused by the
    /// codec if they were already buffered, or (the server would feed
    /// them to the TLS handshake) a failed handshake if not yet read.
    ClearTextAfterStartTls,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HarnessReport {
    pub end: HarnessEnd,
    pub reached_transmission: bool,
    /// A STARTTLS was accepted (the harness then takes the rest of the
    /// input as what arrives through TLS).
    pub tls_established: bool,
    /// The export transmission was entered with ([`ExportInfo::id`]).
    pub export_id: Option<u64>,
    pub options: u32,
    pub executed: u32,
    pub rejected: u32,
    /// Bytes of replies the server would have sent.
    pub reply_bytes: u64,
    /// The most bytes the codec ever asked to have buffered at once.
    pub peak_buffer_bytes: usize,
}

/// Largest reply one negotiation step may produce (INFO/GO with every
/// info item plus a description is well under this), LIST aside: that
/// one's bound is the catalog's listing ([`listing_bytes`]).
const MAX_STEP_REPLY_BYTES: usize = 16 * 1024;

/// Feed `input` to the codec `chunk_bytes` at a time (cycling through the
/// list; zero entries count as 1) and report what happened.
pub fn run(
    export: &ExportInfo,
    limits: &Limits,
    input: &[u8],
    chunk_bytes: &[usize],
) -> HarnessReport {
    run_with_tls(export, limits, TlsPolicy::Off, input, &[], chunk_bytes)
}

/// [`run`] with a TLS policy: `clear` is what the client sends before
/// TLS; once the codec accepts a STARTTLS and the (simulated) TLS
/// handshake is done, `through_tls` is what it sends through TLS.
pub fn run_with_tls(
    export: &ExportInfo,
    limits: &Limits,
    tls: TlsPolicy,
    clear: &[u8],
    through_tls: &[u8],
    chunk_bytes: &[usize],
) -> HarnessReport {
    let catalog = Arc::new(ExportList::single(export.clone()));
    let extended_headers = export.extended_headers;
    run_catalog(
        catalog,
        extended_headers,
        limits,
        tls,
        clear,
        through_tls,
        chunk_bytes,
    )
}

/// [`run_with_tls`] over several exports: whatever `catalog` holds (it
/// must not change during the run: the harness checks each session
/// against it).
pub fn run_catalog(
    catalog: Arc<dyn ExportCatalog>,
    extended_headers: bool,
    limits: &Limits,
    tls: TlsPolicy,
    clear: &[u8],
    through_tls: &[u8],
    chunk_bytes: &[usize],
) -> HarnessReport {
    let mut feeder = Feeder {
        input: clear,
        after_tls: through_tls,
        fed: 0,
        chunk_bytes,
        next_chunk: 0,
        buffer: Vec::new(),
    };
    let mut report = HarnessReport {
        end: HarnessEnd::InputExhausted,
        reached_transmission: false,
        tls_established: false,
        export_id: None,
        options: 0,
        executed: 0,
        rejected: 0,
        reply_bytes: 0,
        peak_buffer_bytes: 0,
    };
    let negotiation =
        Negotiation::with_catalog(catalog.clone(), limits.clone(), tls, extended_headers);
    let Some(session) = negotiate(negotiation, &*catalog, limits, &mut feeder, &mut report) else {
        return report;
    };
    report.reached_transmission = true;
    report.export_id = Some(session.export_id);
    transmit(&session, limits, &mut feeder, &mut report);
    report
}

/// The negotiation half of [`run`]: the session it ends in, or `None`
/// with `report.end` saying why it did not get there.
fn negotiate(
    mut negotiation: Negotiation,
    catalog: &dyn ExportCatalog,
    limits: &Limits,
    feeder: &mut Feeder<'_>,
    report: &mut HarnessReport,
) -> Option<Session> {
    let tls = negotiation.tls_policy();
    let buffer_limit = wire::OPTION_HEADER_BYTES + limits.max_option_bytes as usize;
    let max_step_reply_bytes = MAX_STEP_REPLY_BYTES + listing_bytes(catalog);
    report.reply_bytes += negotiation.greeting().len() as u64;
    let mut out = Vec::new();

    let session: Session = loop {
        out.clear();
        let step = match negotiation.step(&feeder.buffer, &mut out) {
            Ok(step) => step,
            Err(ProtocolError::DataAfterStartTls { .. }) => {
                report.end = HarnessEnd::ClearTextAfterStartTls;
                return None;
            }
            Err(e) => {
                report.end = HarnessEnd::Protocol(e);
                return None;
            }
        };
        assert!(
            out.len() <= max_step_reply_bytes,
            "one option produced {} reply bytes",
            out.len()
        );
        report.reply_bytes += out.len() as u64;
        match step {
            NegotiationStep::NeedMore { min_total_bytes } => {
                assert!(
                    min_total_bytes > feeder.buffer.len(),
                    "NeedMore({min_total_bytes}) with {} bytes already buffered",
                    feeder.buffer.len()
                );
                assert!(
                    min_total_bytes <= buffer_limit,
                    "negotiation asked to buffer {min_total_bytes} bytes, limit {buffer_limit}"
                );
                report.peak_buffer_bytes = report.peak_buffer_bytes.max(min_total_bytes);
                if !feeder.feed() {
                    return None;
                }
            }
            NegotiationStep::Consumed { bytes } => {
                report.options += 1;
                feeder.consume(bytes);
            }
            NegotiationStep::Transmission { bytes, session } => {
                report.options += 1;
                feeder.consume(bytes);
                assert!(
                    tls != TlsPolicy::Required || session.tls,
                    "transmission without TLS when TLS is required"
                );
                assert_eq!(session.tls, report.tls_established);
                check_session(catalog, &session);
                break session;
            }
            NegotiationStep::StartTls { bytes } => {
                assert_ne!(tls, TlsPolicy::Off, "STARTTLS accepted with TLS off");
                assert!(!report.tls_established, "STARTTLS accepted twice");
                assert_eq!(
                    bytes,
                    feeder.buffer.len(),
                    "STARTTLS accepted with clear-text bytes after it"
                );
                feeder.consume(bytes);
                if !feeder.start_tls() {
                    report.end = HarnessEnd::ClearTextAfterStartTls;
                    return None;
                }
                report.options += 1;
                negotiation.tls_established();
                report.tls_established = true;
            }
            NegotiationStep::Aborted { bytes } => {
                feeder.consume(bytes);
                report.end = HarnessEnd::Aborted;
                return None;
            }
        }
    };
    assert!(negotiation.is_done());
    Some(session)
}

/// The transmission half of [`run`]: parse requests and skip payloads
/// until the input or the session ends.
fn transmit(
    session: &Session,
    limits: &Limits,
    feeder: &mut Feeder<'_>,
    report: &mut HarnessReport,
) {
    let mut out = Vec::new();
    loop {
        let decoded = match decode_request(&feeder.buffer, session, limits) {
            Ok(d) => d,
            Err(e) => {
                report.end = HarnessEnd::Protocol(e);
                return;
            }
        };
        match decoded {
            RequestDecode::NeedMore { min_total_bytes } => {
                assert!(min_total_bytes > feeder.buffer.len());
                assert!(min_total_bytes <= wire::EXTENDED_REQUEST_BYTES);
                report.peak_buffer_bytes = report.peak_buffer_bytes.max(min_total_bytes);
                if !feeder.feed() {
                    return;
                }
            }
            RequestDecode::Request {
                header_bytes,
                action,
            } => {
                assert!(header_bytes <= feeder.buffer.len());
                feeder.consume(header_bytes);
                out.clear();
                let skip = match action {
                    RequestAction::Disconnect => {
                        report.end = HarnessEnd::Disconnected;
                        return;
                    }
                    RequestAction::Execute(request) => {
                        report.executed += 1;
                        check_executable(session, limits, &request);
                        encode_ok(&mut out, session.mode, request.reply_to);
                        request.payload_bytes()
                    }
                    RequestAction::Reject {
                        reply_to,
                        errno,
                        message,
                        discard_bytes,
                    } => {
                        report.rejected += 1;
                        assert_ne!(errno, 0);
                        assert!(discard_bytes <= limits.max_discard_bytes);
                        encode_error(&mut out, session.mode, reply_to, errno, message);
                        discard_bytes
                    }
                };
                report.reply_bytes += out.len() as u64;
                if !feeder.skip(skip) {
                    return;
                }
            }
        }
    }
}

/// The session describes an export of the catalog, as the catalog does.
fn check_session(catalog: &dyn ExportCatalog, session: &Session) {
    let export = catalog
        .lookup(session.export_name.as_bytes())
        .unwrap_or_else(|| panic!("transmission of unknown export {:?}", session.export_name));
    assert_eq!(session.export_id, export.id, "{session:?}");
    assert_eq!(session.size_bytes, export.size_bytes, "{session:?}");
    assert_eq!(session.read_only, export.read_only, "{session:?}");
    assert_eq!(session.block_sizes, export.block_sizes, "{session:?}");
}

/// The most bytes an NBD_OPT_LIST of `catalog` may take: a header, the
/// name length, the name and at most 4096 bytes of description per export
/// listed, and the ACK.
fn listing_bytes(catalog: &dyn ExportCatalog) -> usize {
    let mut total = wire::OPTION_REPLY_HEADER_BYTES;
    let mut listed = 0usize;
    catalog.list(&mut |name, description| {
        let text = description.map_or(0, |d| d.len().min(MAX_STRING_BYTES));
        total += wire::OPTION_REPLY_HEADER_BYTES + 4 + name.len() + text;
        listed += 1;
        listed < MAX_LISTED_EXPORTS
    });
    total
}

fn check_executable(session: &Session, limits: &Limits, request: &super::Request) {
    use super::Command;
    let (length, payload) = match request.command {
        Command::Read { length_bytes } => (length_bytes as u64, false),
        Command::Write { length_bytes, .. } => (length_bytes as u64, true),
        Command::Flush => (0, false),
        Command::Trim { length_bytes, .. }
        | Command::WriteZeroes { length_bytes, .. }
        | Command::Cache { length_bytes }
        | Command::BlockStatus { length_bytes, .. } => (length_bytes, false),
    };
    let end = request.offset.checked_add(length);
    assert!(
        end.is_some_and(|end| end <= session.size_bytes),
        "executable request out of bounds: {request:?}"
    );
    if payload || matches!(request.command, Command::Read { .. }) {
        assert!(length <= limits.max_payload_bytes as u64);
    }
    if let Command::BlockStatus { .. } = request.command {
        assert!(session.base_allocation && length > 0);
    }
}

struct Feeder<'a> {
    input: &'a [u8],
    /// What the client sends once TLS is up.
    after_tls: &'a [u8],
    fed: usize,
    chunk_bytes: &'a [usize],
    next_chunk: usize,
    buffer: Vec<u8>,
}

impl Feeder<'_> {
    /// Move the next chunk of input into the buffer; false at end of input.
    fn feed(&mut self) -> bool {
        if self.fed >= self.input.len() {
            return false;
        }
        let want = if self.chunk_bytes.is_empty() {
            usize::MAX
        } else {
            let c = self.chunk_bytes[self.next_chunk % self.chunk_bytes.len()];
            self.next_chunk += 1;
            c.max(1)
        };
        let take = want.min(self.input.len() - self.fed);
        self.buffer
            .extend_from_slice(&self.input[self.fed..self.fed + take]);
        self.fed += take;
        true
    }

    fn consume(&mut self, n: usize) {
        self.buffer.drain(..n);
    }

    /// Switch to the bytes sent through TLS; false if clear-text input
    /// remains (it would reach the TLS handshake and fail it).
    fn start_tls(&mut self) -> bool {
        assert!(self.buffer.is_empty());
        if self.fed < self.input.len() {
            return false;
        }
        self.input = self.after_tls;
        self.after_tls = &[];
        self.fed = 0;
        true
    }

    /// Drop `n` payload bytes, feeding more input as needed; false if the
    /// input ends first (a client disconnecting mid-payload).
    fn skip(&mut self, mut n: u64) -> bool {
        loop {
            let here = (self.buffer.len() as u64).min(n) as usize;
            self.consume(here);
            n -= here as u64;
            if n == 0 {
                return true;
            }
            // Skip straight through the input rather than buffering it.
            let direct = ((self.input.len() - self.fed) as u64).min(n) as usize;
            self.fed += direct;
            n -= direct as u64;
            if n == 0 {
                return true;
            }
            if !self.feed() {
                return false;
            }
        }
    }
}
