//! cairn's event loop.
//!
//! A [`Reactor`] is one thread's io_uring plus a small single-threaded
//! executor: a request waiting for I/O is a suspended task (a future), not
//! a blocked thread. Ring operations ([`Reactor::read_at`], `write_at`,
//! `writev_at`, `fsync`, `poll`, `sleep`) are submitted together when the
//! loop next enters the kernel, and that same `io_uring_enter` waits for
//! completions: one system call per loop turn for any number of
//! operations. Nothing spins: an idle loop sleeps in the kernel until a
//! completion or a wake-up from another thread arrives.
//!
//! Other threads (an NBD origin's reply reader, a group commit's leader)
//! complete work for a task through a [`oneshot`] channel or a waker; a
//! wake-up from another thread writes the reactor's eventfd, whose read is
//! always pending in the ring.
//!
//! Code that may run with or without a reactor (the engine's I/O paths)
//! asks [`Reactor::current`]: inside a reactor task it submits to the ring,
//! elsewhere (tests, offline commands, background threads, and inside
//! [`block_on`]) it does the I/O synchronously. So the engine has one
//! async algorithm that also runs deterministically in simulation.

mod backend;
mod block_on;
mod buf;
mod deadline;
mod huge_pages;
mod join;
mod notify;
mod offload;
pub mod oneshot;
mod prefetch;
mod reactor;
mod recv_now;
mod semaphore;
mod send_now;

pub use backend::{IoBackend, IO_BACKEND_ENV};
pub use block_on::block_on;
pub use buf::{StableBuf, StableBufMut, StableBufs};
pub use deadline::Deadline;
pub use huge_pages::{HugeTable, ZeroIsValid};
pub use join::{first_of, join_all, Either, FirstOf, JoinAll};
pub use notify::LocalNotify;
pub use offload::offload;
pub use prefetch::prefetch;
pub use reactor::{JoinHandle, Reactor, ReactorOptions, RemoteWaker};
pub use recv_now::recv_now;
pub use semaphore::Semaphore;
pub use send_now::send_now;
