//! An origin that can hold one operation inside the device until the test
//! lets it go (see [`Gate`]), so a race or a slow origin happens every
//! time, not by luck.

use cairn_device::{Device, DeviceResult, SimDevice};

use super::gate::Gate;

/// Which operation the gate holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// A read, after it read its data (the data it returns is then as old
    /// as the read's start).
    ReadAfter,
    /// A read, before it reads (the data is then as new as the release).
    ReadBefore,
    /// A write, before it writes: a slow origin.
    Write,
}

pub struct GatedOrigin {
    pub inner: SimDevice,
    pub gate: Gate,
    pub hold: Hold,
}

impl GatedOrigin {
    pub fn new(inner: SimDevice, hold: Hold) -> GatedOrigin {
        GatedOrigin {
            inner,
            gate: Gate::default(),
            hold,
        }
    }
}

impl Device for GatedOrigin {
    fn name(&self) -> &str {
        "gated-origin"
    }

    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    fn identity(&self) -> String {
        self.inner.identity()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> DeviceResult<()> {
        if self.hold == Hold::ReadBefore {
            self.gate.pass(offset, buf.len() as u64);
        }
        self.inner.read_at(offset, buf)?;
        if self.hold == Hold::ReadAfter {
            self.gate.pass(offset, buf.len() as u64);
        }
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> DeviceResult<()> {
        if self.hold == Hold::Write {
            self.gate.pass(offset, buf.len() as u64);
        }
        self.inner.write_at(offset, buf)
    }

    fn flush(&self) -> DeviceResult<()> {
        self.inner.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> DeviceResult<()> {
        self.inner.discard(offset, len)
    }
}
