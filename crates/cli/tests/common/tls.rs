//! TLS credentials made at test time: a `psktool` key file, and an X.509
//! CA with server and client certificates (`scripts/tls-test-pki.sh`, with
//! the `openssl` command), in the directory layout nbdkit, qemu and libnbd
//! share.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::{run_ok, tool, Ctx};

const TIMEOUT: Duration = Duration::from_secs(60);

/// A key file for `user` (psktool picks a random 32-byte key).
pub fn psk_file(ctx: &Ctx, name: &str, user: &str) -> PathBuf {
    let path = ctx.path(name);
    let p = path.to_string_lossy().to_string();
    run_ok(tool("psktool").args(["-u", user, "-p", &p]), TIMEOUT);
    set_private(&path);
    path
}

/// qemu's tls-creds-psk wants a directory holding `keys.psk`.
pub fn qemu_psk_dir(ctx: &Ctx, keys: &Path, name: &str) -> PathBuf {
    let dir = ctx.path(name);
    std::fs::create_dir_all(&dir).expect("qemu psk dir");
    std::fs::copy(keys, dir.join("keys.psk")).expect("copying keys.psk");
    set_private(&dir.join("keys.psk"));
    dir
}

fn set_private(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod 600");
}

/// Credential directories under one test directory, made by
/// `scripts/tls-test-pki.sh` (shared with the benchmarks).
pub struct Pki {
    /// ca-cert.pem, server-cert.pem, server-key.pem (for localhost and
    /// 127.0.0.1).
    pub server: PathBuf,
    /// ca-cert.pem, client-cert.pem, client-key.pem (CN=alice).
    pub client: PathBuf,
    /// ca-cert.pem only: trusts the server, has no certificate.
    pub no_cert: PathBuf,
    /// A client certificate signed by another CA.
    pub rogue_client: PathBuf,
    /// Trusts the other CA only (not the server), with its certificate.
    pub trusts_rogue: PathBuf,
}

impl Pki {
    pub fn make(ctx: &Ctx) -> Pki {
        let root = ctx.path("pki");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/tls-test-pki.sh");
        run_ok(Command::new("sh").arg(&script).arg(&root), TIMEOUT);
        Pki {
            server: root.join("server"),
            client: root.join("client"),
            no_cert: root.join("no-cert"),
            rogue_client: root.join("rogue-client"),
            trusts_rogue: root.join("trusts-rogue"),
        }
    }
}
