//! `cairn demo`: demo cache and origin files, formatted and served.

use std::path::Path;

use anyhow::{Context, Result};
use cairn_device::OpenMode;
use cairn_engine::{Engine, FormatOptions};

use super::{open_cache, open_engine, open_origin};
use crate::daemon::{serve_volume, ServeOptions};

pub fn run(dir: &Path) -> Result<()> {
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
        let q = shell_word(&uri);
        println!("  nbdinfo {q}");
        println!("  qemu-io -f raw {q} -c 'write -P 0x5a 0 1M' -c 'read -P 0x5a 0 1M'");
        println!(
            "  fio --name=demo --ioengine=nbd --uri={q} --rw=randwrite --bs=4k --size=64M --fsync=1 --runtime=10 --time_based"
        );
        println!(
            "  {} status --cache {}",
            cairn_command(),
            shell_word(&cache_abs.to_string_lossy())
        );
        println!("\nPress Ctrl-C to stop (in-flight I/O finishes, data is flushed).");
    });
    let settings = crate::settings::SharedSettings::new(
        crate::settings::EffectiveSettings::resolve(&Default::default(), &engine.stored_settings()),
    );
    serve_volume(
        engine,
        ServeOptions {
            cache,
            settings,
            socket: Some(socket),
            listen: None,
            no_writeback: false,
            metrics: None,
            idle_exit_secs: 30,
            connection: Default::default(),
            on_ready: Some(on_ready),
        },
    )
}

/// How to run this cairn from another terminal, as printed: the running
/// binary's own path (a fresh checkout has no `cairn` on the PATH), and the
/// runtime directory when it is not the default, so the command finds this
/// daemon's admin socket.
fn cairn_command() -> String {
    let exe = std::env::current_exe()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "cairn".to_string());
    match std::env::var_os("CAIRN_RUNTIME_DIR") {
        Some(dir) => format!(
            "CAIRN_RUNTIME_DIR={} {}",
            shell_word(&dir.to_string_lossy()),
            shell_word(&exe)
        ),
        None => shell_word(&exe),
    }
}

/// `word` as one POSIX shell word: as it is when that is safe, else in
/// single quotes.
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-+:=@%,".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}
