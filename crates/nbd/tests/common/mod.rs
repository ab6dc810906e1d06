//! Shared test helpers: a minimal NBD client, session byte builders (from
//! the codec tests of `cairn-nbd-proto`), an in-process server on a
//! temporary unix socket, and tool detection.
#![allow(dead_code)] // each test binary uses a different subset

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cairn_nbd::codec::reply::{decode_chunk_header, decode_simple_reply, ChunkHeader, SimpleReply};
use cairn_nbd::codec::wire;
use cairn_nbd::proto::*;
use cairn_nbd::{
    serve, serve_exports, Export, Exports, Listener, MemExport, ServerConfig, ServerHandle,
};

// ---------------------------------------------------------------- bytes ---

// One set of client byte builders for the codec tests and these.
#[path = "../../../nbd-proto/tests/common/mod.rs"]
mod bytes;
pub use bytes::*;

// --------------------------------------------------------------- client ---

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Simple,
    Structured,
    Extended,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reply {
    pub cookie: u64,
    pub error: u32,
    pub message: String,
    pub data: Vec<u8>,
    /// (length, flags) block status descriptors and the context id.
    pub descriptors: Vec<(u64, u64)>,
    pub context_id: Option<u32>,
    pub chunks: usize,
}

struct Pending {
    command: u16,
    offset: u64,
    length: u64,
}

/// A deliberately simple blocking client that speaks every reply format.
pub struct Client<S = UnixStream> {
    pub stream: S,
    pub mode: Mode,
    pub size_bytes: u64,
    pub transmission_flags: u16,
    pending: HashMap<u64, Pending>,
    partial: HashMap<u64, Reply>,
    next_cookie: u64,
}

impl Client<UnixStream> {
    /// Connect and do the greeting + client flags; options come next.
    pub fn connect(path: &Path) -> io::Result<Client> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(Duration::from_secs(20)))?;
        Client::over(stream)
    }

    /// Connect and negotiate straight into transmission.
    pub fn open(path: &Path, mode: Mode, meta: bool) -> io::Result<Client> {
        let mut c = Client::connect(path)?;
        c.negotiate(mode, meta)?;
        Ok(c)
    }
}

impl<S: Read + Write> Client<S> {
    /// Greeting + client flags over an already connected stream.
    pub fn over(mut stream: S) -> io::Result<Client<S>> {
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting)?;
        assert_eq!(&greeting[0..8], &NBDMAGIC.to_be_bytes());
        assert_eq!(&greeting[8..16], &IHAVEOPT.to_be_bytes());
        assert_eq!(
            u16::from_be_bytes([greeting[16], greeting[17]]),
            FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES
        );
        stream.write_all(&client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES))?;
        Ok(Client {
            stream,
            mode: Mode::Simple,
            size_bytes: 0,
            transmission_flags: 0,
            pending: HashMap::new(),
            partial: HashMap::new(),
            next_cookie: 1,
        })
    }

    /// Negotiate `mode` (and `base:allocation`), then GO to the default
    /// export (the empty name).
    pub fn negotiate(&mut self, mode: Mode, meta: bool) -> io::Result<()> {
        self.negotiate_export(mode, meta, "")
    }

    /// Negotiate `mode` (and `base:allocation`), then GO to `name`.
    pub fn negotiate_export(&mut self, mode: Mode, meta: bool, name: &str) -> io::Result<()> {
        let c = self;
        match mode {
            Mode::Simple => {}
            Mode::Structured => assert_eq!(
                c.option(OPT_STRUCTURED_REPLY, &[])?
                    .last()
                    .unwrap()
                    .reply_type,
                REP_ACK
            ),
            Mode::Extended => assert_eq!(
                c.option(OPT_EXTENDED_HEADERS, &[])?
                    .last()
                    .unwrap()
                    .reply_type,
                REP_ACK
            ),
        }
        c.mode = mode;
        if meta {
            let replies = c.option(OPT_SET_META_CONTEXT, &meta_data(name, &[BASE_ALLOCATION]))?;
            assert_eq!(replies.last().unwrap().reply_type, REP_ACK);
        }
        let replies = c.option(OPT_GO, &info_data(name, &[INFO_BLOCK_SIZE]))?;
        assert_eq!(
            replies.last().unwrap().reply_type,
            REP_ACK,
            "GO failed: {replies:?}"
        );
        for r in &replies {
            if r.reply_type == REP_INFO
                && r.data.len() == 12
                && r.data[0..2] == INFO_EXPORT.to_be_bytes()
            {
                c.size_bytes = u64::from_be_bytes(r.data[2..10].try_into().unwrap());
                c.transmission_flags = u16::from_be_bytes([r.data[10], r.data[11]]);
            }
        }
        Ok(())
    }

    pub fn send_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)
    }

    pub fn read_option_reply(&mut self) -> io::Result<OptReply> {
        let mut h = [0u8; 20];
        self.stream.read_exact(&mut h)?;
        assert_eq!(&h[0..8], &OPTION_REPLY_MAGIC.to_be_bytes());
        let option = u32::from_be_bytes(h[8..12].try_into().unwrap());
        let reply_type = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        assert!(len <= 64 * 1024, "absurd option reply length {len}");
        let mut data = vec![0u8; len as usize];
        self.stream.read_exact(&mut data)?;
        Ok(OptReply {
            option,
            reply_type,
            data,
        })
    }

    /// Send an option and collect replies up to the final one.
    pub fn option(&mut self, opt: u32, data: &[u8]) -> io::Result<Vec<OptReply>> {
        self.stream.write_all(&option(opt, data))?;
        let mut replies = Vec::new();
        loop {
            let r = self.read_option_reply()?;
            let last = r.reply_type == REP_ACK || r.reply_type & REP_FLAG_ERROR != 0;
            replies.push(r);
            if last {
                return Ok(replies);
            }
        }
    }

    fn extended(&self) -> bool {
        self.mode == Mode::Extended
    }

    /// Requests sent or registered whose reply has not been read yet.
    pub fn pending_count(&self) -> usize {
        self.pending.len()
    }

    /// Send a request (with payload for writes); returns its cookie.
    pub fn send(
        &mut self,
        flags: u16,
        command: u16,
        offset: u64,
        length: u64,
        payload: &[u8],
    ) -> io::Result<u64> {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let mut bytes = request(self.extended(), flags, command, cookie, offset, length);
        bytes.extend_from_slice(payload);
        self.pending.insert(
            cookie,
            Pending {
                command,
                offset,
                length,
            },
        );
        self.stream.write_all(&bytes)?;
        Ok(cookie)
    }

    /// Register a request sent by other means (e.g. another thread writing
    /// a pipelined batch) so its reply can be parsed.
    pub fn expect_reply(&mut self, cookie: u64, command: u16, offset: u64, length: u64) -> u64 {
        self.pending.insert(
            cookie,
            Pending {
                command,
                offset,
                length,
            },
        );
        cookie
    }

    /// The rest of a chunk header that began with `magic`, checked against
    /// the negotiated mode (and, when extended, the request offset).
    fn read_chunk_header(&mut self, magic: u32) -> io::Result<ChunkHeader> {
        let (mode, name, header_bytes) = if magic == STRUCTURED_REPLY_MAGIC {
            (
                Mode::Structured,
                "structured",
                wire::STRUCTURED_REPLY_HEADER_BYTES,
            )
        } else if magic == EXTENDED_REPLY_MAGIC {
            (
                Mode::Extended,
                "extended",
                wire::EXTENDED_REPLY_HEADER_BYTES,
            )
        } else {
            panic!("bad reply magic {magic:#x}");
        };
        assert_eq!(self.mode, mode, "{name} chunk in mode {:?}", self.mode);
        let mut header = vec![0u8; header_bytes];
        header[..4].copy_from_slice(&magic.to_be_bytes());
        self.stream.read_exact(&mut header[4..])?;
        let chunk = decode_chunk_header(&header)
            .expect("a chunk magic")
            .expect("a whole chunk header");
        if mode == Mode::Extended {
            let p = self
                .pending
                .get(&chunk.cookie)
                .expect("chunk for an unknown cookie");
            assert_eq!(
                chunk.offset, p.offset,
                "extended reply must echo the request offset"
            );
        }
        Ok(chunk)
    }

    /// Read until one whole reply is complete; replies may come in any order.
    pub fn reply(&mut self) -> io::Result<Reply> {
        loop {
            let mut magic = [0u8; 4];
            self.stream.read_exact(&mut magic)?;
            let magic = u32::from_be_bytes(magic);
            if magic == SIMPLE_REPLY_MAGIC {
                let mut header = [0u8; wire::SIMPLE_REPLY_BYTES];
                header[..4].copy_from_slice(&magic.to_be_bytes());
                self.stream.read_exact(&mut header[4..])?;
                let SimpleReply { error, cookie } =
                    decode_simple_reply(&header).expect("a simple reply magic");
                let p = self
                    .pending
                    .remove(&cookie)
                    .expect("reply for an unknown cookie");
                let mut reply = Reply {
                    cookie,
                    error,
                    chunks: 1,
                    ..Default::default()
                };
                if p.command == CMD_READ {
                    assert_eq!(
                        self.mode,
                        Mode::Simple,
                        "simple reply to READ after structured negotiation"
                    );
                    if error == 0 {
                        reply.data = vec![0u8; p.length as usize];
                        self.stream.read_exact(&mut reply.data)?;
                    }
                }
                return Ok(reply);
            }
            let ChunkHeader {
                flags,
                reply_type: kind,
                cookie,
                payload_bytes: length,
                ..
            } = self.read_chunk_header(magic)?;
            assert!(length <= 64 * 1024 * 1024, "absurd chunk length {length}");
            let mut payload = vec![0u8; length as usize];
            self.stream.read_exact(&mut payload)?;
            let p = self
                .pending
                .get(&cookie)
                .expect("chunk for an unknown cookie");
            let (p_offset, p_length) = (p.offset, p.length);
            let reply = self.partial.entry(cookie).or_insert_with(|| Reply {
                cookie,
                ..Default::default()
            });
            reply.chunks += 1;
            apply_chunk(reply, kind, length, &payload, p_offset, p_length);
            if flags & REPLY_FLAG_DONE != 0 {
                self.pending.remove(&cookie);
                return Ok(self.partial.remove(&cookie).unwrap());
            }
        }
    }

    pub fn call(
        &mut self,
        flags: u16,
        command: u16,
        offset: u64,
        length: u64,
        payload: &[u8],
    ) -> io::Result<Reply> {
        let cookie = self.send(flags, command, offset, length, payload)?;
        let r = self.reply()?;
        assert_eq!(r.cookie, cookie);
        Ok(r)
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<u32> {
        Ok(self
            .call(0, CMD_WRITE, offset, data.len() as u64, data)?
            .error)
    }

    pub fn read(&mut self, offset: u64, length: u64) -> io::Result<Result<Vec<u8>, u32>> {
        let r = self.call(0, CMD_READ, offset, length, &[])?;
        Ok(if r.error == 0 {
            Ok(r.data)
        } else {
            Err(r.error)
        })
    }

    pub fn disconnect(mut self) -> io::Result<()> {
        let bytes = request(self.extended(), 0, CMD_DISC, 0, 0, 0);
        self.stream.write_all(&bytes)
    }

    /// True once the server has closed the connection (EOF or reset).
    pub fn wait_closed(&mut self) -> bool {
        let mut buf = [0u8; 256];
        loop {
            match self.stream.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

/// Fold one structured or extended chunk of the request at
/// `[p_offset, p_offset + p_length)` into its reply.
fn apply_chunk(
    reply: &mut Reply,
    kind: u16,
    length: u64,
    payload: &[u8],
    p_offset: u64,
    p_length: u64,
) {
    match kind {
        REPLY_TYPE_NONE => assert_eq!(length, 0),
        REPLY_TYPE_OFFSET_DATA => {
            let off = u64::from_be_bytes(payload[0..8].try_into().unwrap());
            let data = &payload[8..];
            assert!(!data.is_empty());
            assert!(
                off >= p_offset && off + data.len() as u64 <= p_offset + p_length,
                "data chunk outside the request"
            );
            if reply.data.is_empty() {
                reply.data = vec![0u8; p_length as usize];
            }
            let at = (off - p_offset) as usize;
            reply.data[at..at + data.len()].copy_from_slice(data);
        }
        REPLY_TYPE_OFFSET_HOLE => {
            if reply.data.is_empty() {
                reply.data = vec![0u8; p_length as usize];
            }
        }
        REPLY_TYPE_BLOCK_STATUS => {
            reply.context_id = Some(u32::from_be_bytes(payload[0..4].try_into().unwrap()));
            assert_eq!((payload.len() - 4) % 8, 0);
            for d in payload[4..].chunks(8) {
                let len = u32::from_be_bytes(d[0..4].try_into().unwrap()) as u64;
                let fl = u32::from_be_bytes(d[4..8].try_into().unwrap()) as u64;
                reply.descriptors.push((len, fl));
            }
        }
        REPLY_TYPE_BLOCK_STATUS_EXT => {
            reply.context_id = Some(u32::from_be_bytes(payload[0..4].try_into().unwrap()));
            let count = u32::from_be_bytes(payload[4..8].try_into().unwrap()) as usize;
            assert_eq!(payload.len(), 8 + 16 * count);
            for d in payload[8..].chunks(16) {
                let len = u64::from_be_bytes(d[0..8].try_into().unwrap());
                let fl = u64::from_be_bytes(d[8..16].try_into().unwrap());
                reply.descriptors.push((len, fl));
            }
        }
        REPLY_TYPE_ERROR => {
            reply.error = u32::from_be_bytes(payload[0..4].try_into().unwrap());
            let n = u16::from_be_bytes([payload[4], payload[5]]) as usize;
            reply.message = String::from_utf8_lossy(&payload[6..6 + n]).into_owned();
            assert_ne!(reply.error, 0);
        }
        other => panic!("unexpected chunk type {other}"),
    }
}

/// Read from a raw stream until EOF; true if the server closed it.
pub fn closed_by_server(stream: &mut UnixStream) -> bool {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 1024];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

// --------------------------------------------------------------- server ---

/// A directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("cairn-nbd-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub struct TestServer {
    pub dir: TempDir,
    pub socket: PathBuf,
    pub handle: Option<ServerHandle>,
}

impl TestServer {
    pub fn start(export: Arc<dyn Export>, config: ServerConfig) -> TestServer {
        init_tracing();
        let dir = TempDir::new("srv");
        let socket = dir.path("nbd.sock");
        let listener = Listener::bind_unix(&socket).expect("bind");
        let handle = serve(export, listener, config).expect("serve");
        TestServer {
            dir,
            socket,
            handle: Some(handle),
        }
    }

    /// A server offering every export of `exports`.
    pub fn start_exports(exports: Exports, config: ServerConfig) -> TestServer {
        init_tracing();
        let dir = TempDir::new("srv");
        let socket = dir.path("nbd.sock");
        let listener = Listener::bind_unix(&socket).expect("bind");
        let handle = serve_exports(exports, listener, config).expect("serve");
        TestServer {
            dir,
            socket,
            handle: Some(handle),
        }
    }

    pub fn mem(size_bytes: u64) -> (TestServer, Arc<MemExport>) {
        let export = Arc::new(MemExport::new(size_bytes));
        (
            TestServer::start(export.clone(), ServerConfig::default()),
            export,
        )
    }

    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.socket.display())
    }

    /// The URI of the export called `name` (plain names only: no escaping).
    pub fn uri_for(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.socket.display())
    }

    pub fn exports(&self) -> &Exports {
        self.handle().exports()
    }

    pub fn handle(&self) -> &ServerHandle {
        self.handle.as_ref().unwrap()
    }

    pub fn shutdown(&mut self) {
        if let Some(h) = self.handle.take() {
            h.shutdown().expect("clean shutdown");
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// Wait (bounded) until `cond` holds.
pub fn eventually(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..500 {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("timed out waiting for: {what}");
}

// ---------------------------------------------------------------- tools ---

/// Whether an external tool is on PATH. When it is missing the test is
/// skipped with a message, except under CI=true where that is a failure.
pub fn require_tool(name: &str) -> bool {
    let found = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join(name).is_file()))
        .unwrap_or(false);
    if found {
        return true;
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{name} is required when CI=true but is not installed");
    }
    eprintln!("SKIPPED: {name} is not installed");
    false
}

/// Whether python3-libnbd is importable by the system python.
pub fn require_python_nbd() -> bool {
    if !require_tool("nbdsh") {
        return false;
    }
    let ok = std::process::Command::new("/usr/bin/python3")
        .args(["-c", "import nbd"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if ok {
        return true;
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("python3-libnbd is required when CI=true but cannot be imported");
    }
    eprintln!("SKIPPED: python3-libnbd is not importable");
    false
}

impl Client<UnixStream> {
    /// Send `count` 4 KiB reads of blocks 0.. (cookies 1000..) from another
    /// thread while this one reads the replies, as a real pipelining client
    /// does. Returns the replies in arrival order, after checking every
    /// cookie was answered exactly once.
    pub fn pipelined_reads(&mut self, count: u64) -> Vec<Reply> {
        let mut requests = Vec::new();
        for i in 0..count {
            requests.extend(request(
                self.extended(),
                0,
                CMD_READ,
                1000 + i,
                i * 4096,
                4096,
            ));
        }
        let cookies: Vec<u64> = (0..count)
            .map(|i| self.expect_reply(1000 + i, CMD_READ, i * 4096, 4096))
            .collect();
        let mut writer = self.stream.try_clone().expect("clone the client socket");
        let sender = std::thread::spawn(move || writer.write_all(&requests));
        let replies: Vec<Reply> = (0..count).map(|_| self.reply().expect("a reply")).collect();
        sender
            .join()
            .expect("sender thread")
            .expect("send requests");
        let mut answered: Vec<u64> = replies.iter().map(|r| r.cookie).collect();
        answered.sort();
        assert_eq!(answered, cookies, "every cookie answered exactly once");
        replies
    }
}

/// Run a tool under coreutils `timeout` with `env` set; its output,
/// whether it succeeded or not. nbdsh runs "python3" from PATH: the system
/// python, where python3-libnbd lives, comes first.
pub fn run_tool(
    program: &str,
    args: &[&str],
    env: &[(&str, &str)],
    timeout_s: u32,
) -> std::process::Output {
    let mut cmd = std::process::Command::new("timeout");
    cmd.envs(env.iter().copied());
    cmd.arg("-k")
        .arg("5")
        .arg(timeout_s.to_string())
        .arg(program)
        .args(args);
    let path = std::env::var("PATH").unwrap_or_default();
    cmd.env("PATH", format!("/usr/bin:/bin:{path}"));
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"))
}
