//! The `cairn` command: the command line, and where each command lives.
//!
//! - `cmd::*`: one module per command; `cmd::run_request` runs an admin
//!   request through the daemon serving the cache, or offline.
//! - `admin`: the admin socket protocol, its server, and `admin::exec`,
//!   the one implementation of each request for both ways.
//! - `daemon`: `cairn serve`'s threads and shutdown; `export` (NBD),
//!   `writeback` (background policy), `metrics`, `status` (JSON, table).
//! - `status_offline`: `status` and `volume list` with no daemon, from the
//!   cache device opened read-only (no origin, no write).
//! - `advice`: the fix (a command to run) for an error, printed after it.

/// `println!` that returns an error instead of panicking when stdout is
/// closed (`cairn status | head -1`).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)
    }};
}

mod admin;
mod advice;
mod args;
mod cmd;
mod daemon;
mod devices;
mod export;
mod metrics;
mod settings;
mod status;
mod status_offline;
mod volume_exports;
mod writeback;
mod writeback_turns;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{CommandFactory, Parser, Subcommand};

use crate::args::{parse_size, Mode};

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

#[derive(Subcommand)]
enum Command {
    /// Format CACHE as a cairn cache for ORIGIN (destroys what CACHE held).
    Format(cmd::format::FormatArgs),
    /// Serve the cached volume over NBD, in the foreground.
    ///
    /// The socket appears only once the volume is ready. SIGTERM or SIGINT
    /// finishes in-flight requests, flushes, checkpoints and exits 0;
    /// SIGKILL is safe at any moment (recovery replays the log).
    Serve(Box<cmd::serve::ServeArgs>),
    /// Show the cache's state (asks the daemon if one serves it, else reads the devices).
    Status {
        /// The cache device or file (as given to `cairn format`).
        #[arg(long)]
        cache: PathBuf,
        /// Print stable JSON with snake_case keys.
        #[arg(long)]
        json: bool,
        /// Show this volume's figures first (its name; `""` for the first),
        /// then the cache totals.
        #[arg(long)]
        volume: Option<String>,
    },
    /// Write back every dirty block to the origin (online or offline).
    Flush {
        /// The cache device or file (as given to `cairn format`).
        #[arg(long)]
        cache: PathBuf,
    },
    /// Verify every checksum on the cache; exits 1 if any block is bad.
    ///
    /// With --origin (caches formatted with --integrity), verify every origin
    /// block against its integrity tag instead: a scrub, safe while serving.
    /// Mismatching blocks that have a clean cached copy are rewritten from it.
    Check {
        /// The cache device or file (as given to `cairn format`).
        #[arg(long)]
        cache: PathBuf,
        /// Scrub the origin against its integrity tags.
        #[arg(long)]
        origin: bool,
        /// Origin read rate limit for the scrub (bytes per second, suffixes K,
        /// M, G; 0 = no limit).
        #[arg(long, default_value = "0", value_parser = parse_size, requires = "origin")]
        rate: u64,
        /// Report mismatches only (saying which have a clean cached copy);
        /// never rewrite the origin.
        #[arg(long, requires = "origin")]
        no_repair: bool,
    },
    /// Switch the cache mode (online through the daemon, or offline).
    ///
    /// Leaving writeback drains dirty data first, with progress; a mode
    /// switch never loses or exposes stale data.
    Mode {
        /// The cache device or file (as given to `cairn format`).
        #[arg(long)]
        cache: PathBuf,
        #[arg(value_enum)]
        mode: Mode,
    },
    /// Store policy settings in the cache, so every later `serve` uses them.
    ///
    /// Online (a daemon serves the cache) they apply at once, but for
    /// --page-cache-reads, which takes effect at the next start. A `serve`
    /// flag overrides a stored setting for that run only; `status` shows
    /// each setting with its source (flag, stored, default).
    ///
    ///   cairn set --cache C --sequential-cutoff 8M --writeback-high-pct 70
    ///   cairn set --cache C --reset writeback-rate
    #[command(verbatim_doc_comment)]
    Set(cmd::set::SetArgs),
    /// Prefetch a range of the volume into the cache (like the NBD CACHE command).
    Warm {
        /// The cache device or file (as given to `cairn format`).
        #[arg(long)]
        cache: PathBuf,
        /// OFFSET:LENGTH in bytes, suffixes K, M, G allowed, e.g. 0:64M; it must
        /// lie within the volume.
        range: String,
    },
    /// A live view of the daemon serving CACHE, refreshed every second.
    ///
    /// IOPS and MB/s, hit ratio, dirty share, write-back rate and the time to
    /// clean at that rate, latency p50/p99 per operation, cache and origin
    /// state. q or Esc quits. --once prints one frame as plain text and
    /// exits; when stdout is not a terminal, a plain-text frame is printed
    /// every interval instead.
    Top {
        /// The cache device or file (as given to `cairn format`).
        #[arg(long)]
        cache: PathBuf,
        /// Print one frame (over one interval) as plain text and exit, for scripts.
        #[arg(long)]
        once: bool,
        /// Time between samples, in milliseconds.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..=60_000))]
        interval_ms: u64,
    },
    /// Create demo cache and origin files, format them, and serve them.
    Demo {
        /// Where the demo files and socket live.
        #[arg(long, default_value = "cairn-demo")]
        dir: PathBuf,
    },
    /// Print a shell completion script.
    ///
    /// bash: cairn completions bash > /etc/bash_completion.d/cairn
    /// zsh: cairn completions zsh > "${fpath[1]}/_cairn"
    /// fish: cairn completions fish > ~/.config/fish/completions/cairn.fish
    #[command(verbatim_doc_comment)]
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Add and list the volumes of a cache: several origins behind one fast
    /// device, each its own NBD export.
    #[command(subcommand)]
    Volume(cmd::volume::VolumeCommand),
    /// Write the manual pages (cairn.1, cairn-serve.1, ...) into DIR.
    Manpages {
        /// Where to write them, e.g. /usr/local/share/man/man1.
        dir: PathBuf,
    },
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Format(args) => cmd::format::run(&args)?,
        Command::Serve(args) => cmd::serve::run(*args)?,
        Command::Status {
            cache,
            json,
            volume,
        } => cmd::status::run(&cache, json, volume.as_deref())?,
        Command::Flush { cache } => return cmd::flush::run(&cache),
        Command::Check {
            cache,
            origin: true,
            rate,
            no_repair,
        } => return cmd::check::run_origin(&cache, rate, !no_repair),
        Command::Check { cache, .. } => return cmd::check::run(&cache),
        Command::Mode { cache, mode } => cmd::mode::run(&cache, mode)?,
        Command::Warm { cache, range } => cmd::warm::run(&cache, &range)?,
        Command::Set(args) => cmd::set::run(&args)?,
        Command::Volume(command) => cmd::volume::run(command)?,
        Command::Demo { dir } => cmd::demo::run(&dir)?,
        Command::Top {
            cache,
            once,
            interval_ms,
        } => cmd::top::run(&cache, once, interval_ms)?,
        Command::Completions { shell } => cmd::completions::run(Cli::command(), shell)?,
        Command::Manpages { dir } => cmd::manpages::run(Cli::command(), &dir)?,
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

/// Clap's own errors (an unknown flag or command, a missing argument, a
/// bad value) on a `cairn: error:` line like every other error, followed by
/// clap's tip and usage, with clap's exit code (2). `--help` and
/// `--version` are not errors: printed as clap prints them, exit 0.
fn parse_failed(e: &clap::Error) -> ExitCode {
    let code = ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
    if !e.use_stderr() {
        let _ = e.print();
        return code;
    }
    // Rendered without colour, as cairn's other errors are.
    let text = e.render().to_string();
    let text = match text.strip_prefix("error: ") {
        Some(rest) => format!("cairn: error: {rest}"),
        None => text,
    };
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), text.as_bytes());
    code
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
    let cli = Cli::try_parse();
    // A query prints its answer and nothing else unless something is
    // wrong: the offline status's recovery would otherwise log its INFO
    // lines around the answer.
    let quiet = matches!(
        &cli,
        Ok(Cli {
            command: Command::Status { .. }
                | Command::Volume(cmd::volume::VolumeCommand::List { .. })
        })
    );
    let default_filter = if quiet { "warn" } else { "info" };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CAIRN_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = match cli {
        Ok(cli) => cli,
        Err(e) => return parse_failed(&e),
    };
    match run(cli) {
        Ok(code) => code,
        Err(e) if is_broken_pipe(&e) => ExitCode::from(141),
        Err(e) => {
            eprintln!("cairn: error: {}", error_message(&e));
            if let Some(hint) = advice::for_error(&e) {
                eprintln!("cairn: hint: {hint}");
            }
            ExitCode::from(2)
        }
    }
}
