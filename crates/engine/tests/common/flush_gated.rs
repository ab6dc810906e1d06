//! A simulated device whose flushes pass a [`Gate`]: armed, the next
//! flush (a cache barrier, or write-back's origin flush) waits inside the
//! device until the test releases it.

use std::sync::atomic::{AtomicUsize, Ordering};

use cairn_device::{Device, DeviceResult, SimDevice};

use super::gate::Gate;

pub struct FlushGated {
    pub inner: SimDevice,
    pub gate: Gate,
    /// Flush lanes it reports (the simulated device's, or 1 to make the
    /// engine's barriers wait for each other).
    lanes: usize,
    /// Flushes through a lane that returned, successfully or not.
    pub lane_flushes_done: AtomicUsize,
}

impl FlushGated {
    pub fn new(inner: SimDevice) -> FlushGated {
        let lanes = inner.flush_lanes();
        FlushGated::with_lanes(inner, lanes)
    }

    pub fn with_lanes(inner: SimDevice, lanes: usize) -> FlushGated {
        FlushGated {
            inner,
            gate: Gate::default(),
            lanes,
            lane_flushes_done: AtomicUsize::new(0),
        }
    }
}

impl Device for FlushGated {
    fn name(&self) -> &str {
        "flush-gated"
    }

    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> DeviceResult<()> {
        self.inner.read_at(offset, buf)
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> DeviceResult<()> {
        self.inner.write_at(offset, buf)
    }

    fn flush(&self) -> DeviceResult<()> {
        self.gate.pass(0, u64::MAX);
        self.inner.flush()
    }

    fn flush_lanes(&self) -> usize {
        self.lanes
    }

    fn flush_lane(&self, lane: usize) -> DeviceResult<()> {
        assert!(lane < self.lanes, "flush lane {lane} of {}", self.lanes);
        self.gate.pass(0, u64::MAX);
        let result = self.inner.flush_lane(lane);
        self.lane_flushes_done.fetch_add(1, Ordering::SeqCst);
        result
    }

    /// A barrier's write and flush, the flush through the gate.
    fn write_vectored_and_flush(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        self.inner.write_vectored_at(offset, bufs)?;
        self.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> DeviceResult<()> {
        self.inner.discard(offset, len)
    }
}
