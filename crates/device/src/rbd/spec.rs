//! `rbd:POOL/[NAMESPACE/]IMAGE[?conf=PATH&id=CLIENT&keyring=PATH]`: which
//! image, and how to reach its cluster. The path is written as the `rbd`
//! command writes it.

use std::fmt;

/// A parsed RBD origin spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbdSpec {
    pub pool: String,
    /// The pool's namespace (`rbd namespace create POOL/NAMESPACE`);
    /// `None`: the pool's default one.
    pub namespace: Option<String>,
    pub image: String,
    /// The cluster configuration file; `None`: librados' own search
    /// (`$CEPH_CONF`, `/etc/ceph/ceph.conf`, ...).
    pub conf: Option<String>,
    /// The client id, without `client.` (`admin` by default).
    pub id: Option<String>,
    pub keyring: Option<String>,
    /// A request librbd has not finished after this long fails (and
    /// librados' own OSD and monitor timeouts default to it); `None`:
    /// [`DEFAULT_TIMEOUT_SECS`].
    pub timeout_secs: Option<u64>,
}

/// The request deadline without `timeout=`, as the NBD client's.
pub const DEFAULT_TIMEOUT_SECS: u64 = 30;

/// The longest `timeout=` accepted.
pub const MAX_TIMEOUT_SECS: u64 = 3600;

/// The spec's form, for errors.
const USAGE: &str =
    "expected rbd:POOL/[NAMESPACE/]IMAGE[?conf=PATH&id=CLIENT&keyring=PATH&timeout=SECS]";

/// The prefix that marks an RBD origin.
pub const RBD_PREFIX: &str = "rbd:";

impl RbdSpec {
    /// Whether `spec` names an RBD image rather than a path or NBD URI.
    pub fn is_rbd(spec: &str) -> bool {
        spec.len() >= RBD_PREFIX.len() && spec[..RBD_PREFIX.len()].eq_ignore_ascii_case(RBD_PREFIX)
    }

    pub fn parse(spec: &str) -> Result<RbdSpec, String> {
        if !RbdSpec::is_rbd(spec) {
            return Err(format!("{spec:?} does not start with {RBD_PREFIX}"));
        }
        if spec.contains('#') {
            // `#` ends the spec in the identity recorded at format time.
            return Err(format!("{spec:?}: '#' is not allowed in an RBD spec"));
        }
        let rest = &spec[RBD_PREFIX.len()..];
        let (path, query) = match rest.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (rest, None),
        };
        let (pool, namespace, image) = parse_path(spec, path)?;
        let mut parsed = RbdSpec {
            pool: pool.to_string(),
            namespace: namespace.map(str::to_string),
            image: image.to_string(),
            conf: None,
            id: None,
            keyring: None,
            timeout_secs: None,
        };
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| format!("{spec:?}: parameter {pair:?} has no value; {USAGE}"))?;
            if value.contains('?') {
                return Err(format!(
                    "{spec:?}: parameter {key:?} has a '?' in its value; separate parameters with '&' (rbd:POOL/IMAGE?conf=PATH&id=CLIENT)"
                ));
            }
            if value.is_empty() || value.bytes().any(|b| b == 0) {
                return Err(format!(
                    "{spec:?}: parameter {key:?} has an empty or invalid value"
                ));
            }
            if key == "timeout" {
                let secs = value
                    .parse::<u64>()
                    .ok()
                    .filter(|s| (1..=MAX_TIMEOUT_SECS).contains(s))
                    .ok_or_else(|| {
                        format!("{spec:?}: timeout={value} is not a number of seconds from 1 to {MAX_TIMEOUT_SECS}")
                    })?;
                if parsed.timeout_secs.replace(secs).is_some() {
                    return Err(format!("{spec:?}: parameter \"timeout\" given twice"));
                }
                continue;
            }
            let slot = match key {
                "conf" => &mut parsed.conf,
                "id" => &mut parsed.id,
                "keyring" => &mut parsed.keyring,
                _ => {
                    return Err(format!(
                        "{spec:?}: unknown parameter {key:?} (known: conf, id, keyring, timeout)"
                    ))
                }
            };
            if slot.replace(value.to_string()).is_some() {
                return Err(format!("{spec:?}: parameter {key:?} given twice"));
            }
        }
        if let Some(bare) = parsed
            .id
            .as_deref()
            .and_then(|id| id.strip_prefix("client."))
        {
            return Err(format!(
                "{spec:?}: id= names the client without \"client.\" (id={bare})"
            ));
        }
        Ok(parsed)
    }

    /// `client.ID`, as librados names the user.
    pub fn client_name(&self) -> String {
        format!("client.{}", self.id.as_deref().unwrap_or("admin"))
    }

    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.timeout_secs.unwrap_or(DEFAULT_TIMEOUT_SECS))
    }

    /// `POOL/[NAMESPACE/]IMAGE`, as the `rbd` command names the image.
    pub fn image_path(&self) -> String {
        match &self.namespace {
            Some(namespace) => format!("{}/{namespace}/{}", self.pool, self.image),
            None => format!("{}/{}", self.pool, self.image),
        }
    }

    /// `rbd:POOL/[NAMESPACE/]IMAGE`, without the connection parameters.
    pub fn image_name(&self) -> String {
        format!("{RBD_PREFIX}{}", self.image_path())
    }
}

/// `POOL/[NAMESPACE/]IMAGE` of `spec`: its parts, each checked.
fn parse_path<'a>(
    spec: &str,
    path: &'a str,
) -> Result<(&'a str, Option<&'a str>, &'a str), String> {
    let parts: Vec<&str> = path.split('/').collect();
    let (pool, namespace, image) = match parts[..] {
        [pool, image] => (pool, None, image),
        [pool, namespace, image] => (pool, Some(namespace), image),
        [_] => return Err(format!("{spec:?}: no image name; {USAGE}")),
        _ => return Err(format!("{spec:?}: too many '/' in the image path; {USAGE}")),
    };
    if pool.is_empty() || image.is_empty() || namespace.is_some_and(str::is_empty) {
        return Err(format!(
            "{spec:?}: empty pool, namespace or image name; {USAGE}"
        ));
    }
    if image.contains('@') {
        return Err(format!(
            "{spec:?}: a snapshot is read-only and cannot be an origin; {USAGE}"
        ));
    }
    for (what, name) in [
        ("pool", pool),
        ("namespace", namespace.unwrap_or("")),
        ("image", image),
    ] {
        if name.bytes().any(|b| b == 0 || b.is_ascii_control()) {
            return Err(format!("{spec:?}: the {what} name has control characters"));
        }
    }
    Ok((pool, namespace, image))
}

/// The spec as the identity records it: image and how the cluster is
/// reached, without `timeout=` (tuning, which may change between runs).
impl fmt::Display for RbdSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.image_name())?;
        let mut sep = '?';
        for (key, value) in [
            ("conf", &self.conf),
            ("id", &self.id),
            ("keyring", &self.keyring),
        ] {
            if let Some(value) = value {
                write!(f, "{sep}{key}={value}")?;
                sep = '&';
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_print_back() {
        let s = RbdSpec::parse("rbd:rbd/vol1").unwrap();
        assert_eq!((s.pool.as_str(), s.image.as_str()), ("rbd", "vol1"));
        assert_eq!(s.client_name(), "client.admin");
        assert_eq!(s.to_string(), "rbd:rbd/vol1");
        let full = "rbd:pool/img?conf=/tmp/c/ceph.conf&id=cairn&keyring=/tmp/k&timeout=5";
        let s = RbdSpec::parse(full).unwrap();
        assert_eq!(s.conf.as_deref(), Some("/tmp/c/ceph.conf"));
        assert_eq!(s.client_name(), "client.cairn");
        assert_eq!(s.timeout_secs, Some(5));
        assert_eq!(s.to_string(), full.trim_end_matches("&timeout=5"));
        assert_eq!(s.image_name(), "rbd:pool/img");
        assert_eq!(s.namespace, None);
        let s = RbdSpec::parse("rbd:pool/tenant/img?conf=/c").unwrap();
        assert_eq!(
            (s.pool.as_str(), s.namespace.as_deref(), s.image.as_str()),
            ("pool", Some("tenant"), "img")
        );
        assert_eq!(s.image_path(), "pool/tenant/img");
        assert_eq!(s.to_string(), "rbd:pool/tenant/img?conf=/c");
        assert!(RbdSpec::is_rbd("RBD:x/y"));
        assert!(!RbdSpec::is_rbd("/dev/rbd0"));
    }

    #[test]
    fn bad_specs_are_refused_with_the_reason() {
        for (spec, why) in [
            ("rbd:pool", "no image"),
            ("rbd:/img", "empty"),
            ("rbd:pool/", "empty"),
            ("rbd:pool/ns/img/x", "too many '/'"),
            ("rbd:pool//img", "empty pool, namespace"),
            ("rbd:pool/ns/img@snap", "snapshot"),
            ("rbd:pool/img@snap", "snapshot"),
            ("rbd:pool/img?conf", "no value"),
            ("rbd:pool/img?conf=", "empty"),
            ("rbd:pool/img?user=x", "unknown parameter"),
            ("rbd:pool/img?id=a&id=b", "twice"),
            ("rbd:pool/img?id=client.admin", "without \"client.\""),
            ("nbd://x", "does not start"),
            ("rbd:pool/img?conf=/a#b", "'#'"),
            ("rbd:pool/img?timeout=0", "from 1 to"),
            ("rbd:pool/img?timeout=x", "from 1 to"),
            ("rbd:pool/img?timeout=5&timeout=6", "twice"),
            (
                "rbd:pool/img?conf=/c?id=admin",
                "separate parameters with '&'",
            ),
            ("rbd:pool/img?id=admin?x=1", "separate parameters with '&'"),
        ] {
            let err = RbdSpec::parse(spec).unwrap_err();
            assert!(err.contains(why), "{spec}: {err}");
        }
    }
}
