//! `cairn volume`: the volumes one cache serves, each its own origin and
//! NBD export.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

use crate::admin::{AdminReply, AdminRequest};
use crate::args::Mode;

#[derive(clap::Subcommand)]
pub enum VolumeCommand {
    /// Add a volume: another origin in front of which the same cache sits,
    /// served as its own NBD export, named NAME.
    ///
    /// Online the daemon opens the origin and exports the volume at once;
    /// offline the next `cairn serve` exports it. The first volume (made
    /// by `cairn format`) is the one clients get when they name no export.
    ///
    ///   cairn volume add --cache C --name db --origin /dev/sdc
    ///   cairn volume add --cache C --name backup --origin nbd://nas/backup --mode writethrough
    ///   nbdinfo --list 'nbd+unix:///?socket=/run/cairn.sock'
    #[command(verbatim_doc_comment)]
    Add {
        /// The cache device or file (as given to `cairn format`).
        #[arg(long)]
        cache: PathBuf,
        /// The volume's name: its NBD export name (UTF-8, at most 128 bytes).
        #[arg(long, value_parser = crate::args::parse_volume_name)]
        name: String,
        /// The new volume's origin: a device, a file, or an nbd:// or rbd: URI.
        #[arg(long)]
        origin: String,
        #[arg(long, value_enum, default_value = "writeback")]
        mode: Mode,
        /// Keep integrity tags for this origin: origin blocks that rot, tear
        /// or land in the wrong place read as EIO. Its tags take pages of
        /// the tag area reserved at format (`cairn format
        /// --integrity-reserve`); `cairn status` shows what is free. Its
        /// existing data is tagged by a background recalculation.
        #[arg(long)]
        integrity: bool,
        /// The most of the cache's log this volume's dirty data may hold
        /// while other volumes use the cache, in percent (1-100). At it,
        /// this volume's writers wait for its own write-back, and only
        /// them. Default: half with two volumes, a third with three, a
        /// quarter with four or more; alone in the cache a volume may use
        /// all of it.
        #[arg(long, value_parser = clap::value_parser!(u8).range(1..=100))]
        dirty_share_pct: Option<u8>,
    },
    /// Remove a volume: write back all its dirty data to its origin, then
    /// drop it from the cache (the first volume stays).
    ///
    /// Online its export stops first: refused while clients are connected
    /// to it, unless --force, which disconnects them. Its origin then holds
    /// everything written to the volume.
    Remove {
        /// The cache device or file (as given to `cairn format`).
        #[arg(long)]
        cache: PathBuf,
        /// The volume to remove.
        #[arg(long)]
        name: String,
        /// Disconnect the clients of its export instead of refusing.
        #[arg(long)]
        force: bool,
    },
    /// Change a volume's cache mode or dirty share, online or offline.
    ///
    /// Leaving writeback writes back that volume's dirty data first, with
    /// progress (the other volumes keep theirs). The settings are stored
    /// in the cache's volume table.
    ///
    ///   cairn volume set --cache C --name backup --mode writethrough
    ///   cairn volume set --cache C --name scratch --dirty-share-pct 10
    ///   cairn volume set --cache C --name scratch --dirty-share-pct default
    #[command(verbatim_doc_comment)]
    Set {
        /// The cache device or file (as given to `cairn format`).
        #[arg(long)]
        cache: PathBuf,
        /// The volume to change ("" for the first volume).
        #[arg(long)]
        name: String,
        #[arg(long, value_enum)]
        mode: Option<Mode>,
        /// The most of the cache's log this volume's dirty data may hold
        /// while other volumes use the cache: a percent (1-100), or
        /// `default` (half with two volumes, a third with three, a quarter
        /// with four or more).
        #[arg(long, value_parser = parse_dirty_share)]
        dirty_share_pct: Option<DirtyShare>,
    },
    /// List the volumes: name, origin, size, mode, cached blocks, state.
    List {
        /// The cache device or file (as given to `cairn format`).
        #[arg(long)]
        cache: PathBuf,
        /// Print the list as JSON.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(command: VolumeCommand) -> Result<()> {
    match command {
        VolumeCommand::Add {
            cache,
            name,
            origin,
            mode,
            integrity,
            dirty_share_pct,
        } => {
            let request = AdminRequest::VolumeAdd {
                name: name.clone(),
                origin: origin.clone(),
                mode: mode.engine(),
                integrity,
                dirty_share_pct,
            };
            let volumes = ask(&cache, &request)?;
            let added = volumes
                .as_array()
                .and_then(|list| list.iter().find(|v| v["name"] == name.as_str()))
                .context("the new volume is not in the list")?;
            let tags = if added["integrity"] == true {
                ", integrity on (its existing data is tagged in the background while serving)"
            } else {
                ""
            };
            say!(
                "added volume {:?} (id {}) over {}, {} bytes, mode {}{tags}",
                name,
                added["id"],
                added["origin"].as_str().unwrap_or(&origin),
                added["size_bytes"],
                added["mode"].as_str().unwrap_or("?")
            )?;
        }
        VolumeCommand::Remove { cache, name, force } => {
            ask(
                &cache,
                &AdminRequest::VolumeRemove {
                    name: name.clone(),
                    force,
                },
            )?;
            say!("removed volume {name:?}: its origin holds everything written to it")?;
        }
        VolumeCommand::Set {
            cache,
            name,
            mode,
            dirty_share_pct,
        } => set(&cache, &name, mode, dirty_share_pct)?,
        VolumeCommand::List { cache, json } => {
            let volumes = ask(&cache, &AdminRequest::VolumeList)?;
            if json {
                say!("{}", serde_json::to_string_pretty(&volumes)?)?;
            } else {
                print_table(&volumes)?;
            }
        }
    }
    Ok(())
}

/// A dirty share as given on the command line.
#[derive(Debug, Clone, Copy)]
pub struct DirtyShare(Option<u8>);

fn parse_dirty_share(text: &str) -> Result<DirtyShare, String> {
    if text == "default" {
        return Ok(DirtyShare(None));
    }
    match text.parse::<u8>() {
        Ok(pct) if (1..=100).contains(&pct) => Ok(DirtyShare(Some(pct))),
        _ => Err(format!(
            "{text:?} is not a share: give a percent from 1 to 100, or `default`"
        )),
    }
}

/// `cairn volume set`.
fn set(
    cache: &Path,
    name: &str,
    mode: Option<Mode>,
    dirty_share_pct: Option<DirtyShare>,
) -> Result<()> {
    if mode.is_none() && dirty_share_pct.is_none() {
        anyhow::bail!("nothing to change: give --mode, --dirty-share-pct or both");
    }
    let request = AdminRequest::VolumeSet {
        name: name.to_string(),
        mode: mode.map(Mode::engine),
        dirty_share_pct: dirty_share_pct.map(|DirtyShare(pct)| pct.unwrap_or(0)),
    };
    let mut written = 0u64;
    let mut volumes = None;
    {
        let pb = super::Progress::new("draining");
        super::run_request(cache, &request, |reply| match reply {
            AdminReply::Progress { done, total } => pb.set(done, total),
            AdminReply::Drained { blocks_written, .. } => written = blocks_written,
            AdminReply::Volumes { volumes: v } => volumes = Some(v),
            _ => {}
        })?;
    }
    let volumes = volumes.context("the daemon answered without the volumes")?;
    let entry = volumes
        .as_array()
        .and_then(|list| list.iter().find(|v| v["name"] == name))
        .context("the volume is not in the list")?;
    say!(
        "volume {name:?}: mode {}, dirty share {}% of the log{} ({written} dirty blocks written back first)",
        entry["mode"].as_str().unwrap_or("?"),
        entry["dirty_share_pct"],
        if entry["dirty_share_default"].as_bool() == Some(true) {
            " (the default)"
        } else {
            ""
        },
    )?;
    Ok(())
}

/// Run `request` (online or offline); the volumes it answers with.
fn ask(cache: &Path, request: &AdminRequest) -> Result<Value> {
    let mut volumes = None;
    super::run_request(cache, request, |reply| {
        if let AdminReply::Volumes { volumes: v } = reply {
            volumes = Some(v);
        }
    })?;
    volumes.context("the daemon answered without the volumes")
}

fn print_table(volumes: &Value) -> Result<()> {
    say!(
        "{:<4} {:<16} {:>14} {:<12} {:>10} {:>10} {:<8} ORIGIN",
        "ID",
        "NAME",
        "SIZE",
        "MODE",
        "DIRTY",
        "CLEAN",
        "STATE"
    )?;
    for v in volumes.as_array().map(Vec::as_slice).unwrap_or_default() {
        let name = match v["name"].as_str() {
            Some("") => "\"\"".to_string(),
            Some(n) => n.to_string(),
            None => "?".to_string(),
        };
        // `Value`'s Display ignores widths: numbers as text first.
        let n = |key: &str| v[key].as_u64().map_or("?".to_string(), |x| x.to_string());
        say!(
            "{:<4} {:<16} {:>14} {:<12} {:>10} {:>10} {:<8} {}",
            n("id"),
            name,
            n("size_bytes"),
            v["mode"].as_str().unwrap_or("?"),
            n("dirty_blocks"),
            n("clean_blocks"),
            // A failing or fenced origin shows in the state: its
            // write-back waits (fenced: until a restart).
            match v["origin_state"].as_str() {
                Some("failing") => "failing",
                Some("fenced") => "fenced",
                _ => v["state"].as_str().unwrap_or("?"),
            },
            v["origin"].as_str().unwrap_or("?")
        )?;
    }
    Ok(())
}
