//! `cairn serve`: the arguments, and the checks and mode switch before the
//! daemon starts (see `daemon`).

use std::path::PathBuf;

use anyhow::{bail, Result};
use cairn_engine::{Engine, EngineConfig, StoredSettings};

use super::connection_args::ConnectionArgs;
use super::policy_args::PolicyArgs;
use crate::admin::{client, AdminRequest};
use crate::args::Mode;
use crate::daemon::{serve_volume, ServeOptions};
use crate::settings::{EffectiveSettings, SharedSettings};

#[derive(clap::Args)]
pub struct ServeArgs {
    /// The cache device or file, formatted with `cairn format` (it records
    /// the origin).
    #[arg(long)]
    pub cache: PathBuf,
    /// Override the origin recorded at format time (its identity is checked).
    #[arg(long)]
    pub origin: Option<String>,
    /// Unix socket to listen on (default ./cairn.sock).
    #[arg(long, conflicts_with = "listen")]
    pub socket: Option<PathBuf>,
    /// Listen on TCP instead, e.g. 127.0.0.1:10809. Use loopback unless you mean otherwise.
    #[arg(long)]
    pub listen: Option<String>,
    /// Switch to this cache mode at start (default: the mode recorded in the cache).
    /// Leaving writeback drains dirty data first.
    #[arg(long, value_enum)]
    pub mode: Option<Mode>,
    /// Keep dirty data on the cache until asked (write-back still runs when space runs out).
    #[arg(long)]
    pub no_writeback: bool,
    #[command(flatten)]
    pub policy: PolicyArgs,
    #[command(flatten)]
    pub connection: ConnectionArgs,
    /// Read cache hits with O_DIRECT only. By default hits are read through
    /// the host page cache, so the hottest blocks are served from RAM the
    /// kernel reclaims under memory pressure (it is not counted in cairn's
    /// RSS); writes always bypass it, and every hit is still checked
    /// against its checksum. Use this when the host needs that RAM, or
    /// when the NBD client caches the volume itself. [default: stored, else
    /// page-cache reads on]
    #[arg(long)]
    pub no_page_cache_reads: bool,
    /// Most origin reads of cache misses in flight at once (on a remote
    /// origin, also the requests in flight on its connection). More wait
    /// their turn; they never fail for it. Cold random reads over a slow
    /// origin go as fast as the origin allows with at least the clients'
    /// own queue depth here.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub origin_queue_depth: u32,
    /// Under socket activation (systemd's LISTEN_FDS), exit cleanly once no
    /// client has been connected for this long; systemd starts cairn again
    /// at the next connection. 0 exits as soon as the last client leaves.
    /// Without socket activation the daemon serves until stopped.
    #[arg(long, default_value_t = 30, value_name = "SECONDS")]
    pub idle_exit_secs: u64,
    /// Serve Prometheus metrics over HTTP on HOST:PORT.
    #[arg(long)]
    pub metrics: Option<String>,
    /// Accept an origin whose identity differs from the recorded one.
    #[arg(long)]
    pub force: bool,
}

impl ServeArgs {
    /// The settings this run's flags give (the rest: stored or default).
    fn flag_settings(&self) -> StoredSettings {
        self.policy
            .settings(self.no_page_cache_reads.then_some(false))
    }
}

pub fn run(args: ServeArgs) -> Result<()> {
    if let Some(Ok(())) = client::ask_daemon(&args.cache, &AdminRequest::Status, &mut |_| {}) {
        bail!(
            "cache {} is already being served by another cairn. Stop that daemon first",
            args.cache.display()
        );
    }
    // The stored settings come from the superblock, before the engine
    // opens: the page-cache setting is part of how it opens.
    let stored = super::read_stored_settings(&args.cache)?;
    let settings = EffectiveSettings::resolve(&args.flag_settings(), &stored);
    if let Err(why) = settings.check() {
        bail!("{why}: see --writeback-low-pct and --writeback-high-pct, or `cairn set`");
    }
    let config = EngineConfig {
        sequential_cutoff_bytes: settings.sequential_cutoff_bytes(),
        promote_after_misses: settings.promote_after_misses(),
        page_cache_reads: settings.page_cache_reads(),
        origin_queue_depth: args.origin_queue_depth as usize,
        ..EngineConfig::default()
    };
    let engine = super::open_engine_with(&args.cache, args.origin.as_deref(), args.force, config)?;
    if engine.is_degraded() {
        tracing::error!(
            "cache {} is degraded: serving the origin directly; {}",
            args.cache.display(),
            crate::advice::degraded_cache(&args.cache, &engine.volume().origin_identity)
        );
    }
    if let Some(mode) = args.mode {
        switch_mode_at_start(&engine, mode)?;
    }
    serve_volume(
        engine,
        ServeOptions {
            cache: args.cache,
            settings: SharedSettings::new(settings),
            socket: args.socket,
            listen: args.listen,
            no_writeback: args.no_writeback,
            metrics: args.metrics,
            idle_exit_secs: args.idle_exit_secs,
            connection: args.connection,
            on_ready: None,
        },
    )
}

fn switch_mode_at_start(engine: &Engine, mode: Mode) -> Result<()> {
    let target = mode.engine();
    if engine.is_degraded() {
        // Serving beats refusing to start: every write goes to the origin
        // anyway.
        tracing::warn!(
            "the cache is degraded: --mode {} is ignored until it is reformatted",
            target.name()
        );
    } else if engine.mode() != target {
        let p = engine.set_mode(target, |_| {})?;
        tracing::info!(
            "mode set to {} ({} blocks written back first)",
            target.name(),
            p.blocks_written
        );
    }
    Ok(())
}
