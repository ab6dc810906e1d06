//! Buffers aligned for direct I/O, and pools that reuse them.
//!
//! A log record is written with O_DIRECT. The io_uring backend writes
//! memory that is aligned in place, and copies anything else into a bounce
//! buffer first: with `Vec<u8>` record buffers every 256 KiB record was
//! copied once more (6.3% of the daemon's CPU in the W3 profile), and with
//! several records in flight the backend's pool kept several idle 512 KiB
//! bounce buffers (+6.6 MiB RSS in the W5 fill). [`BlockBuf`] is a fixed
//! capacity byte buffer on a page boundary, so records go down as they are;
//! the bounce buffers are `BlockBuf`s too.
//!
//! Record buffers are mapped directly (anonymous mmap), not taken from
//! malloc: they are large and live across threads, and from malloc they
//! fragmented its heap, which kept the freed memory (W5: +7.5 MiB RSS after
//! the fill on a 4 GiB cache). Unmapped, freed memory goes back at once.
//! Bounce buffers live for one call on one thread, where malloc reuses
//! memory at once and mapping would fault every buffer in afresh: they come
//! from the heap ([`Backing`]). A [`BufPool`] keeps a bounded few buffers
//! of one size for reuse so allocating stays rare, and lends them as
//! [`PooledBuf`]s that go back when dropped. The engine keeps one pool per
//! record size; the io_uring backend one per bounce size class.

mod block_buf;
mod buf_pool;
mod pooled_buf;
mod shared_buf;
mod size_class_pool;

pub use block_buf::{Backing, BlockBuf};
pub use buf_pool::BufPool;
pub use pooled_buf::PooledBuf;
pub use shared_buf::{BufSlice, SharedBuf};
pub use size_class_pool::SizeClassPool;

#[cfg(test)]
pub(crate) use block_buf::BLOCK_BUF_ALIGN_BYTES;
