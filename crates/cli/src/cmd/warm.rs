//! `cairn warm`: prefetch a range into the cache.

use std::path::Path;

use anyhow::Result;

use crate::admin::{AdminReply, AdminRequest};

pub fn run(cache: &Path, range: &str) -> Result<()> {
    let (offset_bytes, length_bytes) =
        crate::args::parse_range(range).map_err(anyhow::Error::msg)?;
    let request = AdminRequest::Warm {
        offset_bytes,
        length_bytes,
    };
    let mut cached = 0u64;
    super::run_request(cache, &request, |reply| {
        if let AdminReply::Warmed { cached_blocks } = reply {
            cached = cached_blocks;
        }
    })?;
    say!("warmed {range}: {cached} blocks of the range are now cached")?;
    Ok(())
}
