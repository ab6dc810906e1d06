//! The `cairn` command.

mod daemon;
mod export;
mod status;
mod writeback;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use cairn_device::{open_local, open_path_or_uri, Device, DeviceError, OpenMode};
use cairn_engine::{Engine, FormatOptions, OpenOptions};
use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

/// `println!` that returns an error instead of panicking when stdout is
/// closed (`cairn status | head -1`).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)
    }};
}

#[derive(Parser)]
#[command(
    name = "cairn",
    version,
    about = "A checksummed userspace block cache: a fast device in front of a slow origin, served over NBD",
    long_about = "cairn puts a small fast device (NVMe, SSD, Optane, or a file on one) in front of a large \
slow origin (HDD, RAID, or a remote NBD export). Writes are absorbed write-back and reach the origin later, \
in order, so the origin alone is always the volume as of some past flush. Every cached block is checksummed. \
The combined volume is served over NBD, so Linux, qemu, libnbd tools and fio use it with no kernel module.\n\n\
Typical use:\n  cairn format --cache /dev/nvme0n1p3 --origin /dev/sdb\n  cairn serve --cache /dev/nvme0n1p3 --socket /run/cairn.sock\n  \
nbdfuse /mnt/vol --unix /run/cairn.sock   (or: nbd-client -unix /run/cairn.sock /dev/nbd0)\n\n\
Try it first with `cairn demo`."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
enum Mode {
    /// Writes are acknowledged once on the cache and written back later (default).
    Writeback,
    /// Writes are acknowledged once the origin has them; the cache keeps a clean copy.
    Writethrough,
    /// Writes go to the origin and drop cached copies; reads are cached.
    Writearound,
    /// The cache is not used for new data; dirty data is still served until drained.
    Passthrough,
}

impl Mode {
    fn engine(self) -> cairn_engine::CacheMode {
        match self {
            Mode::Writeback => cairn_engine::CacheMode::WriteBack,
            Mode::Writethrough => cairn_engine::CacheMode::WriteThrough,
            Mode::Writearound => cairn_engine::CacheMode::WriteAround,
            Mode::Passthrough => cairn_engine::CacheMode::PassThrough,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Format CACHE as a cairn cache for ORIGIN (destroys what CACHE held).
    Format {
        /// The fast device or file that will hold the cache.
        #[arg(long)]
        cache: PathBuf,
        /// The slow device, file, or NBD URI (nbd://host/export, nbd+unix:///export?socket=PATH).
        #[arg(long)]
        origin: String,
        /// Cache block size: a power of two from 4K to 64K (suffix K allowed).
        #[arg(long, default_value = "4K", value_parser = parse_block_size)]
        block_size: u32,
        /// Overwrite a cache that is already formatted.
        #[arg(long)]
        force: bool,
        /// Keep an integrity tag (crc32c of address and data) for every origin
        /// block, on the cache device, so origin blocks that rot, tear or land
        /// in the wrong place read as EIO instead of wrong data. Costs 8 bytes
        /// of cache device and 4 bytes of RAM per origin block (1 GiB of RAM
        /// per TiB of origin at 4K blocks; larger blocks cost less). Existing
        /// origin data is tagged by a background recalculation while serving.
        #[arg(long)]
        integrity: bool,
    },
    /// Serve the cached volume over NBD, in the foreground.
    ///
    /// The socket appears only once the volume is ready. SIGTERM or SIGINT
    /// finishes in-flight requests, flushes, checkpoints and exits 0;
    /// SIGKILL is safe at any moment (recovery replays the log).
    Serve {
        #[arg(long)]
        cache: PathBuf,
        /// Override the origin recorded at format time (its identity is checked).
        #[arg(long)]
        origin: Option<String>,
        /// Unix socket to listen on (default ./cairn.sock).
        #[arg(long, conflicts_with = "listen")]
        socket: Option<PathBuf>,
        /// Listen on TCP instead, e.g. 127.0.0.1:10809. Use loopback unless you mean otherwise.
        #[arg(long)]
        listen: Option<String>,
        /// Switch to this cache mode at start (default: the mode recorded in the cache).
        /// Leaving writeback drains dirty data first.
        #[arg(long, value_enum)]
        mode: Option<Mode>,
        /// Keep dirty data on the cache until asked (write-back still runs when space runs out).
        #[arg(long)]
        no_writeback: bool,
        /// Reads continuing a sequential stream longer than this bypass the cache
        /// (not promoted, counted as bypassed). 0 disables. Suffixes K, M, G.
        #[arg(long, default_value = "4M", value_parser = parse_size)]
        sequential_cutoff: u64,
        /// Promote a missed block on its Nth miss (1 = always; Open CAS "nhit").
        #[arg(long, default_value_t = 1)]
        promote_after: u32,
        /// Read cache hits with O_DIRECT only. By default hits are read through
        /// the host page cache, so the hottest blocks are served from RAM the
        /// kernel reclaims under memory pressure (it is not counted in cairn's
        /// RSS); writes always bypass it, and every hit is still checked
        /// against its checksum. Use this when the host needs that RAM, or
        /// when the NBD client caches the volume itself.
        #[arg(long)]
        no_page_cache_reads: bool,
        /// Start cleaning when dirty data exceeds this share of the cache (percent).
        #[arg(long, default_value_t = 50)]
        writeback_high_pct: u64,
        /// Stop cleaning (while busy) once dirty data is below this share (percent).
        #[arg(long, default_value_t = 10)]
        writeback_low_pct: u64,
        /// Write back dirty data older than this even while foreground I/O is busy.
        #[arg(long, default_value_t = 30)]
        writeback_max_age_secs: u64,
        /// Cap write-back bandwidth (bytes per second, suffixes K, M, G; 0 = no cap).
        #[arg(long, default_value = "0", value_parser = parse_size)]
        writeback_rate: u64,
        /// Serve Prometheus metrics over HTTP on HOST:PORT.
        #[arg(long)]
        metrics: Option<String>,
        /// Accept an origin whose identity differs from the recorded one.
        #[arg(long)]
        force: bool,
    },
    /// Show the cache's state (asks the daemon if one serves it, else reads the devices).
    Status {
        #[arg(long)]
        cache: PathBuf,
        /// Print stable JSON with snake_case keys.
        #[arg(long)]
        json: bool,
    },
    /// Write back every dirty block to the origin (online or offline).
    Flush {
        #[arg(long)]
        cache: PathBuf,
    },
    /// Verify every checksum on the cache; exits 1 if any block is bad.
    ///
    /// With --origin (caches formatted with --integrity), verify every origin
    /// block against its integrity tag instead: a scrub, safe while serving.
    /// Mismatching blocks that have a clean cached copy are rewritten from it.
    Check {
        #[arg(long)]
        cache: PathBuf,
        /// Scrub the origin against its integrity tags.
        #[arg(long)]
        origin: bool,
        /// Origin read rate limit for the scrub (bytes per second, suffixes K,
        /// M, G; 0 = no limit).
        #[arg(long, default_value = "0", value_parser = parse_size, requires = "origin")]
        rate: u64,
        /// Report mismatches only; never rewrite the origin.
        #[arg(long, requires = "origin")]
        no_repair: bool,
    },
    /// Switch the cache mode (online through the daemon, or offline).
    ///
    /// Leaving writeback drains dirty data first, with progress; a mode
    /// switch never loses or exposes stale data.
    Mode {
        #[arg(long)]
        cache: PathBuf,
        #[arg(value_enum)]
        mode: Mode,
    },
    /// Prefetch a range of the volume into the cache (like the NBD CACHE command).
    Warm {
        #[arg(long)]
        cache: PathBuf,
        /// OFFSET:LENGTH in bytes, suffixes K, M, G allowed, e.g. 0:64M.
        range: String,
    },
    /// Create demo cache and origin files, format them, and serve them.
    Demo {
        /// Where the demo files and socket live.
        #[arg(long, default_value = "cairn-demo")]
        dir: PathBuf,
    },
}

fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, shift) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 10),
        Some((i, 'M' | 'm')) => (&t[..i], 20),
        Some((i, 'G' | 'g')) => (&t[..i], 30),
        _ => (t, 0),
    };
    let v: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size; use e.g. 4096, 64K, 4M or 1G"))?;
    v.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{s:?} is too large"))
}

fn parse_range(s: &str) -> Result<(u64, u64)> {
    let Some((a, b)) = s.split_once(':') else {
        bail!("range {s:?} must be OFFSET:LENGTH, e.g. 0:64M");
    };
    Ok((
        parse_size(a).map_err(anyhow::Error::msg)?,
        parse_size(b).map_err(anyhow::Error::msg)?,
    ))
}

fn parse_block_size(s: &str) -> Result<u32, String> {
    let t = s.trim();
    let (num, mult) = match t.strip_suffix(['K', 'k']) {
        Some(n) => (n, 1024u64),
        None => (t, 1),
    };
    let v: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size; use e.g. 4K, 8K or 65536"))?;
    let bytes = v * mult;
    if !bytes.is_power_of_two() || !(4096..=65536).contains(&bytes) {
        return Err(format!(
            "block size {bytes} is not a power of two between 4K and 64K; use 4K, 8K, 16K, 32K or 64K"
        ));
    }
    Ok(bytes as u32)
}

/// "cache PATH: why", naming the device once (device errors usually start
/// with the device's name already).
fn device_error(role: &str, spec: &str, e: DeviceError) -> anyhow::Error {
    let msg = e.to_string();
    if msg.starts_with(spec) {
        anyhow::anyhow!("{role} {msg}")
    } else {
        anyhow::anyhow!("{role} {spec}: {msg}")
    }
}

fn open_cache(path: &Path, mode: OpenMode) -> Result<Arc<dyn Device>> {
    let dev = open_local(path, mode)
        .map_err(|e| device_error("cache", &path.display().to_string(), e))?;
    Ok(Arc::from(dev))
}

fn open_origin(spec: &str) -> Result<Arc<dyn Device>> {
    let dev =
        open_path_or_uri(spec, OpenMode::Exclusive).map_err(|e| device_error("origin", spec, e))?;
    Ok(Arc::from(dev))
}

/// The origin recorded in the superblock, as something we can open.
fn recorded_origin(cache: &dyn Device) -> Result<String> {
    let sb = Engine::read_superblock(cache)?;
    Ok(match sb.origin_identity.strip_prefix("file:") {
        Some(path) => path.to_string(),
        None => sb.origin_identity,
    })
}

fn open_engine(cache_path: &Path, origin: Option<&str>, force: bool) -> Result<Arc<Engine>> {
    open_engine_with(
        cache_path,
        origin,
        force,
        cairn_engine::EngineConfig::default(),
    )
}

fn open_engine_with(
    cache_path: &Path,
    origin: Option<&str>,
    force: bool,
    config: cairn_engine::EngineConfig,
) -> Result<Arc<Engine>> {
    let cache = open_cache(cache_path, OpenMode::Exclusive)?;
    let origin_spec = match origin {
        Some(o) => o.to_string(),
        None => recorded_origin(cache.as_ref())?,
    };
    let origin = open_origin(&origin_spec)?;
    tracing::info!(
        cache_backend = cache.backend(),
        origin_backend = origin.backend(),
        page_cache_reads = config.page_cache_reads,
        "devices opened"
    );
    let opts = OpenOptions {
        force_origin: force,
        config,
    };
    Ok(Arc::new(Engine::open(cache, origin, &opts)?))
}

fn progress_bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.set_message(what.to_string());
    pb
}

fn cmd_format(
    cache: &Path,
    origin: &str,
    block_size: u32,
    force: bool,
    integrity: bool,
) -> Result<()> {
    let cache_dev = open_cache(cache, OpenMode::Exclusive)?;
    let origin_dev = open_origin(origin)?;
    let sb = Engine::format(
        cache_dev,
        origin_dev,
        &FormatOptions {
            block_size_bytes: block_size,
            force,
            integrity,
        },
    )?;
    say!(
        "formatted {} for origin {}: {} cache blocks of {} bytes, volume {} bytes",
        cache.display(),
        sb.origin_identity,
        sb.log_blocks,
        sb.block_size_bytes,
        sb.origin_size_bytes
    )?;
    if integrity {
        let origin_blocks = sb.origin_size_bytes / sb.block_size_bytes as u64;
        say!(
            "integrity on: {} tag bytes on the cache, {} bytes of RAM for tags; `cairn serve` tags the origin's existing data in the background (see `cairn status`)",
            cairn_format::tag_area_bytes_for(origin_blocks),
            origin_blocks * 4
        )?;
    }
    Ok(())
}

fn cmd_check_origin(cache: &Path, rate: u64, repair: bool) -> Result<ExitCode> {
    let pb = progress_bar(0, "scrubbing origin");
    let mut mismatches: Vec<(u64, u64)> = Vec::new();
    let mut repaired: Vec<(u64, u64)> = Vec::new();
    let mut totals = [0u64; 4];
    let online = daemon::ask_daemon(cache, &format!("scrub {rate} {}", repair as u8), |line| {
        let mut words = line.split_whitespace();
        let kind = words.next().unwrap_or("");
        let nums: Vec<u64> = words.filter_map(|x| x.parse().ok()).collect();
        match (kind, &nums[..]) {
            ("progress", [done, total]) => {
                pb.set_length(*total);
                pb.set_position(*done);
            }
            ("mismatch", [lba, offset]) => mismatches.push((*lba, *offset)),
            ("repaired", [lba, offset]) => repaired.push((*lba, *offset)),
            ("done", [a, b, c, d]) => totals = [*a, *b, *c, *d],
            _ => {}
        }
    });
    match online {
        Some(r) => r?,
        None => {
            let engine = open_engine(cache, None, false)?;
            if !engine.integrity() {
                engine.close()?;
                bail!(
                    "cache {} was formatted without --integrity, so the origin has no tags to check against. Reformat with `cairn format --integrity` (after `cairn flush`) to protect the origin",
                    cache.display()
                );
            }
            let bs = engine.block_size_bytes() as u64;
            let opts = cairn_engine::ScrubOptions {
                repair,
                rate_bytes_per_s: (rate > 0).then_some(rate),
            };
            let report = engine.scrub_origin(&opts, |done, total| {
                pb.set_length(total);
                pb.set_position(done);
            })?;
            mismatches = report.mismatches.iter().map(|&l| (l, l * bs)).collect();
            repaired = report.repaired.iter().map(|&l| (l, l * bs)).collect();
            totals = [
                report.blocks_checked,
                report.blocks_verified,
                report.blocks_unverified,
                report.blocks_skipped,
            ];
            engine.close()?;
        }
    }
    pb.finish_and_clear();
    if totals[0] == 0 {
        bail!(
            "cache {} was formatted without --integrity, so the origin has no tags to check against. Reformat with `cairn format --integrity` (after `cairn flush`) to protect the origin",
            cache.display()
        );
    }
    for (lba, offset) in &repaired {
        say!("repaired: origin block {lba} (byte offset {offset}) rewritten from its clean cached copy")?;
    }
    for (lba, offset) in &mismatches {
        say!("origin mismatch: origin block {lba} (byte offset {offset}) does not match its tag")?;
    }
    say!(
        "origin scrub: {} blocks checked, {} verified, {} not yet tagged (recalculation running), {} skipped (dirty in the cache), {} repaired, {} bad",
        totals[0],
        totals[1],
        totals[2],
        totals[3],
        repaired.len(),
        mismatches.len()
    )?;
    if mismatches.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        say!("check FAILED: {} origin blocks are corrupt and have no clean cached copy; restore them from a backup (they read as EIO)", mismatches.len())?;
        Ok(ExitCode::from(1))
    }
}

fn cmd_status(cache: &Path, json: bool) -> Result<()> {
    let mut out = String::new();
    let v = match daemon::ask_daemon(cache, "status", |l| out.push_str(l)) {
        Some(r) => {
            r?;
            serde_json::from_str(&out).context("parsing the daemon's status")?
        }
        None => {
            let engine = open_engine(cache, None, false)?;
            let v = status::status_json(&engine.stats(), &engine.superblock(), false);
            engine.close()?;
            v
        }
    };
    if json {
        say!("{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        status::print_human(&v)?;
    }
    Ok(())
}

fn cmd_flush(cache: &Path) -> Result<ExitCode> {
    let mut written = 0u64;
    let pb = progress_bar(0, "write-back");
    let online = daemon::ask_daemon(cache, "drain", |line| {
        let parts: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        if let [w, dirty] = parts[..] {
            written = w;
            pb.set_length(w + dirty);
            pb.set_position(w);
        }
    });
    // Blocks whose dirty data failed its checksum cannot be written back.
    let unrecoverable = match online {
        Some(r) => {
            r?;
            let mut out = String::new();
            match daemon::ask_daemon(cache, "status", |l| out.push_str(l)) {
                Some(r) => {
                    r?;
                    let v: serde_json::Value = serde_json::from_str(&out)?;
                    let n = |k: &str| v.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
                    n("corrupt_blocks") + n("lost_blocks")
                }
                None => 0,
            }
        }
        None => {
            let engine = open_engine(cache, None, false)?;
            let p = engine.drain_with_progress(|p| {
                pb.set_length(p.blocks_written + p.dirty_blocks);
                pb.set_position(p.blocks_written);
            })?;
            written = p.blocks_written;
            let s = engine.stats();
            engine.close()?;
            s.corrupt_blocks + s.lost_blocks
        }
    };
    pb.finish_and_clear();
    if unrecoverable > 0 {
        say!(
            "write-back incomplete: {written} blocks written, but {unrecoverable} dirty blocks failed their checksum on the cache and can never reach the origin; they read as EIO until rewritten. Run `cairn check --cache {}` to list them",
            cache.display()
        )?;
        return Ok(ExitCode::from(1));
    }
    say!("write-back complete: {written} blocks written to the origin, 0 dirty")?;
    Ok(ExitCode::SUCCESS)
}

fn cmd_check(cache: &Path) -> Result<ExitCode> {
    // The daemon reports "bad LBA BYTE_OFFSET": only it knows the block
    // size, since it holds the cache device's exclusive lock.
    let mut bad: Vec<(u64, u64)> = Vec::new();
    let online = daemon::ask_daemon(cache, "check", |line| {
        let nums: Vec<u64> = line
            .strip_prefix("bad ")
            .map(|rest| {
                rest.split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        if let [lba, offset] = nums[..] {
            bad.push((lba, offset));
        }
    });
    match online {
        Some(r) => r?,
        None => {
            let engine = open_engine(cache, None, false)?;
            let block_size = engine.block_size_bytes() as u64;
            let pb = progress_bar(0, "checking");
            bad = engine
                .check(|done, total| {
                    pb.set_length(total);
                    pb.set_position(done);
                })?
                .into_iter()
                .map(|lba| (lba, lba * block_size))
                .collect();
            pb.finish_and_clear();
            engine.close()?;
        }
    }
    for (lba, offset) in &bad {
        say!("checksum mismatch: origin block {lba} (byte offset {offset})")?;
    }
    if bad.is_empty() {
        say!("check passed: every cached block matches its checksum")?;
        Ok(ExitCode::SUCCESS)
    } else {
        say!("check FAILED: {} bad blocks", bad.len())?;
        Ok(ExitCode::from(1))
    }
}

fn cmd_mode(cache: &Path, mode: Mode) -> Result<()> {
    let target = mode.engine();
    let pb = progress_bar(0, "draining");
    let mut written = 0u64;
    let mut on_progress = |blocks_written: u64, dirty: u64| {
        written = blocks_written;
        pb.set_length(blocks_written + dirty);
        pb.set_position(blocks_written);
    };
    let online = daemon::ask_daemon(cache, &format!("mode {}", target.name()), |line| {
        let parts: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        if let [w, dirty] = parts[..] {
            on_progress(w, dirty);
        }
    });
    match online {
        Some(r) => r?,
        None => {
            let engine = open_engine(cache, None, false)?;
            engine.set_mode(target, |p| on_progress(p.blocks_written, p.dirty_blocks))?;
            engine.close()?;
        }
    }
    pb.finish_and_clear();
    say!(
        "mode is now {} ({written} dirty blocks written back first)",
        target.name()
    )?;
    Ok(())
}

fn cmd_warm(cache: &Path, range: &str) -> Result<()> {
    let (offset, length) = parse_range(range)?;
    let mut cached = 0u64;
    let online = daemon::ask_daemon(cache, &format!("warm {offset} {length}"), |line| {
        if let Some(n) = line
            .strip_prefix("done ")
            .and_then(|x| x.trim().parse().ok())
        {
            cached = n;
        }
    });
    match online {
        Some(r) => r?,
        None => {
            let engine = open_engine(cache, None, false)?;
            if offset >= engine.size_bytes() {
                bail!(
                    "range starts at {offset}, past the end of the {}-byte volume",
                    engine.size_bytes()
                );
            }
            cached = daemon::warm(&engine, offset, length)?;
            engine.close()?;
        }
    }
    say!("warmed {range}: {cached} blocks of the range are now cached")?;
    Ok(())
}

fn cmd_demo(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let cache = dir.join("cache.img");
    let origin = dir.join("origin.img");
    let socket = dir.join("cairn.sock");
    for (path, size) in [(&cache, 64u64 << 20), (&origin, 256u64 << 20)] {
        if !path.exists() {
            let f = std::fs::File::create(path)
                .with_context(|| format!("creating {}", path.display()))?;
            f.set_len(size)?;
        }
    }
    let cache_dev = open_cache(&cache, OpenMode::Exclusive)?;
    if Engine::read_superblock(cache_dev.as_ref()).is_err() {
        let origin_dev = open_origin(&origin.to_string_lossy())?;
        Engine::format(cache_dev.clone(), origin_dev, &FormatOptions::default())?;
        println!(
            "formatted demo cache {} for origin {}",
            cache.display(),
            origin.display()
        );
    }
    drop(cache_dev);
    let engine = open_engine(&cache, Some(&origin.to_string_lossy()), false)?;
    let socket_abs = std::fs::canonicalize(dir)?.join("cairn.sock");
    let uri = format!("nbd+unix:///?socket={}", socket_abs.display());
    let cache_abs = std::fs::canonicalize(&cache)?;
    let on_ready = Box::new(move |_: &str| {
        println!(
            "\ncairn is serving a 256 MiB volume (64 MiB cache in front of a 256 MiB origin)."
        );
        println!("URI: {uri}\n");
        println!("Try, in another terminal:");
        println!("  nbdinfo '{uri}'");
        println!("  qemu-io -f raw '{uri}' -c 'write -P 0x5a 0 1M' -c 'read -P 0x5a 0 1M'");
        println!(
            "  fio --name=demo --ioengine=nbd --uri='{uri}' --rw=randwrite --bs=4k --size=64M --fsync=1 --runtime=10 --time_based"
        );
        println!("  cairn status --cache {}", cache_abs.display());
        println!("\nPress Ctrl-C to stop (in-flight I/O finishes, data is flushed).");
    });
    daemon::serve_volume(
        engine,
        daemon::ServeOptions {
            cache,
            writeback_policy: writeback::WritebackPolicy::default(),
            socket: Some(socket),
            listen: None,
            no_writeback: false,
            metrics: None,
            on_ready: Some(on_ready),
        },
    )
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Format {
            cache,
            origin,
            block_size,
            force,
            integrity,
        } => cmd_format(&cache, &origin, block_size, force, integrity)?,
        Command::Serve {
            cache,
            origin,
            socket,
            listen,
            mode,
            no_writeback,
            metrics,
            force,
            sequential_cutoff,
            promote_after,
            no_page_cache_reads,
            writeback_high_pct,
            writeback_low_pct,
            writeback_max_age_secs,
            writeback_rate,
        } => {
            if writeback_low_pct > writeback_high_pct || writeback_high_pct > 100 {
                bail!(
                    "--writeback-low-pct ({writeback_low_pct}) must not exceed --writeback-high-pct ({writeback_high_pct}), which must be at most 100"
                );
            }
            if let Some(reply) = daemon::ask_daemon(&cache, "status", |_| {}) {
                if reply.is_ok() {
                    bail!(
                        "cache {} is already being served by another cairn. Stop that daemon first",
                        cache.display()
                    );
                }
            }
            let config = cairn_engine::EngineConfig {
                sequential_cutoff_bytes: sequential_cutoff,
                promote_after_misses: promote_after.max(1),
                page_cache_reads: !no_page_cache_reads,
                ..cairn_engine::EngineConfig::default()
            };
            let engine = open_engine_with(&cache, origin.as_deref(), force, config)?;
            if let Some(mode) = mode {
                if engine.is_degraded() {
                    // Serving beats refusing to start: every write goes to
                    // the origin anyway.
                    tracing::warn!(
                        "the cache is degraded: --mode {} is ignored until it is reformatted",
                        mode.engine().name()
                    );
                } else if engine.mode() != mode.engine() {
                    let p = engine.set_mode(mode.engine(), |_| {})?;
                    tracing::info!(
                        "mode set to {} ({} blocks written back first)",
                        mode.engine().name(),
                        p.blocks_written
                    );
                }
            }
            let writeback_policy = writeback::WritebackPolicy {
                high_watermark_pct: writeback_high_pct,
                low_watermark_pct: writeback_low_pct,
                max_age_ms: writeback_max_age_secs * 1000,
                rate_limit_bytes_per_sec: writeback_rate,
                ..writeback::WritebackPolicy::default()
            };
            daemon::serve_volume(
                engine,
                daemon::ServeOptions {
                    cache,
                    writeback_policy,
                    socket,
                    listen,
                    no_writeback,
                    metrics,
                    on_ready: None,
                },
            )?
        }
        Command::Mode { cache, mode } => cmd_mode(&cache, mode)?,
        Command::Warm { cache, range } => cmd_warm(&cache, &range)?,
        Command::Status { cache, json } => cmd_status(&cache, json)?,
        Command::Flush { cache } => return cmd_flush(&cache),
        Command::Check {
            cache,
            origin: true,
            rate,
            no_repair,
        } => return cmd_check_origin(&cache, rate, !no_repair),
        Command::Check { cache, .. } => return cmd_check(&cache),
        Command::Demo { dir } => cmd_demo(&dir)?,
    }
    Ok(ExitCode::SUCCESS)
}

/// stdout went away (`cairn status | head -1`): exit quietly, as if killed
/// by SIGPIPE (128 + 13), without printing an error nobody reads.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// The error and its causes, each said once: some errors already include
/// their source in their own message, which `{:#}` would repeat.
fn error_message(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !msg.contains(&c) {
            msg.push_str(": ");
            msg.push_str(&c);
        }
    }
    msg
}

fn main() -> ExitCode {
    // Every thread that allocates would otherwise get its own malloc arena
    // (up to 8 per core); the daemon's memory should follow the cache size,
    // not the thread count.
    // SAFETY: mallopt only adjusts allocator tunables; called before any
    // other thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CAIRN_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) if is_broken_pipe(&e) => ExitCode::from(141),
        Err(e) => {
            eprintln!("cairn: error: {}", error_message(&e));
            ExitCode::from(2)
        }
    }
}
