//! Argument types and parsers shared by the commands.

use clap::ValueEnum;

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
pub enum Mode {
    /// Writes are acknowledged once on the cache and written back later (default).
    Writeback,
    /// Writes are acknowledged once the origin has them; the cache keeps a clean copy.
    Writethrough,
    /// Writes go to the origin and drop cached copies; reads are cached.
    Writearound,
    /// The cache is not used for new data; dirty data is still served until drained.
    Passthrough,
}

impl Mode {
    pub fn engine(self) -> cairn_engine::CacheMode {
        match self {
            Mode::Writeback => cairn_engine::CacheMode::WriteBack,
            Mode::Writethrough => cairn_engine::CacheMode::WriteThrough,
            Mode::Writearound => cairn_engine::CacheMode::WriteAround,
            Mode::Passthrough => cairn_engine::CacheMode::PassThrough,
        }
    }
}

pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, shift) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 10),
        Some((i, 'M' | 'm')) => (&t[..i], 20),
        Some((i, 'G' | 'g')) => (&t[..i], 30),
        Some((i, 'T' | 't')) => (&t[..i], 40),
        _ => (t, 0),
    };
    let v: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size; use e.g. 4096, 64K, 4M, 1G or 2T"))?;
    v.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// OFFSET:LENGTH, each a size.
pub fn parse_range(s: &str) -> Result<(u64, u64), String> {
    let Some((a, b)) = s.split_once(':') else {
        return Err(format!("range {s:?} must be OFFSET:LENGTH, e.g. 0:64M"));
    };
    Ok((parse_size(a)?, parse_size(b)?))
}

/// A volume's name, its NBD export name: UTF-8 (clap checks), at most
/// `VOLUME_NAME_MAX_BYTES` bytes, and no control characters (a newline
/// in a name broke `volume list`'s table and the status lines).
pub fn parse_volume_name(s: &str) -> Result<String, String> {
    let max = cairn_format::VOLUME_NAME_MAX_BYTES;
    if s.len() > max {
        return Err(format!(
            "{} bytes; a volume name has at most {max}",
            s.len()
        ));
    }
    if let Some(c) = s.chars().find(|c| c.is_control()) {
        return Err(format!(
            "it holds the control character {c:?}; use printable characters"
        ));
    }
    Ok(s.to_string())
}

pub fn parse_block_size(s: &str) -> Result<u32, String> {
    let t = s.trim();
    let (num, mult) = match t.strip_suffix(['K', 'k']) {
        Some(n) => (n, 1024u64),
        None => (t, 1),
    };
    let v: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size; use e.g. 4K, 8K or 65536"))?;
    let bytes = v.saturating_mul(mult);
    if !bytes.is_power_of_two() || !(4096..=65536).contains(&bytes) {
        return Err(format!(
            "block size {bytes} is not a power of two between 4K and 64K; use 4K, 8K, 16K, 32K or 64K"
        ));
    }
    Ok(bytes as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_ranges() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("4m"), Ok(4 << 20));
        assert!(parse_size("99999999999G").is_err());
        assert!(parse_size("four").is_err());
        assert_eq!(parse_range("4M:1M"), Ok((4 << 20, 1 << 20)));
        assert!(parse_range("4M").unwrap_err().contains("OFFSET:LENGTH"));
        assert_eq!(parse_block_size("8K"), Ok(8192));
        assert!(parse_block_size("6K").unwrap_err().contains("power of two"));
        assert!(parse_block_size("99999999999999999K").is_err());
    }

    #[test]
    fn volume_names() {
        assert_eq!(parse_volume_name(""), Ok(String::new()));
        assert_eq!(parse_volume_name("db-1 ü"), Ok("db-1 ü".to_string()));
        let max = "n".repeat(cairn_format::VOLUME_NAME_MAX_BYTES);
        assert_eq!(parse_volume_name(&max), Ok(max.clone()));
        assert!(parse_volume_name(&format!("{max}n"))
            .unwrap_err()
            .contains("at most"));
        assert!(parse_volume_name("a\nb").unwrap_err().contains("control"));
        assert!(parse_volume_name("a\tb").is_err());
    }

    /// Hostile spellings are errors, never panics: empty, a bare suffix,
    /// multi-byte characters next to the suffix, overflow at the edge of
    /// u64 and of the shift, signs, separators.
    #[test]
    fn hostile_sizes_are_errors() {
        for s in [
            "",
            " ",
            "K",
            "m",
            "é",
            "4é",
            "éK",
            "4\u{2009}K",
            "-4K",
            "+",
            "4KK",
            "0x10",
            "1e3",
            "18446744073709551616",
            "18014398509481984K",
            "17179869184G",
        ] {
            assert!(parse_size(s).is_err(), "{s:?}");
        }
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
        assert_eq!(parse_size("17179869183G"), Ok(17179869183 << 30));
        for s in ["", ":", "4M:", ":4M", "4M:1M:1M", "é:é"] {
            assert!(parse_range(s).is_err(), "{s:?}");
        }
        for s in [
            "",
            "K",
            "éK",
            "-4K",
            "4294967296",
            "18446744073709551615K",
            "0",
        ] {
            assert!(parse_block_size(s).is_err(), "{s:?}");
        }
    }
}
