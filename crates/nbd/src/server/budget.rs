//! The byte budget shared by every connection: a reader takes what a
//! request's buffers need before starting it, the request gives it back
//! with its reply. A reader at the limit waits as a task.

pub(crate) type ByteBudget = cairn_io::Semaphore;
