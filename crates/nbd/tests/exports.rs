//! Several exports on one server (issue 16): each selected by its name,
//! listed with its description, added and removed while clients are
//! connected to the others. Real clients (nbdinfo, nbdsh through
//! python3-libnbd, qemu-io) where they can show it, the test client of
//! `common` for what they cannot (raw options, the connection's end).
//!
//! A missing tool skips its test with a message, except with CI=true where
//! it fails.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use cairn_nbd::proto::*;
use cairn_nbd::{
    Export, ExportError, ExportOptions, ExportStatus, Exports, ExportsError, Extent, MemExport,
    ServerConfig,
};
use common::*;

const MIB: u64 = 1 << 20;

/// The three exports of most tests: the default one (named ""), a
/// read-only one and a plain one, of different sizes, each with a
/// description but the last.
struct Three {
    server: TestServer,
    default: Arc<MemExport>,
    alpha: Arc<MemExport>,
    beta: Arc<MemExport>,
}

impl Three {
    fn start() -> Three {
        let default = Arc::new(MemExport::new(MIB));
        let alpha = Arc::new(MemExport::new(2 * MIB));
        let beta = Arc::new(MemExport::new(3 * MIB));
        let exports = Exports::new();
        let described = |text: &str| ExportOptions {
            description: Some(text.to_string()),
            read_only: false,
        };
        exports
            .add("", default.clone(), described("the default volume"))
            .unwrap();
        exports
            .add("alpha", alpha.clone(), described("Alpha volume"))
            .unwrap();
        exports
            .add("beta", beta.clone(), ExportOptions::default())
            .unwrap();
        let server = TestServer::start_exports(exports, ServerConfig::default());
        Three {
            server,
            default,
            alpha,
            beta,
        }
    }

    fn socket(&self) -> &Path {
        &self.server.socket
    }
}

/// [`run_tool`] that must succeed; its stdout.
fn run_ok(program: &str, args: &[&str], timeout_s: u32) -> String {
    let out = run_tool(program, args, &[], timeout_s);
    assert!(
        out.status.success(),
        "{program} {args:?} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn read_back(export: &dyn Export, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    export.read(offset, &mut buf).unwrap();
    buf
}

fn status(exports: &Exports, name: &str) -> ExportStatus {
    exports
        .get(name)
        .unwrap_or_else(|| panic!("no export {name:?}"))
}

/// A client in transmission with the export `name`.
fn open_export(socket: &Path, name: &str) -> Client {
    let mut c = Client::connect(socket).unwrap();
    c.negotiate_export(Mode::Structured, false, name).unwrap();
    c
}

// --------------------------------------------------------- listing ---

#[test]
fn nbdinfo_list_shows_every_export_with_its_description_and_size() {
    if !require_tool("nbdinfo") {
        return;
    }
    let three = Three::start();
    let out = run_ok("nbdinfo", &["--list", "--json", &three.server.uri()], 60);
    let json: serde_json::Value = serde_json::from_str(&out).expect("nbdinfo --json parses");
    let exports = json["exports"].as_array().expect("an exports array");
    let rows: Vec<(String, String, u64, bool)> = exports
        .iter()
        .map(|e| {
            (
                e["export-name"].as_str().unwrap_or("?").to_string(),
                e["description"].as_str().unwrap_or("").to_string(),
                e["export-size"].as_u64().unwrap_or(0),
                e["is_read_only"].as_bool().unwrap_or(true),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("".into(), "the default volume".into(), MIB, false),
            ("alpha".into(), "Alpha volume".into(), 2 * MIB, false),
            ("beta".into(), "".into(), 3 * MIB, false),
        ],
        "{out}"
    );
}

#[test]
fn list_option_answers_one_server_reply_per_export() {
    let three = Three::start();
    let mut c = Client::connect(three.socket()).unwrap();
    let replies = c.option(OPT_LIST, &[]).unwrap();
    let listed: Vec<(String, String)> = replies
        .iter()
        .filter(|r| r.reply_type == REP_SERVER)
        .map(|r| {
            let len = u32::from_be_bytes(r.data[0..4].try_into().unwrap()) as usize;
            (
                String::from_utf8_lossy(&r.data[4..4 + len]).into_owned(),
                String::from_utf8_lossy(&r.data[4 + len..]).into_owned(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [
            ("".into(), "the default volume".into()),
            ("alpha".into(), "Alpha volume".into()),
            ("beta".into(), "".into()),
        ]
    );
    assert_eq!(replies.last().unwrap().reply_type, REP_ACK);
}

// ------------------------------------------------------- selecting ---

#[test]
fn nbdinfo_sees_each_export_by_its_name() {
    if !require_tool("nbdinfo") {
        return;
    }
    let three = Three::start();
    for (name, size) in [("", MIB), ("alpha", 2 * MIB), ("beta", 3 * MIB)] {
        let out = run_ok("nbdinfo", &["--json", &three.server.uri_for(name)], 60);
        let json: serde_json::Value = serde_json::from_str(&out).expect("nbdinfo --json parses");
        let e = &json["exports"][0];
        assert_eq!(e["export-size"], size, "{name:?}: {out}");
        assert_eq!(e["can_multi_conn"], true, "{name:?}: {out}");
    }
}

#[test]
fn nbdsh_writes_through_one_export_and_leaves_the_others_alone() {
    if !require_python_nbd() {
        return;
    }
    let three = Three::start();
    let script = format!(
        r#"
import nbd
def conn(name):
    h = nbd.NBD()
    h.set_export_name(name)
    h.set_full_info(True)
    h.connect_unix("{socket}")
    return h
d, a, b = conn(""), conn("alpha"), conn("beta")
assert (d.get_size(), a.get_size(), b.get_size()) == ({mib}, 2 * {mib}, 3 * {mib})
# INFO_NAME and INFO_DESCRIPTION, asked for by full info.
assert a.get_canonical_export_name() == "alpha"
assert a.get_export_description() == "Alpha volume"
assert d.get_export_description() == "the default volume"
try:
    b.get_export_description()
    raise SystemExit("beta has no description, yet one came")
except nbd.Error:
    pass
pattern = bytes((i * 13) % 251 for i in range(65536))
a.pwrite(pattern, 4096)
a.flush()
assert a.pread(65536, 4096) == pattern
# A second connection to the same export sees it (multi-conn, per export).
a2 = conn("alpha")
assert a2.pread(65536, 4096) == pattern
for other in (d, b):
    assert other.pread(65536, 4096) == bytes(65536)
b.pwrite(b"\x5b" * 4096, 3 * {mib} - 4096, nbd.CMD_FLAG_FUA)
assert b.pread(4096, 3 * {mib} - 4096) == b"\x5b" * 4096
try:
    d.pread(4096, {mib})
    raise SystemExit("read past the end of the default export succeeded")
except nbd.Error:
    pass
for h in (d, a, a2, b):
    h.shutdown()
print("NBDSH-OK")
"#,
        socket = three.socket().display(),
        mib = MIB
    );
    let out = run_ok("nbdsh", &["-c", &script], 120);
    assert!(out.contains("NBDSH-OK"), "{out}");
    let pattern: Vec<u8> = (0..65536u32).map(|i| ((i * 13) % 251) as u8).collect();
    assert_eq!(read_back(&*three.alpha, 4096, 65536), pattern);
    assert_eq!(read_back(&*three.default, 4096, 65536), vec![0u8; 65536]);
    assert_eq!(read_back(&*three.beta, 4096, 65536), vec![0u8; 65536]);
    assert_eq!(
        read_back(&*three.beta, 3 * MIB - 4096, 4096),
        vec![0x5b; 4096]
    );
    // FLUSH and FUA reached the export of their connection only.
    assert!(three.alpha.counters.flushes.load(Ordering::SeqCst) >= 1);
    assert_eq!(three.beta.counters.flushes.load(Ordering::SeqCst), 0);
    assert_eq!(three.beta.counters.fua_writes.load(Ordering::SeqCst), 1);
    assert_eq!(three.default.counters.writes.load(Ordering::SeqCst), 0);
}

#[test]
fn qemu_io_writes_and_reads_a_named_export() {
    if !require_tool("qemu-io") {
        return;
    }
    let three = Three::start();
    let uri = three.server.uri_for("beta");
    run_ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            &uri,
            "-c",
            "write -P 0x3c 1M 64k",
            "-c",
            "read -P 0x3c 1M 64k",
            "-c",
            "flush",
        ],
        60,
    );
    assert_eq!(read_back(&*three.beta, MIB, 65536), vec![0x3c; 65536]);
    assert_eq!(read_back(&*three.alpha, MIB, 65536), vec![0u8; 65536]);
    assert!(three.beta.counters.flushes.load(Ordering::SeqCst) >= 1);
    assert_eq!(three.alpha.counters.flushes.load(Ordering::SeqCst), 0);
}

#[test]
fn flush_on_a_connection_flushes_its_own_export() {
    let three = Three::start();
    let mut a = open_export(three.socket(), "alpha");
    let mut b = open_export(three.socket(), "beta");
    assert_eq!((a.size_bytes, b.size_bytes), (2 * MIB, 3 * MIB));
    assert_eq!(a.write(0, &[1u8; 4096]).unwrap(), 0);
    assert_eq!(a.call(0, CMD_FLUSH, 0, 0, &[]).unwrap().error, 0);
    assert_eq!(three.alpha.counters.flushes.load(Ordering::SeqCst), 1);
    assert_eq!(three.beta.counters.flushes.load(Ordering::SeqCst), 0);
    assert_eq!(b.call(0, CMD_FLUSH, 0, 0, &[]).unwrap().error, 0);
    assert_eq!(three.beta.counters.flushes.load(Ordering::SeqCst), 1);
    assert_eq!(three.default.counters.flushes.load(Ordering::SeqCst), 0);
    // Each connection's bounds are its export's: alpha ends at 2 MiB.
    assert_eq!(a.read(2 * MIB, 4096).unwrap(), Err(NBD_EINVAL));
    assert_eq!(b.read(2 * MIB, 4096).unwrap(), Ok(vec![0u8; 4096]));
    a.disconnect().unwrap();
    b.disconnect().unwrap();
}

#[test]
fn unknown_name_is_refused_by_go_and_ends_export_name() {
    let three = Three::start();
    let mut c = Client::connect(three.socket()).unwrap();
    for option in [OPT_INFO, OPT_GO] {
        let replies = c
            .option(option, &info_data("gamma", &[INFO_BLOCK_SIZE]))
            .unwrap();
        assert_eq!(replies.len(), 1, "{replies:?}");
        assert_eq!(replies[0].reply_type, REP_ERR_UNKNOWN);
        assert!(String::from_utf8_lossy(&replies[0].data).contains("gamma"));
    }
    // The negotiation goes on: GO to a name that exists.
    c.negotiate_export(Mode::Simple, false, "beta").unwrap();
    assert_eq!(c.size_bytes, 3 * MIB);
    c.disconnect().unwrap();

    // EXPORT_NAME cannot answer an error: the server hangs up.
    let mut c = Client::connect(three.socket()).unwrap();
    c.send_raw(&option(OPT_EXPORT_NAME, b"gamma")).unwrap();
    assert!(closed_by_server(&mut c.stream));
    // While a name that exists gets its size and flags.
    let mut c = Client::connect(three.socket()).unwrap();
    c.send_raw(&option(OPT_EXPORT_NAME, b"alpha")).unwrap();
    let mut reply = [0u8; 10];
    std::io::Read::read_exact(&mut c.stream, &mut reply).unwrap();
    assert_eq!(u64::from_be_bytes(reply[0..8].try_into().unwrap()), 2 * MIB);
}

#[test]
fn nbdinfo_is_refused_an_unknown_name() {
    if !require_tool("nbdinfo") {
        return;
    }
    let three = Three::start();
    let out = run_tool("nbdinfo", &[&three.server.uri_for("gamma")], &[], 60);
    assert!(!out.status.success(), "nbdinfo reached an unknown export");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("gamma") || stderr.contains("unknown"),
        "{stderr}"
    );
}

#[test]
fn without_an_export_named_empty_the_empty_name_is_unknown() {
    let exports = Exports::new();
    for name in ["a", "b"] {
        exports
            .add(
                name,
                Arc::new(MemExport::new(MIB)),
                ExportOptions::default(),
            )
            .unwrap();
    }
    let server = TestServer::start_exports(exports, ServerConfig::default());
    let mut c = Client::connect(&server.socket).unwrap();
    let replies = c.option(OPT_GO, &info_data("", &[])).unwrap();
    assert_eq!(replies.last().unwrap().reply_type, REP_ERR_UNKNOWN);
    let mut c = Client::connect(&server.socket).unwrap();
    c.send_raw(&option(OPT_EXPORT_NAME, b"")).unwrap();
    assert!(closed_by_server(&mut c.stream));

    // Naming a default makes the empty name select it.
    server.exports().set_default(Some("b"));
    let mut c = Client::connect(&server.socket).unwrap();
    let replies = c.option(OPT_INFO, &info_data("", &[INFO_NAME])).unwrap();
    let name = replies
        .iter()
        .find(|r| r.reply_type == REP_INFO && r.data[0..2] == INFO_NAME.to_be_bytes())
        .expect("INFO_NAME");
    assert_eq!(&name.data[2..], b"b");
}

#[test]
fn per_export_read_only() {
    let exports = Exports::new();
    let rw = Arc::new(MemExport::new(MIB));
    let ro = Arc::new(MemExport::new(MIB));
    exports
        .add("rw", rw.clone(), ExportOptions::default())
        .unwrap();
    let options = ExportOptions {
        description: None,
        read_only: true,
    };
    exports.add("ro", ro.clone(), options).unwrap();
    let server = TestServer::start_exports(exports, ServerConfig::default());
    let mut w = open_export(&server.socket, "rw");
    let mut r = open_export(&server.socket, "ro");
    assert_eq!(w.transmission_flags & FLAG_READ_ONLY, 0);
    assert_ne!(r.transmission_flags & FLAG_READ_ONLY, 0);
    assert_eq!(w.write(0, &[7u8; 512]).unwrap(), 0);
    assert_eq!(r.write(0, &[7u8; 512]).unwrap(), NBD_EPERM);
    assert_eq!(ro.counters.writes.load(Ordering::SeqCst), 0);
    assert!(server.exports().get("ro").unwrap().read_only);
}

// --------------------------------------------------- adding, removing ---

#[test]
fn an_export_added_while_a_client_is_connected_to_another() {
    let three = Three::start();
    let mut a = open_export(three.socket(), "alpha");
    assert_eq!(a.write(0, &[9u8; 4096]).unwrap(), 0);

    let gamma = Arc::new(MemExport::new(4 * MIB));
    let options = ExportOptions {
        description: Some("added later".to_string()),
        read_only: false,
    };
    three
        .server
        .exports()
        .add("gamma", gamma.clone(), options)
        .unwrap();
    let mut g = open_export(three.socket(), "gamma");
    assert_eq!(g.size_bytes, 4 * MIB);
    assert_eq!(g.write(0, &[3u8; 4096]).unwrap(), 0);
    // The first client never noticed.
    assert_eq!(a.read(0, 4096).unwrap(), Ok(vec![9u8; 4096]));
    assert_eq!(read_back(&*gamma, 0, 4096), vec![3u8; 4096]);
    assert_eq!(read_back(&*three.alpha, 0, 4096), vec![9u8; 4096]);

    let mut c = Client::connect(three.socket()).unwrap();
    let listed = c
        .option(OPT_LIST, &[])
        .unwrap()
        .iter()
        .filter(|r| r.reply_type == REP_SERVER)
        .count();
    assert_eq!(listed, 4);
    assert_eq!(
        three
            .server
            .exports()
            .add("gamma", gamma, ExportOptions::default()),
        Err(ExportsError::Exists {
            name: "gamma".to_string()
        })
    );
}

#[test]
fn connections_are_counted_per_export() {
    let three = Three::start();
    let exports = three.server.exports().clone();
    let a1 = open_export(three.socket(), "alpha");
    let a2 = open_export(three.socket(), "alpha");
    let b = open_export(three.socket(), "");
    // Still in the handshake: not counted.
    let _handshaking = Client::connect(three.socket()).unwrap();
    eventually("three established connections", || {
        exports.connections("alpha") == Some(2) && exports.connections("") == Some(1)
    });
    assert_eq!(exports.connections("beta"), Some(0));
    assert_eq!(exports.connections("gamma"), None);
    let reader = three.server.handle().stats_reader();
    let counts: Vec<(String, usize)> = reader
        .exports()
        .into_iter()
        .map(|s| (s.name, s.connections))
        .collect();
    assert_eq!(
        counts,
        [("".into(), 1), ("alpha".into(), 2), ("beta".into(), 0)]
    );
    a1.disconnect().unwrap();
    b.disconnect().unwrap();
    eventually("alpha down to one connection, the default to none", || {
        exports.connections("alpha") == Some(1) && exports.connections("") == Some(0)
    });
    drop(a2);
    eventually("no connection left", || {
        exports.connections("alpha") == Some(0)
    });
}

#[test]
fn remove_is_refused_while_connected_then_forced() {
    let three = Three::start();
    let exports = three.server.exports().clone();
    let mut b = open_export(three.socket(), "beta");
    let mut a = open_export(three.socket(), "alpha");
    assert_eq!(b.write(0, &[5u8; 4096]).unwrap(), 0);
    eventually("beta's client counted", || {
        exports.connections("beta") == Some(1)
    });

    assert_eq!(
        exports.remove("beta", false).unwrap_err(),
        ExportsError::Busy {
            name: "beta".to_string(),
            connections: 1
        }
    );
    // Refused: still served.
    assert_eq!(b.read(0, 4096).unwrap(), Ok(vec![5u8; 4096]));

    let removed = exports.remove("beta", true).unwrap();
    assert_eq!(removed.connections_closed, 1);
    assert_eq!(removed.name, "beta");
    assert_eq!(read_back(&*removed.export, 0, 4096), vec![5u8; 4096]);
    assert_eq!(exports.get("beta"), None);
    assert_eq!(exports.connections("beta"), None);
    // Its client sees the connection end: the next request gets no reply.
    let next = b
        .send(0, CMD_READ, 0, 4096, &[])
        .and_then(|_| b.reply().map(|_| ()));
    assert!(next.is_err(), "a request after the removal was answered");
    // New connections to it are refused, and the other export is untouched.
    let mut c = Client::connect(three.socket()).unwrap();
    let replies = c.option(OPT_GO, &info_data("beta", &[])).unwrap();
    assert_eq!(replies.last().unwrap().reply_type, REP_ERR_UNKNOWN);
    assert_eq!(a.write(0, &[6u8; 512]).unwrap(), 0);
    assert_eq!(exports.connections("alpha"), Some(1));
    // A removal without connections needs no force; an unknown name fails.
    assert_eq!(exports.remove("", false).unwrap().connections_closed, 0);
    assert_eq!(
        exports.remove("beta", true).unwrap_err(),
        ExportsError::NotFound {
            name: "beta".to_string()
        }
    );
    // The name can be used again.
    let again = Arc::new(MemExport::new(MIB));
    exports
        .add("beta", again, ExportOptions::default())
        .unwrap();
    let b2 = open_export(three.socket(), "beta");
    assert_eq!(b2.size_bytes, MIB);
}

#[test]
fn nbdsh_client_sees_its_export_removed_by_force() {
    if !require_python_nbd() {
        return;
    }
    let three = Three::start();
    let exports = three.server.exports().clone();
    // The client connects, says so, waits for a line, then tries a read.
    let script = format!(
        r#"
import nbd, sys
h = nbd.NBD()
h.set_export_name("beta")
h.connect_unix("{socket}")
assert h.pread(512, 0) == bytes(512)
print("CONNECTED", flush=True)
sys.stdin.readline()
try:
    h.pread(512, 0)
    print("READ-OK", flush=True)
except nbd.Error as e:
    print("READ-FAILED", e, flush=True)
"#,
        socket = three.socket().display()
    );
    let path = std::env::var("PATH").unwrap_or_default();
    let mut child = Command::new("timeout")
        .args(["-k", "5", "60", "nbdsh", "-c", &script])
        .env("PATH", format!("/usr/bin:/bin:{path}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start nbdsh");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    assert_eq!(first, "CONNECTED");
    eventually("the nbdsh client counted", || {
        exports.connections("beta") == Some(1)
    });
    assert!(matches!(
        exports.remove("beta", false),
        Err(ExportsError::Busy { connections: 1, .. })
    ));
    assert_eq!(exports.remove("beta", true).unwrap().connections_closed, 1);
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin).unwrap();
    drop(stdin);
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = child.wait().unwrap();
    assert!(status.success(), "nbdsh: {status}, {rest:?}");
    assert!(
        rest.first().is_some_and(|l| l.starts_with("READ-FAILED")),
        "{rest:?}"
    );
    // And a new client is refused it.
    if require_tool("nbdinfo") {
        let out = run_tool("nbdinfo", &[&three.server.uri_for("beta")], &[], 60);
        assert!(!out.status.success(), "nbdinfo reached a removed export");
    }
}

/// An export whose reads wait at a gate until the test opens it: a
/// request stuck in flight. Its size can be slow to tell, too.
struct Gated {
    inner: MemExport,
    gate: Mutex<(bool, usize)>,
    changed: Condvar,
    size_delay: Duration,
}

impl Gated {
    fn new(size_bytes: u64) -> Gated {
        Gated {
            inner: MemExport::new(size_bytes),
            gate: Mutex::new((false, 0)),
            changed: Condvar::new(),
            size_delay: Duration::ZERO,
        }
    }

    /// Open, but taking `delay` to tell its size (which a handshake asks
    /// between looking the export up and entering transmission).
    fn slow_to_size(size_bytes: u64, delay: Duration) -> Gated {
        let gated = Gated {
            size_delay: delay,
            ..Gated::new(size_bytes)
        };
        gated.open();
        gated
    }

    fn waiting(&self) -> usize {
        self.gate.lock().unwrap().1
    }

    fn open(&self) {
        self.gate.lock().unwrap().0 = true;
        self.changed.notify_all();
    }
}

impl Export for Gated {
    fn size_bytes(&self) -> u64 {
        std::thread::sleep(self.size_delay);
        self.inner.size_bytes()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        let mut gate = self.gate.lock().unwrap();
        gate.1 += 1;
        while !gate.0 {
            gate = self.changed.wait(gate).unwrap();
        }
        gate.1 -= 1;
        drop(gate);
        self.inner.read(offset, buf)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
        self.inner.write(offset, data, fua)
    }
    fn flush(&self) -> Result<(), ExportError> {
        self.inner.flush()
    }
    fn trim(&self, offset: u64, length: u64) -> Result<(), ExportError> {
        self.inner.trim(offset, length)
    }
    fn write_zeroes(&self, o: u64, l: u64, may_trim: bool, fast: bool) -> Result<(), ExportError> {
        self.inner.write_zeroes(o, l, may_trim, fast)
    }
    fn cache(&self, offset: u64, length: u64) -> Result<(), ExportError> {
        self.inner.cache(offset, length)
    }
    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, ExportError> {
        self.inner.block_status(offset, length)
    }
}

#[test]
fn forced_removal_waits_for_requests_in_flight() {
    let exports = Exports::new();
    let slow = Arc::new(Gated::new(MIB));
    exports
        .add("slow", slow.clone(), ExportOptions::default())
        .unwrap();
    let server = TestServer::start_exports(exports.clone(), ServerConfig::default());
    let mut c = open_export(&server.socket, "slow");
    c.send(0, CMD_READ, 0, 4096, &[]).unwrap();
    eventually("the read waits in the export", || slow.waiting() == 1);

    // The read cannot finish: the wait runs out, the export stays in the
    // set (removing) and takes no new connection.
    let err = exports
        .remove_within("slow", true, Duration::from_millis(200))
        .unwrap_err();
    assert!(
        matches!(err, ExportsError::StillConnected { connections: 1, .. }),
        "{err}"
    );
    let s = exports.get("slow").expect("still listed while removing");
    assert!(s.removing && s.connections == 1, "{s:?}");
    let mut other = Client::connect(&server.socket).unwrap();
    let replies = other.option(OPT_GO, &info_data("slow", &[])).unwrap();
    assert_eq!(replies.last().unwrap().reply_type, REP_ERR_UNKNOWN);
    let again = Arc::new(MemExport::new(MIB));
    assert!(matches!(
        exports.add("slow", again.clone(), ExportOptions::default()),
        Err(ExportsError::Removing { .. })
    ));

    // Its client saw the connection end at once; once the request is
    // done the connection's task ends and the export goes by itself.
    assert!(c.wait_closed(), "the client's connection was not closed");
    slow.open();
    eventually("the removed export gone", || exports.get("slow").is_none());
    assert_eq!(slow.waiting(), 0);
    exports
        .add("slow", again, ExportOptions::default())
        .unwrap();
}

// ------------------------------------------------- one export, as before ---

#[test]
fn one_named_export_still_answers_to_the_empty_name() {
    let export = Arc::new(MemExport::new(2 * MIB));
    let config = ServerConfig {
        export_name: "disk".to_string(),
        export_description: Some("one disk".to_string()),
        ..ServerConfig::default()
    };
    let server = TestServer::start(export.clone(), config);
    for name in ["", "disk"] {
        let mut c = Client::connect(&server.socket).unwrap();
        let replies = c.option(OPT_INFO, &info_data(name, &[INFO_NAME])).unwrap();
        let canonical = replies
            .iter()
            .find(|r| r.reply_type == REP_INFO && r.data[0..2] == INFO_NAME.to_be_bytes())
            .expect("INFO_NAME");
        assert_eq!(&canonical.data[2..], b"disk");
        c.negotiate_export(Mode::Simple, false, name).unwrap();
        assert_eq!(c.size_bytes, 2 * MIB);
    }
    let mut c = Client::connect(&server.socket).unwrap();
    let replies = c.option(OPT_LIST, &[]).unwrap();
    assert_eq!(replies.len(), 2);
    assert_eq!(&replies[0].data[4..8], b"disk");
    assert_eq!(&replies[0].data[8..], b"one disk");
    let replies = c.option(OPT_GO, &info_data("other", &[])).unwrap();
    assert_eq!(replies.last().unwrap().reply_type, REP_ERR_UNKNOWN);
    let exports = server.handle().exports();
    assert_eq!(exports.len(), 1);
    assert_eq!(status(exports, "disk").size_bytes, 2 * MIB);
}

#[test]
fn nbdinfo_list_of_the_default_single_export() {
    if !require_tool("nbdinfo") {
        return;
    }
    let (server, _export) = TestServer::mem(MIB);
    let out = run_ok("nbdinfo", &["--list", "--json", &server.uri()], 60);
    let json: serde_json::Value = serde_json::from_str(&out).expect("nbdinfo --json parses");
    let exports = json["exports"].as_array().expect("an exports array");
    assert_eq!(exports.len(), 1, "{out}");
    assert_eq!(exports[0]["export-name"], "", "{out}");
    assert_eq!(exports[0]["export-size"], MIB, "{out}");
    assert!(exports[0].get("description").is_none(), "{out}");
}

#[test]
fn shutdown_flushes_every_export() {
    let mut three = Three::start();
    three.server.shutdown();
    for export in [&three.default, &three.alpha, &three.beta] {
        assert_eq!(export.counters.flushes.load(Ordering::SeqCst), 1);
    }
}

/// Clients keep choosing an export that is removed (by force) and added
/// again, with another size and other data, as fast as possible: every
/// client that gets in is served the very export whose size it was told,
/// or sees its connection end; nothing else.
#[test]
fn clients_racing_removal_and_addition_get_the_export_they_were_told_of() {
    let exports = Exports::new();
    let server = TestServer::start_exports(exports.clone(), ServerConfig::default());
    let socket = server.socket.clone();
    // Generation g: size (g % 4 + 1) MiB, every byte of block 0 is g. It
    // takes a millisecond to tell its size, so removals land between a
    // client's GO and its start of transmission.
    let add = |g: u8| {
        let size_bytes = (g as u64 % 4 + 1) * MIB;
        let export = Arc::new(Gated::slow_to_size(size_bytes, Duration::from_millis(1)));
        export.write(0, &[g; 512], false).unwrap();
        exports
            .add("churn", export, ExportOptions::default())
            .unwrap();
    };
    add(0);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let served = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let clients: Vec<_> = (0..3)
        .map(|_| {
            let (socket, stop, served) = (socket.clone(), stop.clone(), served.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let Ok(mut c) = Client::connect(&socket) else {
                        continue;
                    };
                    let Ok(replies) = c.option(OPT_GO, &info_data("churn", &[])) else {
                        continue;
                    };
                    if replies.last().map(|r| r.reply_type) != Some(REP_ACK) {
                        continue;
                    }
                    let size = replies
                        .iter()
                        .find(|r| {
                            r.reply_type == REP_INFO && r.data[0..2] == INFO_EXPORT.to_be_bytes()
                        })
                        .map(|r| u64::from_be_bytes(r.data[2..10].try_into().unwrap()))
                        .expect("INFO_EXPORT before the ACK");
                    // The connection may end at any point; a reply that
                    // comes must be the told export's data.
                    if let Ok(Ok(data)) = c.read(0, 512) {
                        let g = data[0];
                        assert_eq!(data, vec![g; 512]);
                        assert_eq!(size, (g as u64 % 4 + 1) * MIB, "served another export");
                        served.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for g in 1..=60u8 {
        std::thread::sleep(Duration::from_millis(5));
        exports.remove("churn", true).unwrap();
        add(g);
    }
    eprintln!(
        "clients served while the export was replaced 60 times: {}",
        served.load(Ordering::SeqCst)
    );
    eventually("some clients served", || served.load(Ordering::SeqCst) > 10);
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        c.join().expect("a client thread failed");
    }
}
