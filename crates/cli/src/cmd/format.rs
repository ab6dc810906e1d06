//! `cairn format`.

use std::path::PathBuf;

use anyhow::Result;
use cairn_device::OpenMode;
use cairn_engine::{Engine, FormatOptions};

use super::{open_cache, open_origin};

#[derive(clap::Args)]
pub struct FormatArgs {
    /// The fast device or file that will hold the cache.
    #[arg(long)]
    pub cache: PathBuf,
    /// The slow device, file, or NBD URI (nbd://host/export, nbd+unix:///export?socket=PATH).
    #[arg(long)]
    pub origin: String,
    /// Cache block size: a power of two from 4K to 64K (suffix K allowed).
    #[arg(long = "block-size", value_name = "BLOCK_SIZE", default_value = "4K", value_parser = crate::args::parse_block_size)]
    pub block_size_bytes: u32,
    /// Overwrite a cache that is already formatted.
    #[arg(long)]
    pub force: bool,
    /// The volume's name: the NBD export name clients ask for. The default,
    /// the empty name, is what clients get when they name no export.
    #[arg(long, default_value = "", value_parser = crate::args::parse_volume_name)]
    pub name: String,
    /// Keep an integrity tag (crc32c of address and data) for every origin
    /// block, on the cache device, so origin blocks that rot, tear or land
    /// in the wrong place read as EIO instead of wrong data. Costs 8 bytes
    /// of cache device and 4 bytes of RAM per origin block (1 GiB of RAM
    /// per TiB of origin at 4K blocks; larger blocks cost less). Existing
    /// origin data is tagged by a background recalculation while serving.
    #[arg(long)]
    pub integrity: bool,
    /// Room in the tag area for volumes added later with
    /// `cairn volume add --integrity`, as the origin bytes their tags will
    /// cover in all (suffixes K, M, G, T; e.g. 8T). The area is sized now
    /// and cannot grow, so reserve for the origins you expect to attach.
    /// Costs 2 bytes of cache device per 1 KiB of origin at 4K blocks
    /// (16 GiB for 8 TiB), and RAM only once a volume uses its share.
    /// Without it, only the first volume can keep tags.
    #[arg(long = "integrity-reserve", value_name = "SIZE", default_value = "0", value_parser = crate::args::parse_size)]
    pub integrity_reserve_bytes: u64,
}

pub fn run(args: &FormatArgs) -> Result<()> {
    crate::devices::refuse_same_file(&args.cache, &args.origin)?;
    let cache_dev = open_cache(&args.cache, OpenMode::Exclusive)?;
    let origin_dev = open_origin(&args.origin)?;
    let sb = Engine::format(
        cache_dev.clone(),
        origin_dev,
        &FormatOptions {
            block_size_bytes: args.block_size_bytes,
            force: args.force,
            integrity: args.integrity,
            integrity_reserve_bytes: args.integrity_reserve_bytes,
            volume_name: args.name.clone(),
        },
    )?;
    let table = Engine::read_volume_table(cache_dev.as_ref())?;
    let volume = table
        .by_id(0)
        .ok_or_else(|| anyhow::anyhow!("the new cache's volume table lists no volume 0"))?;
    let origin_size_bytes = volume.origin_size_bytes;
    say!(
        "formatted {} for origin {}: {} cache blocks of {} bytes, volume {:?} of {} bytes",
        args.cache.display(),
        volume.origin_identity,
        sb.log_blocks,
        sb.block_size_bytes,
        volume.name,
        origin_size_bytes
    )?;
    if args.integrity {
        let origin_blocks = origin_size_bytes / sb.block_size_bytes as u64;
        say!(
            "integrity on: {} tag bytes on the cache, {} bytes of RAM for tags; `cairn serve` tags the origin's existing data in the background (see `cairn status`)",
            cairn_format::tag_area_bytes_for(origin_blocks),
            origin_blocks * 4
        )?;
    }
    if args.integrity_reserve_bytes > 0 {
        let reserve_blocks = args.integrity_reserve_bytes / sb.block_size_bytes as u64;
        say!(
            "integrity reserve: {} tag bytes on the cache for volumes added later with --integrity, covering {} bytes of origin",
            cairn_format::tag_area_bytes_for(reserve_blocks),
            reserve_blocks * sb.block_size_bytes as u64
        )?;
    }
    Ok(())
}
