//! An NBD client device, so the origin can be a remote export.
//!
//! URIs: `nbd://host[:port]/export` (TCP, port 10809 by default) and
//! `nbd+unix:///export?socket=PATH`; with TLS required, `nbds://` and
//! `nbds+unix://` with libnbd's `tls-*` parameters ([`starttls`]).
//!
//! Protocol: fixed-newstyle handshake with `NBD_OPT_GO` (asking for the
//! server's block-size constraints), falling back to `NBD_OPT_EXPORT_NAME`
//! when the server does not know GO. The data connection uses simple replies
//! only; structured replies are never negotiated on it, so a reply is a
//! fixed 16-byte header plus, for a successful read, exactly the bytes asked
//! for.
//!
//! Concurrency: one connection, fully pipelined. Callers write their
//! requests straight to the socket (under a short writer lock) and a reader
//! thread matches each reply to its request by cookie. A batch call
//! (`read_many`, `write_many`, a long write split at the server's maximum
//! payload) sends everything before waiting, and requests from different
//! threads are in flight together, up to `max_in_flight` per connection. One
//! connection keeps ordering and FLUSH semantics simple (a FLUSH covers every
//! write already replied to, without the CAN_MULTI_CONN caveats); it is not
//! the bottleneck in front of a slow origin.
//!
//! Block status: `base:allocation` is asked on a second connection that
//! negotiates structured replies, and only of a server with
//! `NBD_FLAG_CAN_MULTI_CONN`; see [`extents`].
//!
//! Failure: every request has a deadline (`request_timeout_ms`). A request
//! that misses it fails with `TimedOut` and tears the connection down, since
//! a server that stopped answering one request is not trusted with the next.
//! When the connection is lost, the writes in flight fail (the engine
//! decides whether to retry; a sent write is ambiguous), reads in flight
//! are asked again on the next connection (a read changes nothing), and
//! the next request reconnects, retrying with
//! exponential backoff for up to `reconnect_wait_ms` (the attempt runs on a
//! thread of its own when the request is a reactor task, which waits for it
//! without stopping its loop); after that, requests
//! fail at once while the server stays down, with a reconnect attempt at
//! most every backoff period. Every such failure is a [`crate::DeviceError::Io`]
//! (errno EIO for the client).
//!
//! Misses of an event loop: read on a connection of the loop's own where
//! the server promises multi-conn consistency; see [`loop_channel`] and
//! [`loop_conn`].
//!
//! Layout: [`uri`] (parsing and the normalized form), [`transport`]
//! (sockets, connect with a deadline), [`handshake`] (negotiation),
//! [`conn`] (one pipelined connection: the writer side), [`reader`] (its
//! reader thread and the table of requests in flight), [`batch`] and
//! [`command`] (what one device call sends and collects), [`extents`]
//! (block status on its side connection), [`link`]
//! (reconnect with backoff) and [`device`] (the [`crate::Device`] impl).
//! Every frame and constant of the protocol comes from `cairn-nbd-proto`.

mod batch;
mod command;
mod conn;
mod device;
mod extents;
mod handshake;
mod link;
mod loop_channel;
mod loop_conn;
mod loop_dial;
mod loop_read_error;
mod options;
mod outgoing;
mod reader;
mod reply_slot;
mod reply_stream;
mod starttls;
mod stats;
mod transport;
mod uri;

#[cfg(test)]
mod tests;

pub use device::NbdDevice;
pub use options::NbdOptions;
pub use stats::NbdStats;
pub use uri::{NbdTransport, NbdUri};
