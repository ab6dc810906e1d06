//! Fixed-newstyle negotiation as a pure state machine.

use std::sync::Arc;

use super::option::{encode_option_reply as option_reply, Info};
use super::wire::{self, put_u16, put_u32, put_u64, Reader};
use super::{
    printable, transmission_flags, ExportCatalog, ExportInfo, ExportList, Limits, ProtocolError,
    ReplyMode, Session, TlsPolicy, BASE_ALLOCATION_ID, MAX_LISTED_EXPORTS,
};
use crate::proto::*;

/// The client's answer to the handshake flags of the greeting: it takes
/// fixed newstyle and NO_ZEROES whenever the server offers them.
pub fn client_flags_for(server_flags: u16) -> u32 {
    let mut client_flags = 0u32;
    if server_flags & FLAG_FIXED_NEWSTYLE != 0 {
        client_flags |= FLAG_C_FIXED_NEWSTYLE;
    }
    if server_flags & FLAG_NO_ZEROES != 0 {
        client_flags |= FLAG_C_NO_ZEROES;
    }
    client_flags
}

/// What one call to [`Negotiation::step`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NegotiationStep {
    /// Nothing consumed: call again once `input` holds at least this many
    /// bytes. The figure is already checked against the limits.
    NeedMore { min_total_bytes: usize },
    /// One message consumed; replies (if any) were appended to `out`.
    Consumed { bytes: usize },
    /// Negotiation finished: send `out`, then enter transmission. Bytes
    /// after `bytes` in the input already belong to the transmission phase.
    Transmission { bytes: usize, session: Session },
    /// The client sent NBD_OPT_ABORT: send `out` (the ACK), then close.
    Aborted { bytes: usize },
    /// The client sent NBD_OPT_STARTTLS and it was accepted: send `out`
    /// (the ACK), run the TLS handshake on the socket, then call
    /// [`Negotiation::tls_established`] and go on stepping with what
    /// arrives through TLS. Nothing followed STARTTLS in the input (that
    /// would be a [`ProtocolError::DataAfterStartTls`]).
    StartTls { bytes: usize },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    ClientFlags,
    Options,
    /// STARTTLS was acknowledged; the TLS handshake is the caller's.
    AwaitingTls,
    Done,
}

/// The server side of the handshake for one connection.
#[derive(Clone)]
pub struct Negotiation {
    catalog: Arc<dyn ExportCatalog>,
    extended_headers: bool,
    limits: Limits,
    state: State,
    no_zeroes: bool,
    mode: ReplyMode,
    /// The export (by [`ExportInfo::id`]) whose `base:allocation` the last
    /// SET_META_CONTEXT selected: it holds only if GO picks that export.
    base_allocation_for: Option<u64>,
    options_seen: u32,
    tls: TlsPolicy,
    tls_active: bool,
}

impl std::fmt::Debug for Negotiation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Negotiation")
            .field("extended_headers", &self.extended_headers)
            .field("limits", &self.limits)
            .field("state", &self.state)
            .field("no_zeroes", &self.no_zeroes)
            .field("mode", &self.mode)
            .field("base_allocation_for", &self.base_allocation_for)
            .field("options_seen", &self.options_seen)
            .field("tls", &self.tls)
            .field("tls_active", &self.tls_active)
            .finish_non_exhaustive()
    }
}

impl Negotiation {
    /// A negotiation for one export that offers no TLS (STARTTLS gets
    /// ERR_POLICY). The empty name selects the export too.
    pub fn new(export: ExportInfo, limits: Limits) -> Self {
        Self::with_tls(export, limits, TlsPolicy::Off)
    }

    /// [`Negotiation::new`] with a TLS policy.
    pub fn with_tls(export: ExportInfo, limits: Limits, tls: TlsPolicy) -> Self {
        let extended_headers = export.extended_headers;
        let catalog = Arc::new(ExportList::single(export));
        Self::with_catalog(catalog, limits, tls, extended_headers)
    }

    /// A negotiation over whatever exports `catalog` holds when each option
    /// arrives; `extended_headers` offers NBD_OPT_EXTENDED_HEADERS.
    pub fn with_catalog(
        catalog: Arc<dyn ExportCatalog>,
        limits: Limits,
        tls: TlsPolicy,
        extended_headers: bool,
    ) -> Self {
        Negotiation {
            catalog,
            extended_headers,
            limits,
            state: State::ClientFlags,
            no_zeroes: false,
            mode: ReplyMode::Simple,
            base_allocation_for: None,
            options_seen: 0,
            tls,
            tls_active: false,
        }
    }

    pub fn tls_policy(&self) -> TlsPolicy {
        self.tls
    }

    /// The TLS handshake after [`NegotiationStep::StartTls`] succeeded.
    /// Everything negotiated before it is forgotten (reply mode, metadata
    /// contexts): a man in the middle could have sent it, and the spec
    /// asks the server to start over (the class of nbdkit's
    /// CVE-2021-3716). The option count is kept: the budget is per
    /// connection.
    pub fn tls_established(&mut self) {
        assert_eq!(self.state, State::AwaitingTls, "no STARTTLS was accepted");
        assert!(!self.tls_active, "TLS established twice");
        self.mode = ReplyMode::Simple;
        self.base_allocation_for = None;
        self.tls_active = true;
        self.state = State::Options;
    }

    pub fn tls_active(&self) -> bool {
        self.tls_active
    }

    /// The server's opening bytes: NBDMAGIC, IHAVEOPT, handshake flags.
    pub fn greeting(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(wire::GREETING_BYTES);
        put_u64(&mut out, NBDMAGIC);
        put_u64(&mut out, IHAVEOPT);
        put_u16(&mut out, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        out
    }

    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Consume at most one client message from the front of `input`,
    /// appending any replies to `out`.
    pub fn step(
        &mut self,
        input: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<NegotiationStep, ProtocolError> {
        match self.state {
            State::ClientFlags => self.client_flags(input),
            State::Options => self.option(input, out),
            State::AwaitingTls | State::Done => Err(ProtocolError::AfterEnd),
        }
    }

    fn client_flags(&mut self, input: &[u8]) -> Result<NegotiationStep, ProtocolError> {
        let Some(flags) = Reader::new(input).u32() else {
            return Ok(NegotiationStep::NeedMore {
                min_total_bytes: wire::CLIENT_FLAGS_BYTES,
            });
        };
        if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
            self.state = State::Done;
            return Err(ProtocolError::BadClientFlags { flags });
        }
        self.no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
        self.state = State::Options;
        Ok(NegotiationStep::Consumed {
            bytes: wire::CLIENT_FLAGS_BYTES,
        })
    }

    fn option(
        &mut self,
        input: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<NegotiationStep, ProtocolError> {
        let mut r = Reader::new(input);
        // Check the magic as soon as it is complete, so garbage is refused
        // without waiting for a full header.
        let Some(magic) = r.u64() else {
            return Ok(NegotiationStep::NeedMore {
                min_total_bytes: wire::OPTION_HEADER_BYTES,
            });
        };
        if magic != IHAVEOPT {
            self.state = State::Done;
            return Err(ProtocolError::BadOptionMagic { magic });
        }
        let (Some(option), Some(length_bytes)) = (r.u32(), r.u32()) else {
            return Ok(NegotiationStep::NeedMore {
                min_total_bytes: wire::OPTION_HEADER_BYTES,
            });
        };
        // Validate the claimed length before asking for (or touching) the
        // data; 0xffffffff ends here.
        if option == OPT_EXPORT_NAME && length_bytes > self.limits.max_name_bytes {
            self.state = State::Done;
            return Err(ProtocolError::ExportNameTooLong {
                length_bytes,
                max_bytes: self.limits.max_name_bytes,
            });
        }
        if length_bytes > self.limits.max_option_bytes {
            self.state = State::Done;
            return Err(ProtocolError::OptionTooLong {
                option,
                length_bytes,
                max_bytes: self.limits.max_option_bytes,
            });
        }
        let total = wire::OPTION_HEADER_BYTES + length_bytes as usize;
        let Some(data) = r.take(length_bytes as usize) else {
            return Ok(NegotiationStep::NeedMore {
                min_total_bytes: total,
            });
        };
        self.options_seen += 1;
        if self.options_seen > self.limits.max_options {
            self.state = State::Done;
            return Err(ProtocolError::TooManyOptions {
                max: self.limits.max_options,
            });
        }
        tracing::trace!(option = option_name(option), length_bytes, "option");

        if self.tls == TlsPolicy::Required
            && !self.tls_active
            && option != OPT_STARTTLS
            && option != OPT_ABORT
        {
            if option == OPT_EXPORT_NAME {
                // It cannot be answered with an error: hang up.
                self.state = State::Done;
                return Err(ProtocolError::TlsRequired);
            }
            option_error(
                out,
                option,
                REP_ERR_TLS_REQD,
                "TLS is required: send NBD_OPT_STARTTLS first",
            );
            return Ok(NegotiationStep::Consumed { bytes: total });
        }

        match option {
            OPT_EXPORT_NAME => self.export_name(data, total, out),
            OPT_ABORT => {
                // The spec says to ignore any data sent with ABORT.
                option_reply(out, option, REP_ACK, &[]);
                self.state = State::Done;
                Ok(NegotiationStep::Aborted { bytes: total })
            }
            OPT_INFO | OPT_GO => self.info_or_go(option, data, total, out),
            OPT_STARTTLS => self.start_tls(data, input.len() - total, total, out),
            _ => {
                self.haggle(option, data, out);
                Ok(NegotiationStep::Consumed { bytes: total })
            }
        }
    }

    /// The options that never end negotiation: answer them and go on.
    fn haggle(&mut self, option: u32, data: &[u8], out: &mut Vec<u8>) {
        match option {
            OPT_LIST => {
                if data.is_empty() {
                    self.list(out);
                } else {
                    option_error(out, option, REP_ERR_INVALID, "NBD_OPT_LIST takes no data");
                }
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    option_error(
                        out,
                        option,
                        REP_ERR_INVALID,
                        "NBD_OPT_STRUCTURED_REPLY takes no data",
                    );
                } else if self.mode == ReplyMode::Extended {
                    option_error(
                        out,
                        option,
                        REP_ERR_EXT_HEADER_REQD,
                        "extended headers are already negotiated",
                    );
                } else {
                    self.mode = ReplyMode::Structured;
                    option_reply(out, option, REP_ACK, &[]);
                }
            }
            OPT_EXTENDED_HEADERS => {
                if !self.extended_headers {
                    option_error(out, option, REP_ERR_UNSUP, "extended headers are disabled");
                } else if !data.is_empty() {
                    option_error(
                        out,
                        option,
                        REP_ERR_INVALID,
                        "NBD_OPT_EXTENDED_HEADERS takes no data",
                    );
                } else {
                    self.mode = ReplyMode::Extended;
                    option_reply(out, option, REP_ACK, &[]);
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => self.meta_context(option, data, out),
            _ => option_error(out, option, REP_ERR_UNSUP, "option not supported"),
        }
    }

    /// NBD_OPT_LIST: one NBD_REP_SERVER per export (the name, then its
    /// description as the free text nbd-server and nbdkit put there), at
    /// most [`MAX_LISTED_EXPORTS`], then ACK. A name a client could not
    /// send back (over the protocol's 4096 bytes) is left out.
    fn list(&self, out: &mut Vec<u8>) {
        let mut payload = Vec::new();
        let mut listed = 0usize;
        self.catalog.list(&mut |name, description| {
            if name.len() > MAX_STRING_BYTES {
                return true;
            }
            payload.clear();
            put_u32(&mut payload, name.len() as u32);
            payload.extend_from_slice(name.as_bytes());
            if let Some(text) = description {
                payload.extend_from_slice(wire::truncate_utf8(text, MAX_STRING_BYTES).as_bytes());
            }
            option_reply(out, OPT_LIST, REP_SERVER, &payload);
            listed += 1;
            listed < MAX_LISTED_EXPORTS
        });
        option_reply(out, OPT_LIST, REP_ACK, &[]);
    }

    fn start_tls(
        &mut self,
        data: &[u8],
        bytes_after: usize,
        total: usize,
        out: &mut Vec<u8>,
    ) -> Result<NegotiationStep, ProtocolError> {
        let consumed = NegotiationStep::Consumed { bytes: total };
        if !data.is_empty() {
            option_error(
                out,
                OPT_STARTTLS,
                REP_ERR_INVALID,
                "NBD_OPT_STARTTLS takes no data",
            );
            return Ok(consumed);
        }
        if self.tls == TlsPolicy::Off {
            option_error(
                out,
                OPT_STARTTLS,
                REP_ERR_POLICY,
                "TLS is not offered by this server",
            );
            return Ok(consumed);
        }
        if self.tls_active {
            option_error(out, OPT_STARTTLS, REP_ERR_INVALID, "TLS is already active");
            return Ok(consumed);
        }
        if bytes_after > 0 {
            // The client must wait for the ACK; bytes already here were
            // sent in clear text and must not be taken as if they came
            // through TLS.
            self.state = State::Done;
            return Err(ProtocolError::DataAfterStartTls { bytes: bytes_after });
        }
        option_reply(out, OPT_STARTTLS, REP_ACK, &[]);
        self.state = State::AwaitingTls;
        Ok(NegotiationStep::StartTls { bytes: total })
    }

    fn export_name(
        &mut self,
        name: &[u8],
        total: usize,
        out: &mut Vec<u8>,
    ) -> Result<NegotiationStep, ProtocolError> {
        // EXPORT_NAME cannot return an error: every failure ends the session.
        self.state = State::Done;
        if self.mode == ReplyMode::Extended {
            return Err(ProtocolError::ExportNameAfterExtendedHeaders);
        }
        let Some(export) = self.catalog.lookup(name) else {
            return Err(ProtocolError::UnknownExport {
                name: printable(name),
            });
        };
        let session = self.session(&export, false);
        put_u64(out, session.size_bytes);
        put_u16(out, session.transmission_flags);
        if !self.no_zeroes {
            out.extend_from_slice(&[0u8; EXPORT_NAME_PADDING_BYTES]);
        }
        Ok(NegotiationStep::Transmission {
            bytes: total,
            session,
        })
    }

    fn info_or_go(
        &mut self,
        option: u32,
        data: &[u8],
        total: usize,
        out: &mut Vec<u8>,
    ) -> Result<NegotiationStep, ProtocolError> {
        let consumed = NegotiationStep::Consumed { bytes: total };
        let request = match parse_info_request(data, self.limits.max_name_bytes) {
            Ok(request) => request,
            Err(refusal) => {
                refusal.send(out, option);
                return Ok(consumed);
            }
        };
        let Some(export) = self.catalog.lookup(request.name) else {
            let message = format!("unknown export {:?}", printable(request.name));
            option_error(out, option, REP_ERR_UNKNOWN, &message);
            return Ok(consumed);
        };

        let session = self.session(&export, request.want_block_size);
        let mut payload = Vec::with_capacity(16);
        let mut info_reply = |info: Info<'_>| {
            payload.clear();
            info.encode(&mut payload);
            option_reply(out, option, REP_INFO, &payload);
        };
        info_reply(Info::Export {
            size_bytes: session.size_bytes,
            transmission_flags: session.transmission_flags,
        });
        // Always describe the block sizes: a client that did not ask still
        // benefits from knowing them.
        info_reply(Info::BlockSize(export.block_sizes));
        if request.want_name {
            info_reply(Info::Name(export.name.as_bytes()));
        }
        if let (true, Some(description)) = (request.want_description, &export.description) {
            let text = wire::truncate_utf8(description, MAX_STRING_BYTES);
            info_reply(Info::Description(text.as_bytes()));
        }
        option_reply(out, option, REP_ACK, &[]);

        if option == OPT_GO {
            self.state = State::Done;
            Ok(NegotiationStep::Transmission {
                bytes: total,
                session,
            })
        } else {
            Ok(consumed)
        }
    }

    fn meta_context(&mut self, option: u32, data: &[u8], out: &mut Vec<u8>) {
        let set = option == OPT_SET_META_CONTEXT;
        if set {
            // SET replaces the earlier selection, even when it fails.
            self.base_allocation_for = None;
        }
        if self.mode == ReplyMode::Simple {
            option_error(
                out,
                option,
                REP_ERR_INVALID,
                "negotiate structured replies or extended headers first",
            );
            return;
        }
        let max_name = self.limits.max_name_bytes as usize;
        let MetaRequest {
            name,
            n_queries,
            matched,
        } = match parse_meta_request(data, set, max_name) {
            Ok(request) => request,
            Err(refusal) => return refusal.send(out, option),
        };
        let Some(export) = self.catalog.lookup(name) else {
            let message = format!("unknown export {:?}", printable(name));
            option_error(out, option, REP_ERR_UNKNOWN, &message);
            return;
        };
        // LIST with no queries lists everything; SET with none selects nothing.
        let selected = matched || (!set && n_queries == 0);
        if selected {
            let mut payload = Vec::with_capacity(4 + BASE_ALLOCATION.len());
            put_u32(&mut payload, if set { BASE_ALLOCATION_ID } else { 0 });
            payload.extend_from_slice(BASE_ALLOCATION.as_bytes());
            option_reply(out, option, REP_META_CONTEXT, &payload);
            if set {
                self.base_allocation_for = Some(export.id);
            }
        }
        option_reply(out, option, REP_ACK, &[]);
    }

    /// What transmission of `export` looks like, given what was agreed.
    fn session(&self, export: &ExportInfo, block_sizes_agreed: bool) -> Session {
        Session {
            size_bytes: export.size_bytes,
            transmission_flags: transmission_flags(export, self.mode),
            mode: self.mode,
            // The client must have asked for the context of the export it
            // goes to (the spec: the same name, as GO's, in the last SET).
            base_allocation: self.base_allocation_for == Some(export.id),
            block_sizes_agreed,
            block_sizes: export.block_sizes,
            read_only: export.read_only,
            tls: self.tls_active,
            export_id: export.id,
            export_name: export.name.clone(),
        }
    }
}

/// An option refused with an error reply (negotiation goes on).
struct Refusal {
    reply_type: u32,
    message: &'static str,
}

impl Refusal {
    fn send(&self, out: &mut Vec<u8>, option: u32) {
        option_error(out, option, self.reply_type, self.message);
    }
}

fn refuse(reply_type: u32, message: &'static str) -> Refusal {
    Refusal {
        reply_type,
        message,
    }
}

/// The data of NBD_OPT_INFO / NBD_OPT_GO.
struct InfoRequest<'a> {
    name: &'a [u8],
    want_name: bool,
    want_description: bool,
    want_block_size: bool,
}

fn parse_info_request(data: &[u8], max_name_bytes: u32) -> Result<InfoRequest<'_>, Refusal> {
    let mut r = Reader::new(data);
    let name_len = r.u32().ok_or(refuse(
        REP_ERR_INVALID,
        "option data too short for a name length",
    ))?;
    if name_len > max_name_bytes {
        return Err(refuse(REP_ERR_TOO_BIG, "export name too long"));
    }
    let name = r.take(name_len as usize).ok_or(refuse(
        REP_ERR_INVALID,
        "export name longer than the option data",
    ))?;
    let n_requests = r
        .u16()
        .ok_or(refuse(REP_ERR_INVALID, "missing information request count"))?;
    if r.remaining() != 2 * n_requests as usize {
        return Err(refuse(
            REP_ERR_INVALID,
            "information request count does not match the option length",
        ));
    }
    let mut request = InfoRequest {
        name,
        want_name: false,
        want_description: false,
        want_block_size: false,
    };
    for _ in 0..n_requests {
        match r.u16() {
            Some(INFO_NAME) => request.want_name = true,
            Some(INFO_DESCRIPTION) => request.want_description = true,
            Some(INFO_BLOCK_SIZE) => request.want_block_size = true,
            // INFO_EXPORT is always sent; unknown requests are ignored.
            _ => {}
        }
    }
    Ok(request)
}

/// The data of NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT.
struct MetaRequest<'a> {
    name: &'a [u8],
    n_queries: u32,
    /// A query named `base:allocation` (or, for LIST, `base:`).
    matched: bool,
}

fn parse_meta_request(data: &[u8], set: bool, max_name: usize) -> Result<MetaRequest<'_>, Refusal> {
    let mut r = Reader::new(data);
    let name_len = r.u32().ok_or(refuse(
        REP_ERR_INVALID,
        "option data too short for a name length",
    ))?;
    if name_len as usize > max_name {
        return Err(refuse(REP_ERR_TOO_BIG, "export name too long"));
    }
    let name = r.take(name_len as usize).ok_or(refuse(
        REP_ERR_INVALID,
        "export name longer than the option data",
    ))?;
    let n_queries = r
        .u32()
        .ok_or(refuse(REP_ERR_INVALID, "missing query count"))?;
    // The claimed count is never used to size anything: each query must
    // carry at least its 4-byte length, so the loop is bounded by the
    // (already limited) option length.
    let mut matched = false;
    for _ in 0..n_queries {
        let query_len = r.u32().ok_or(refuse(
            REP_ERR_INVALID,
            "query count exceeds the option data",
        ))?;
        if query_len as usize > max_name {
            return Err(refuse(REP_ERR_TOO_BIG, "metadata query too long"));
        }
        let query = r
            .take(query_len as usize)
            .ok_or(refuse(REP_ERR_INVALID, "query longer than the option data"))?;
        let hit = if set {
            query == BASE_ALLOCATION.as_bytes()
        } else {
            query == BASE_ALLOCATION.as_bytes() || query == b"base:"
        };
        matched |= hit;
    }
    if r.remaining() != 0 {
        return Err(refuse(REP_ERR_INVALID, "trailing bytes after the queries"));
    }
    Ok(MetaRequest {
        name,
        n_queries,
        matched,
    })
}

fn option_error(out: &mut Vec<u8>, option: u32, reply_type: u32, message: &str) {
    tracing::debug!(
        option = option_name(option),
        reply_type,
        message,
        "option refused"
    );
    option_reply(out, option, reply_type, message.as_bytes());
}
