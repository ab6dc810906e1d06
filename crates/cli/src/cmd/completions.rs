//! `cairn completions SHELL`: a completion script for bash, zsh or fish,
//! generated from the command-line definition, on stdout.

use anyhow::{Context, Result};
use clap_complete::Shell;

pub fn run(mut command: clap::Command, shell: Shell) -> Result<()> {
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut command, "cairn", &mut out);
    std::io::Write::write_all(&mut std::io::stdout().lock(), &out)
        .context("writing the completion script to stdout")
}
