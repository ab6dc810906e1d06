//! A throwaway single-node Ceph cluster for a test, from
//! `scripts/ceph-dev-cluster.sh`, stopped when dropped.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use super::{describe, require_tools, run, stdout, Ctx};

/// Starting a cluster takes seconds; allow for a loaded machine.
const CLUSTER_TIMEOUT: Duration = Duration::from_secs(180);

/// True if the Ceph daemons and tools are installed; else skip (or fail
/// under CI).
pub fn require_ceph(test: &str) -> bool {
    require_tools(test, &["ceph-mon", "ceph-osd", "ceph-mgr", "ceph", "rbd"])
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-dev-cluster.sh")
}

/// One running cluster, its files under the test's directory.
pub struct CephCluster {
    pub dir: PathBuf,
    pub conf: PathBuf,
}

impl CephCluster {
    pub fn start(ctx: &Ctx) -> CephCluster {
        let dir = ctx.path("ceph");
        let out = run(
            Command::new("bash").arg(script()).arg("start").arg(&dir),
            CLUSTER_TIMEOUT,
        );
        assert!(
            out.status.success(),
            "ceph-dev-cluster.sh start: {}",
            describe(&out)
        );
        let conf = PathBuf::from(stdout(&out).lines().last().unwrap_or_default().trim());
        assert!(
            conf.is_file(),
            "the script printed no conf path: {}",
            describe(&out)
        );
        CephCluster { dir, conf }
    }

    /// Run the cluster script's `verb` (pause-osd, resume-osd, ...).
    pub fn script(&self, verb: &str) -> Output {
        let out = run(
            Command::new("bash").arg(script()).arg(verb).arg(&self.dir),
            CLUSTER_TIMEOUT,
        );
        assert!(
            out.status.success(),
            "ceph-dev-cluster.sh {verb}: {}",
            describe(&out)
        );
        out
    }

    /// `rbd ARGS` against this cluster, which must succeed.
    pub fn rbd(&self, args: &[&str]) -> Output {
        self.client("rbd", args)
    }

    /// `ceph ARGS` against this cluster, which must succeed.
    pub fn ceph(&self, args: &[&str]) -> Output {
        self.client("ceph", args)
    }

    fn client(&self, tool: &str, args: &[&str]) -> Output {
        let out = run(
            Command::new(tool).env("CEPH_CONF", &self.conf).args(args),
            CLUSTER_TIMEOUT,
        );
        assert!(out.status.success(), "{tool} {args:?}: {}", describe(&out));
        out
    }

    /// The origin spec of `pool/image` on this cluster.
    pub fn spec(&self, image: &str) -> String {
        format!("rbd:rbd/{image}?conf={}", self.conf.display())
    }
}

impl Drop for CephCluster {
    fn drop(&mut self) {
        let _ = run(
            Command::new("bash")
                .arg(script())
                .arg("stop")
                .arg(&self.dir),
            CLUSTER_TIMEOUT,
        );
    }
}
