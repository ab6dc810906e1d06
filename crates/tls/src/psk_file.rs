//! Pre-shared keys in GnuTLS's `psktool` format: one `username:hexkey`
//! per line. The same file serves nbdkit's `--tls-psk`, qemu's
//! `tls-creds-psk` (`keys.psk` in its directory) and libnbd's
//! `tls-psk-file=`.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::TlsError;

/// OpenSSL's limit on a pre-shared key (PSK_MAX_PSK_LEN).
pub const MAX_PSK_BYTES: usize = 512;
/// OpenSSL's limit on a PSK identity (PSK_MAX_IDENTITY_LEN).
pub const MAX_IDENTITY_BYTES: usize = 128;
/// Lines read at most: a key file is a handful of users, not a database.
const MAX_LINES: usize = 65_536;

/// The keys of a PSK file. Debug never prints key bytes.
pub struct PskFile {
    path: PathBuf,
    entries: Vec<(String, Key)>,
}

/// Key bytes, overwritten when dropped.
struct Key(Vec<u8>);

impl Drop for Key {
    fn drop(&mut self) {
        for b in self.0.iter_mut() {
            // SAFETY: `b` is a valid, aligned, exclusive reference; the
            // volatile write keeps the compiler from eliding the wipe.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
    }
}

impl fmt::Debug for PskFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let users: Vec<&str> = self.entries.iter().map(|(u, _)| u.as_str()).collect();
        f.debug_struct("PskFile")
            .field("path", &self.path)
            .field("users", &users)
            .finish()
    }
}

impl PskFile {
    pub fn load(path: &Path) -> Result<PskFile, TlsError> {
        let text = std::fs::read_to_string(path).map_err(|source| TlsError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        warn_if_readable_by_others(path);
        Self::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<PskFile, TlsError> {
        let syntax = |line: usize, reason: &str| TlsError::PskFileSyntax {
            path: path.to_path_buf(),
            line,
            reason: reason.to_string(),
        };
        let mut entries: Vec<(String, Key)> = Vec::new();
        for (index, raw) in text.lines().enumerate().take(MAX_LINES) {
            let line_no = index + 1;
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((username, hex)) = line.split_once(':') else {
                return Err(syntax(line_no, "no `:` between the user name and the key"));
            };
            if username.is_empty() {
                return Err(syntax(line_no, "empty user name"));
            }
            if username.len() > MAX_IDENTITY_BYTES {
                return Err(syntax(line_no, "user name longer than 128 bytes"));
            }
            let key = decode_hex(hex).ok_or_else(|| {
                syntax(
                    line_no,
                    "the key is not an even number of hexadecimal digits",
                )
            })?;
            if key.0.is_empty() || key.0.len() > MAX_PSK_BYTES {
                return Err(syntax(line_no, "the key must be 1 to 512 bytes"));
            }
            if entries.iter().any(|(u, _)| u == username) {
                return Err(syntax(line_no, "the same user name twice"));
            }
            entries.push((username.to_string(), key));
        }
        if entries.is_empty() {
            return Err(TlsError::PskFileEmpty {
                path: path.to_path_buf(),
            });
        }
        Ok(PskFile {
            path: path.to_path_buf(),
            entries,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The key of `username`, if the file has one.
    pub fn key(&self, username: &[u8]) -> Option<&[u8]> {
        self.entries
            .iter()
            .find(|(u, _)| u.as_bytes() == username)
            .map(|(_, k)| k.0.as_slice())
    }
}

fn decode_hex(hex: &str) -> Option<Key> {
    if hex.len() % 2 != 0 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut key = Key(Vec::with_capacity(hex.len() / 2));
    for pair in hex.as_bytes().chunks_exact(2) {
        key.0.push(digit(pair[0])? << 4 | digit(pair[1])?);
    }
    Some(key)
}

fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.permissions().mode() & 0o077 != 0 {
            tracing::warn!(
                path = %path.display(),
                mode = format!("{:o}", meta.permissions().mode() & 0o777),
                "the pre-shared key file can be read by other users; chmod 600 it"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<PskFile, TlsError> {
        PskFile::parse(Path::new("keys.psk"), text)
    }

    #[test]
    fn reads_what_psktool_writes() {
        let f = parse("alice:0123456789abcdefABCDEF0123456789\nbob:00ff\n").unwrap();
        assert_eq!(f.key(b"bob"), Some(&[0x00, 0xff][..]));
        assert_eq!(f.key(b"alice").map(|k| k.len()), Some(16));
        assert_eq!(f.key(b"carol"), None);
        assert_eq!(f.key(b""), None);
        assert!(
            !format!("{f:?}").contains("00ff"),
            "Debug must not show keys"
        );
    }

    #[test]
    fn refuses_malformed_lines_naming_the_line() {
        for (text, line) in [
            ("alice", 1),
            ("\n:00ff", 2),
            ("alice:0g", 1),
            ("alice:abc", 1),
            ("alice:", 1),
            ("alice:00\nalice:11", 2),
        ] {
            match parse(text) {
                Err(TlsError::PskFileSyntax { line: l, .. }) => assert_eq!(l, line, "{text:?}"),
                other => panic!("{text:?}: {other:?}"),
            }
        }
        assert!(matches!(
            parse("# nothing\n\n"),
            Err(TlsError::PskFileEmpty { .. })
        ));
        let long_key = format!("u:{}", "00".repeat(MAX_PSK_BYTES + 1));
        assert!(parse(&long_key).is_err());
        let max_key = format!("u:{}", "00".repeat(MAX_PSK_BYTES));
        assert!(parse(&max_key).is_ok());
    }
}
