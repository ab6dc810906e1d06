//! A volume's origin as an inspection of the cache knows it: the identity
//! and size its table entry records, and nothing else. Every I/O fails, so
//! an inspection that reached for the origin would fail loudly, not read
//! or write a disk it was promised not to touch.

use cairn_device::{Device, DeviceError, DeviceResult, OriginClaim};
use cairn_format::VolumeEntry;

pub(crate) struct UnopenedOrigin {
    identity: String,
    size_bytes: u64,
}

impl UnopenedOrigin {
    pub(crate) fn of(volume: &VolumeEntry) -> UnopenedOrigin {
        UnopenedOrigin {
            identity: volume.origin_identity.clone(),
            size_bytes: volume.origin_size_bytes,
        }
    }

    fn refused(&self, op: &str) -> DeviceError {
        DeviceError::Unsupported {
            device: self.identity.clone(),
            message: format!("not opened (an inspection of the cache reads the cache only): {op}"),
        }
    }
}

impl Device for UnopenedOrigin {
    fn name(&self) -> &str {
        &self.identity
    }

    fn backend(&self) -> &'static str {
        "unopened"
    }

    fn identity(&self) -> String {
        self.identity.clone()
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn claim(&self, _claim: &OriginClaim) -> DeviceResult<()> {
        Err(self.refused("claim"))
    }

    fn release_claim(&self, _cache_uuid: &str) -> DeviceResult<()> {
        Err(self.refused("release its claim"))
    }

    fn read_at(&self, _offset: u64, _buf: &mut [u8]) -> DeviceResult<()> {
        Err(self.refused("read"))
    }

    fn write_at(&self, _offset: u64, _buf: &[u8]) -> DeviceResult<()> {
        Err(self.refused("write"))
    }

    fn flush(&self) -> DeviceResult<()> {
        Err(self.refused("flush"))
    }

    fn discard(&self, _offset: u64, _len: u64) -> DeviceResult<()> {
        Err(self.refused("discard"))
    }
}
