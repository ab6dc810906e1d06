//! `cairn manpages DIR`: the manual pages, generated from the command-line
//! definition: `cairn.1` and one `cairn-COMMAND.1` per command, as
//! `man cairn-serve` expects them.

use std::path::Path;

use anyhow::{Context, Result};

pub fn run(command: clap::Command, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let command = command.version(env!("CARGO_PKG_VERSION"));
    let mut written = Vec::new();
    write_page(&command, "cairn", dir, &mut written)?;
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = format!("cairn-{}", sub.get_name());
        let sub = sub
            .clone()
            .name(name.clone())
            .version(env!("CARGO_PKG_VERSION"));
        write_page(&sub, &name, dir, &mut written)?;
    }
    say!(
        "wrote {} manual pages to {}: {}",
        written.len(),
        dir.display(),
        written.join(", ")
    )?;
    Ok(())
}

fn write_page(
    command: &clap::Command,
    name: &str,
    dir: &Path,
    written: &mut Vec<String>,
) -> Result<()> {
    let file = format!("{name}.1");
    let path = dir.join(&file);
    let mut page = Vec::new();
    clap_mangen::Man::new(command.clone())
        .render(&mut page)
        .with_context(|| format!("rendering {file}"))?;
    std::fs::write(&path, page).with_context(|| format!("writing {}", path.display()))?;
    written.push(file);
    Ok(())
}
