//! `cairn set`: store policy settings in the cache, so every later `serve`
//! uses them; while a daemon serves the cache, they apply at once.

use std::path::PathBuf;

use anyhow::Result;

use super::policy_args::PolicyArgs;
use crate::admin::{AdminReply, AdminRequest, SettingsChange};

/// A setting, by its `serve` flag's name (for `--reset`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SettingName {
    SequentialCutoff,
    PromoteAfter,
    WritebackHighPct,
    WritebackLowPct,
    WritebackMaxAgeSecs,
    WritebackRate,
    PageCacheReads,
}

impl SettingName {
    /// The name in `status --json` and the admin protocol.
    fn key(self) -> &'static str {
        match self {
            SettingName::SequentialCutoff => "sequential_cutoff_bytes",
            SettingName::PromoteAfter => "promote_after_misses",
            SettingName::WritebackHighPct => "writeback_high_pct",
            SettingName::WritebackLowPct => "writeback_low_pct",
            SettingName::WritebackMaxAgeSecs => "writeback_max_age_secs",
            SettingName::WritebackRate => "writeback_rate_bytes_per_sec",
            SettingName::PageCacheReads => "page_cache_reads",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

#[derive(clap::Args)]
pub struct SetArgs {
    /// The cache device or file (as given to `cairn format`).
    #[arg(long)]
    pub cache: PathBuf,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// Read cache hits through the host page cache (on) or with O_DIRECT
    /// only (off). Takes effect at the next start of `serve`.
    #[arg(long, value_enum)]
    pub page_cache_reads: Option<OnOff>,
    /// Forget a stored setting (back to the default); repeatable.
    #[arg(long, value_enum)]
    pub reset: Vec<SettingName>,
    /// Print the settings as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &SetArgs) -> Result<()> {
    let given = args
        .policy
        .settings(args.page_cache_reads.map(|v| v == OnOff::On));
    let change = SettingsChange {
        sequential_cutoff_bytes: given.sequential_cutoff_bytes,
        promote_after_misses: given.promote_after_misses,
        writeback_high_pct: given.writeback_high_pct,
        writeback_low_pct: given.writeback_low_pct,
        writeback_max_age_secs: given.writeback_max_age_secs,
        writeback_rate_bytes_per_sec: given.writeback_rate_bytes_per_sec,
        page_cache_reads: given.page_cache_reads,
        reset: args.reset.iter().map(|n| n.key().to_string()).collect(),
    };
    if change.names().is_empty() {
        anyhow::bail!(
            "nothing to set: name at least one setting (e.g. --sequential-cutoff 8M), or --reset one"
        );
    }
    let mut shown = None;
    super::run_request(&args.cache, &AdminRequest::Set { change }, |reply| {
        if let AdminReply::SettingsStored {
            settings,
            restart_needed,
        } = reply
        {
            shown = Some((settings, restart_needed));
        }
    })?;
    let Some((settings, restart_needed)) = shown else {
        anyhow::bail!("the request succeeded without saying the settings");
    };
    if args.json {
        say!(
            "{}",
            serde_json::json!({"settings": settings, "restart_needed": restart_needed})
        )?;
        return Ok(());
    }
    say!(
        "settings of {} (stored in the cache):",
        args.cache.display()
    )?;
    if let Some(map) = settings.as_object() {
        for (name, s) in map {
            say!(
                "  {name:<30} {:<12} ({})",
                s["value"],
                s["source"].as_str().unwrap_or("?")
            )?;
        }
    }
    for name in restart_needed {
        say!("{name} is stored; the running daemon keeps its value until it restarts")?;
    }
    Ok(())
}
