//! A Ceph RBD image as a device, so the origin can be distributed storage.
//!
//! Spec: `rbd:POOL/[NAMESPACE/]IMAGE[?conf=PATH&id=CLIENT&keyring=PATH]` ([`spec`]).
//! The cluster's configuration is the `conf` file, else librados' search
//! (`$CEPH_CONF`, `/etc/ceph/ceph.conf`); `CEPH_ARGS` is honoured too, after
//! the file, so `CEPH_ARGS="--rados_osd_op_timeout 5"` shortens the default
//! 30 s after which a request to a silent OSD fails.
//!
//! librbd is loaded at run time ([`library`]); a machine without
//! `librbd1` gets a clear error naming the package, and every other origin
//! works as before.
//!
//! I/O: librbd's asynchronous calls ([`completion`]). A reactor task's
//! read submits `rbd_aio_read` and sleeps until librbd's callback wakes
//! it, so the engine's origin queue depth is the number of reads in
//! flight; a batch call submits every piece, then waits for all of them.
//! Identity: the spec, then `#ID`, the image's id, which a deleted and
//! recreated image does not keep; the spec part reopens the image. Exclusivity: the image's exclusive lock
//! is taken at open ([`handles`]) and held until close, so two caches
//! never write back to one image at once; a second is refused naming the
//! holder. The lock passes to another client once a crashed holder's watch
//! times out, so a cache also claims the image in its metadata from format
//! until its volume is removed ([`claim`]), and refuses one another cache
//! claimed. A resize by another client, which librbd carries out even
//! against the lock, is noticed through a header watch ([`update_watch`]);
//! a shrunk image takes no writes ([`size_check`]).

mod blocklisted;
mod claim;
mod closing;
mod completion;
mod device;
mod handles;
mod library;
mod size_check;
mod spec;
mod update_watch;

pub use device::RbdDevice;
pub use spec::RbdSpec;
