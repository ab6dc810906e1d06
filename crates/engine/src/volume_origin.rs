//! One volume's origin, as the engine reaches it: the device and the
//! volume's size. A block of the volume is named by its key
//! (`cairn_format::block_key`); its place on the origin is the key's
//! address.

use std::sync::Arc;

use cairn_device::Device;

pub(crate) struct VolumeOrigin {
    /// The volume's id (its entry in the volume table).
    pub(crate) id: u16,
    pub(crate) device: Arc<dyn Device>,
    /// The volume's size in blocks (its origin's, as recorded).
    pub(crate) blocks: u64,
}

impl VolumeOrigin {
    pub(crate) fn new(id: u16, device: Arc<dyn Device>, blocks: u64) -> VolumeOrigin {
        VolumeOrigin { id, device, blocks }
    }

    pub(crate) fn device(&self) -> &dyn Device {
        self.device.as_ref()
    }
}
