//! The registry's rules, without a server: connections are socket pairs
//! whose server end is attached as a connection would attach it.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::export::MemExport;

fn mem(size_bytes: u64) -> Arc<dyn Export> {
    Arc::new(MemExport::new(size_bytes))
}

fn described(text: &str) -> ExportOptions {
    ExportOptions {
        description: Some(text.to_string()),
        read_only: false,
    }
}

/// A connection to `name`: the client's end and the hold on the export.
fn connect(exports: &Exports, name: &str) -> (UnixStream, Attachment) {
    let id = exports.resolve(name.as_bytes()).expect("offered").id;
    let (client, server) = UnixStream::pair().unwrap();
    let attachment = exports.attach(id, Stream::Unix(server)).expect("attached");
    (client, attachment)
}

fn sees_eof(client: &mut UnixStream) -> bool {
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    matches!(client.read(&mut [0u8; 16]), Ok(0))
}

#[test]
fn names_and_descriptions_are_checked() {
    let exports = Exports::new();
    let long = "x".repeat(MAX_STRING_BYTES + 1);
    let err = exports
        .add(&long, mem(4096), ExportOptions::default())
        .unwrap_err();
    assert!(matches!(err, ExportsError::InvalidName { .. }), "{err}");
    assert!(err.to_string().len() < 200, "the name is shown cut: {err}");
    let err = exports
        .add("a\0b", mem(4096), ExportOptions::default())
        .unwrap_err();
    assert!(matches!(err, ExportsError::InvalidName { .. }), "{err}");
    let err = exports
        .add(
            "ok",
            mem(4096),
            described(&"d".repeat(MAX_STRING_BYTES + 1)),
        )
        .unwrap_err();
    assert!(
        matches!(err, ExportsError::InvalidDescription { .. }),
        "{err}"
    );
    let at_limit = "n".repeat(MAX_STRING_BYTES);
    exports
        .add(&at_limit, mem(4096), ExportOptions::default())
        .unwrap();
    exports.add("", mem(4096), described("default")).unwrap();
    assert_eq!(
        exports.add("", mem(4096), ExportOptions::default()),
        Err(ExportsError::Exists {
            name: String::new()
        })
    );
    assert_eq!(exports.len(), 2);
}

#[test]
fn the_set_is_bounded() {
    let exports = Exports::new();
    for i in 0..Exports::MAX_EXPORTS {
        exports
            .add(&format!("v{i}"), mem(4096), ExportOptions::default())
            .unwrap();
    }
    assert_eq!(
        exports.add("one-more", mem(4096), ExportOptions::default()),
        Err(ExportsError::TooMany {
            max: Exports::MAX_EXPORTS
        })
    );
    exports.remove("v0", false).unwrap();
    exports
        .add("one-more", mem(4096), ExportOptions::default())
        .unwrap();
}

#[test]
fn the_empty_name_selects_the_default_export() {
    let exports = Exports::new();
    exports
        .add("a", mem(4096), ExportOptions::default())
        .unwrap();
    assert!(exports.resolve(b"").is_none(), "no export named \"\"");
    exports
        .add("", mem(8192), ExportOptions::default())
        .unwrap();
    assert_eq!(exports.resolve(b"").unwrap().name, "");
    exports.set_default(Some("a"));
    assert_eq!(exports.resolve(b"").unwrap().name, "a");
    exports.set_default(Some("missing"));
    assert!(exports.resolve(b"").is_none());
    exports.set_default(None);
    assert_eq!(exports.resolve(b"").unwrap().name, "");
    assert!(exports.resolve(b"\xff").is_none(), "not UTF-8: unknown");
    assert!(exports.resolve(b"A").is_none(), "names are exact");
}

#[test]
fn listing_is_by_name_with_connections() {
    let exports = Exports::new();
    exports.add("b", mem(8192), described("bee")).unwrap();
    let read_only = ExportOptions {
        description: None,
        read_only: true,
    };
    exports.add("a", mem(4096), read_only).unwrap();
    let (_client, _held) = connect(&exports, "b");
    let list = exports.list();
    assert_eq!(
        list,
        [
            ExportStatus {
                name: "a".into(),
                description: None,
                size_bytes: 4096,
                read_only: true,
                connections: 0,
                removing: false,
            },
            ExportStatus {
                name: "b".into(),
                description: Some("bee".into()),
                size_bytes: 8192,
                read_only: false,
                connections: 1,
                removing: false,
            },
        ]
    );
    let mut visited = Vec::new();
    exports.visit(&mut |name, description| {
        visited.push((name.to_string(), description.map(str::to_string)));
        true
    });
    assert_eq!(
        visited,
        [("a".into(), None), ("b".into(), Some("bee".into()))]
    );
}

#[test]
fn connections_are_counted_and_removal_refused_without_force() {
    let exports = Exports::new();
    exports
        .add("v", mem(4096), ExportOptions::default())
        .unwrap();
    let (_c1, held1) = connect(&exports, "v");
    let (_c2, held2) = connect(&exports, "v");
    assert_eq!(exports.connections("v"), Some(2));
    assert_eq!(
        exports.remove("v", false).unwrap_err(),
        ExportsError::Busy {
            name: "v".into(),
            connections: 2
        }
    );
    assert!(exports.export("v").is_some(), "still offered");
    drop(held1);
    assert_eq!(exports.connections("v"), Some(1));
    drop(held2);
    let removed = exports.remove("v", false).unwrap();
    assert_eq!(
        (removed.name.as_str(), removed.connections_closed),
        ("v", 0)
    );
    assert_eq!(exports.get("v"), None);
    assert_eq!(
        exports.remove("v", false).unwrap_err(),
        ExportsError::NotFound { name: "v".into() }
    );
}

#[test]
fn forced_removal_shuts_the_connections_and_waits_for_them() {
    let exports = Exports::new();
    exports
        .add("v", mem(4096), ExportOptions::default())
        .unwrap();
    exports
        .add("w", mem(4096), ExportOptions::default())
        .unwrap();
    let (mut client, held) = connect(&exports, "v");
    let (mut other, _other_held) = connect(&exports, "w");
    let id = exports.resolve(b"v").unwrap().id;
    // The connection ends a little after its socket was shut down, as a
    // connection finishing its last request would.
    let ending = std::thread::spawn(move || {
        assert!(sees_eof(&mut client), "the client's socket was not shut");
        std::thread::sleep(Duration::from_millis(50));
        drop(held);
    });
    let removed = exports.remove("v", true).unwrap();
    assert_eq!(removed.connections_closed, 1);
    ending.join().unwrap();
    assert_eq!(exports.get("v"), None);
    // No new connection to it, even one that chose it before.
    let (_c, server) = UnixStream::pair().unwrap();
    assert!(exports.attach(id, Stream::Unix(server)).is_none());
    // The other export and its connection are untouched.
    other
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    assert!(other.read(&mut [0u8; 1]).is_err(), "w's client was shut");
    assert_eq!(exports.connections("w"), Some(1));
}

#[test]
fn a_removal_that_runs_out_of_time_finishes_when_the_connection_ends() {
    let exports = Exports::new();
    exports
        .add("v", mem(4096), ExportOptions::default())
        .unwrap();
    let (mut client, held) = connect(&exports, "v");
    let err = exports
        .remove_within("v", true, Duration::from_millis(20))
        .unwrap_err();
    assert!(
        matches!(err, ExportsError::StillConnected { connections: 1, .. }),
        "{err}"
    );
    assert!(sees_eof(&mut client));
    // Removing: listed so, not offered, its name not free.
    let status = exports.get("v").unwrap();
    assert!(status.removing && status.connections == 1);
    assert!(exports.resolve(b"v").is_none());
    assert!(exports.export("v").is_none());
    let mut visited = 0;
    exports.visit(&mut |_, _| {
        visited += 1;
        true
    });
    assert_eq!(visited, 0);
    assert!(matches!(
        exports.add("v", mem(4096), ExportOptions::default()),
        Err(ExportsError::Removing { connections: 1, .. })
    ));
    // A removal asked again without force is still refused.
    assert!(matches!(
        exports.remove("v", false),
        Err(ExportsError::Busy { .. })
    ));
    drop(held);
    assert_eq!(exports.get("v"), None, "gone once its connection ended");
    exports
        .add("v", mem(4096), ExportOptions::default())
        .unwrap();
}

#[test]
fn a_session_for_a_replaced_export_is_not_attached_to_the_new_one() {
    let exports = Exports::new();
    exports
        .add("v", mem(4096), ExportOptions::default())
        .unwrap();
    let old_id = exports.resolve(b"v").unwrap().id;
    exports.remove("v", false).unwrap();
    exports
        .add("v", mem(8192), ExportOptions::default())
        .unwrap();
    let (_c, server) = UnixStream::pair().unwrap();
    assert!(
        exports.attach(old_id, Stream::Unix(server)).is_none(),
        "the client was told of the old export's size"
    );
    assert_ne!(exports.resolve(b"v").unwrap().id, old_id);
}

#[test]
fn an_unbounded_wait_is_no_deadline() {
    let exports = Exports::new();
    exports
        .add("v", mem(4096), ExportOptions::default())
        .unwrap();
    let (_client, held) = connect(&exports, "v");
    let ending = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        drop(held);
    });
    let removed = exports.remove_within("v", true, Duration::MAX).unwrap();
    assert_eq!(removed.connections_closed, 1);
    ending.join().unwrap();
}
