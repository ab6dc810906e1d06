//! Serve an in-memory export over NBD.
//!
//! ```sh
//! cargo run --release -p cairn-nbd --example memserve -- /tmp/mem.sock [size_mib]
//! nbdinfo 'nbd+unix:///?socket=/tmp/mem.sock'
//!
//! # socket activation: the client starts the server and passes fd 3
//! nbdinfo -- target/release/examples/memserve --socket-activation 64
//! ```
//!
//! Stops on Ctrl-C (or EOF on stdin), or, under socket activation, when the
//! last client disconnects.

use std::io::Read;
use std::sync::Arc;

use cairn_nbd::{serve, Listener, MemExport, ServerConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();

    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: memserve SOCKET_PATH [SIZE_MIB] | memserve --socket-activation [SIZE_MIB]";
    let Some(first) = args.first() else {
        return Err(usage.into());
    };
    let size_mib: u64 = match args.get(1) {
        Some(s) => s.parse().map_err(|_| usage)?,
        None => 64,
    };
    let export = Arc::new(MemExport::new(size_mib * 1024 * 1024));
    let mut config = ServerConfig::default();

    if first == "--socket-activation" {
        let listener = Listener::from_systemd()?
            .ok_or("LISTEN_PID/LISTEN_FDS do not activate this process")?;
        config.stop_when_idle = true;
        serve(export, listener, config)?.wait()?;
        return Ok(());
    }

    let listener = Listener::bind_unix(first)?;
    let handle = serve(export, listener, config)?;
    eprintln!(
        "serving {size_mib} MiB on nbd+unix:///?socket={first}; press Enter or Ctrl-D to stop"
    );
    // Block until stdin closes or a line arrives; Ctrl-C simply kills us
    // (the socket file is then removed as stale by the next server).
    let mut byte = [0u8; 1];
    let _ = std::io::stdin().read(&mut byte);
    handle.shutdown()?;
    Ok(())
}
