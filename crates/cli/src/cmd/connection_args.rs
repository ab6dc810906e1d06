//! `serve`'s options for who may connect and how many at once, shared
//! with the demo (which takes the defaults).

use cairn_nbd::ServerConfig;

const DEFAULT_MAX_CONNECTIONS: u32 = 32;
const DEFAULT_MAX_HANDSHAKES: u32 = 64;
const DEFAULT_MAX_HANDSHAKES_PER_PEER: u32 = 16;
const DEFAULT_HANDSHAKE_TIMEOUT_SECS: u32 = 5;

#[derive(clap::Args, Debug, Clone)]
pub struct ConnectionArgs {
    /// Clients served at once (connections past the NBD handshake). One
    /// more that finishes its handshake is closed and counted as refused.
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_connections: u32,
    /// Connections still in the handshake at once, counted apart from the
    /// clients being served. A new one beyond this closes the oldest, so
    /// connections that never finish their handshake cannot lock real
    /// clients out.
    #[arg(long, default_value_t = DEFAULT_MAX_HANDSHAKES, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_handshakes: u32,
    /// Handshakes of one peer at once (an IP address over TCP, a user id on
    /// the Unix socket); a new one beyond this closes that peer's oldest.
    #[arg(long, default_value_t = DEFAULT_MAX_HANDSHAKES_PER_PEER, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_handshakes_per_peer: u32,
    /// A client that has not finished the handshake after this long is
    /// disconnected.
    #[arg(long, default_value_t = DEFAULT_HANDSHAKE_TIMEOUT_SECS, value_name = "SECONDS", value_parser = clap::value_parser!(u32).range(1..=3600))]
    pub handshake_timeout_secs: u32,
    /// Serve the volume read-only: clients see the read-only flag and every
    /// write, trim or zeroing is refused with EPERM. Write-back of data
    /// already in the cache goes on.
    #[arg(long)]
    pub read_only: bool,
}

impl Default for ConnectionArgs {
    fn default() -> Self {
        ConnectionArgs {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_handshakes: DEFAULT_MAX_HANDSHAKES,
            max_handshakes_per_peer: DEFAULT_MAX_HANDSHAKES_PER_PEER,
            handshake_timeout_secs: DEFAULT_HANDSHAKE_TIMEOUT_SECS,
            read_only: false,
        }
    }
}

impl ConnectionArgs {
    /// Put these limits into the server's configuration.
    pub fn apply(&self, config: &mut ServerConfig) {
        config.max_connections = self.max_connections as usize;
        config.max_handshakes = self.max_handshakes as usize;
        config.max_handshakes_per_peer = self.max_handshakes_per_peer as usize;
        config.handshake_timeout_ms = u64::from(self.handshake_timeout_secs) * 1000;
        config.read_only = self.read_only;
    }
}
