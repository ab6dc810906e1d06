//! TLS credentials made at test time: a `psktool` key file, and an X.509
//! CA with server and client certificates (made with the `openssl`
//! command), in the directory layout nbdkit, qemu and libnbd share.

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

/// Credential directories under one test directory.
pub struct Pki {
    /// The other CA's certificate, kept to make a directory that trusts
    /// it alone.
    rogue_ca: PathBuf,
    /// ca-cert.pem, server-cert.pem, server-key.pem (for localhost and
    /// 127.0.0.1).
    pub server: PathBuf,
    /// ca-cert.pem, client-cert.pem, client-key.pem (CN=alice).
    pub client: PathBuf,
    /// ca-cert.pem only: trusts the server, has no certificate.
    pub no_cert: PathBuf,
    /// A client certificate signed by another CA.
    pub rogue_client: PathBuf,
}

impl Pki {
    pub fn make(ctx: &Ctx) -> Pki {
        let root = ctx.path("pki");
        let dir = |name: &str| {
            let d = root.join(name);
            std::fs::create_dir_all(&d).expect("pki dir");
            d
        };
        let (ca, rogue) = (dir("ca"), dir("rogue-ca"));
        make_ca(&ca, "cairn test CA");
        make_ca(&rogue, "rogue CA");
        let pki = Pki {
            rogue_ca: rogue.join("ca-cert.pem"),
            server: dir("server"),
            client: dir("client"),
            no_cert: dir("no-cert"),
            rogue_client: dir("rogue-client"),
        };
        // qemu insists on keyEncipherment even for EC keys.
        let usage = "keyUsage=critical,digitalSignature,keyEncipherment\n";
        make_leaf(
            &ca,
            &pki.server,
            "server",
            "localhost",
            &format!(
                "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n{usage}"
            ),
        );
        make_leaf(
            &ca,
            &pki.client,
            "client",
            "alice",
            &format!("extendedKeyUsage=clientAuth\n{usage}"),
        );
        make_leaf(
            &rogue,
            &pki.rogue_client,
            "client",
            "mallory",
            &format!("extendedKeyUsage=clientAuth\n{usage}"),
        );
        for d in [&pki.server, &pki.client, &pki.no_cert, &pki.rogue_client] {
            std::fs::copy(ca.join("ca-cert.pem"), d.join("ca-cert.pem")).expect("ca-cert.pem");
        }
        pki
    }

    /// A client directory whose ca-cert.pem is the other CA's (it does
    /// not trust the server), with a client certificate of that CA.
    pub fn rogue_ca_only(&self, ctx: &Ctx) -> PathBuf {
        let dir = ctx.path("pki/trusts-rogue");
        std::fs::create_dir_all(&dir).expect("pki dir");
        std::fs::copy(&self.rogue_ca, dir.join("ca-cert.pem")).expect("ca-cert.pem");
        for f in ["client-cert.pem", "client-key.pem"] {
            std::fs::copy(self.rogue_client.join(f), dir.join(f)).expect("client cert");
        }
        dir
    }
}

fn openssl(args: &[&str]) {
    run_ok(Command::new("openssl").args(args), TIMEOUT);
}

fn make_ca(dir: &Path, cn: &str) {
    let key = dir.join("ca-key.pem").to_string_lossy().to_string();
    let cert = dir.join("ca-cert.pem").to_string_lossy().to_string();
    let subject = format!("/CN={cn}");
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        &key,
        "-out",
        &cert,
        "-subj",
        &subject,
        "-days",
        "2",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ]);
}

fn make_leaf(ca: &Path, dir: &Path, prefix: &str, cn: &str, extensions: &str) {
    let path = |suffix: &str| {
        dir.join(format!("{prefix}{suffix}"))
            .to_string_lossy()
            .to_string()
    };
    let (key, csr, cert, ext) = (
        path("-key.pem"),
        path(".csr"),
        path("-cert.pem"),
        path(".ext"),
    );
    std::fs::write(&ext, extensions).expect("extensions file");
    let subject = format!("/CN={cn}");
    openssl(&[
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        &key,
        "-out",
        &csr,
        "-subj",
        &subject,
    ]);
    let ca_cert = ca.join("ca-cert.pem").to_string_lossy().to_string();
    let ca_key = ca.join("ca-key.pem").to_string_lossy().to_string();
    openssl(&[
        "x509",
        "-req",
        "-in",
        &csr,
        "-CA",
        &ca_cert,
        "-CAkey",
        &ca_key,
        "-CAcreateserial",
        "-out",
        &cert,
        "-days",
        "2",
        "-extfile",
        &ext,
    ]);
    let _ = std::fs::remove_file(&csr);
    let _ = std::fs::remove_file(&ext);
}
