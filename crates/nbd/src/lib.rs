//! cairn's NBD server.
//!
//! - [`codec`] and [`proto`]: the protocol as a pure codec (no I/O) and its
//!   wire constants. They live in `cairn-nbd-proto`, shared with the NBD
//!   client device, and are re-exported here under their old paths.
//! - [`server`]: the connection loop: one reader thread per connection, a
//!   small worker pool shared by all connections, replies written under a
//!   per-connection lock.
//! - [`Export`]: the trait the engine implements. This crate never depends
//!   on the engine; [`MemExport`] is an in-memory implementation for tests
//!   and examples.
//! - [`Exports`]: several named exports on one server ([`serve_exports`]),
//!   added and removed while it runs.
//!
//! ```no_run
//! use std::sync::Arc;
//! use cairn_nbd::{serve, Listener, MemExport, ServerConfig};
//!
//! let export = Arc::new(MemExport::new(64 << 20));
//! let listener = Listener::bind_unix("/tmp/cairn.sock")?;
//! let handle = serve(export, listener, ServerConfig::default())?;
//! // ... clients connect to nbd+unix:///?socket=/tmp/cairn.sock ...
//! handle.shutdown()?;
//! # Ok::<(), cairn_nbd::ServerError>(())
//! ```

mod export;
pub mod server;

pub use cairn_nbd_proto::{codec, proto};

pub use export::{
    Export, ExportError, ExportFuture, Extent, ExtentKind, MemCounters, MemExport, MemOp,
    ReadBuffer, MEM_CHUNK_BYTES,
};
pub use server::{
    serve, serve_exports, ExportOptions, ExportStatus, Exports, ExportsError, Listener,
    RemovedExport, ServerConfig, ServerError, ServerHandle, ServerStats, ShutdownTrigger,
    SocketAccess, StatsReader, DEFAULT_MAX_IN_FLIGHT_PER_CONNECTION,
};
