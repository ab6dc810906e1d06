//! The cache modes.

/// How writes and reads use the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMode {
    /// Writes are acknowledged once on the cache and written back later.
    WriteBack,
    /// Writes are acknowledged once the origin has them; the cache keeps a
    /// clean copy.
    WriteThrough,
    /// Writes go to the origin and drop cached copies; reads are cached.
    WriteAround,
    /// The cache is not used for new data; cached (and dirty, until drained)
    /// blocks are still served.
    PassThrough,
}

impl CacheMode {
    pub const ALL: [CacheMode; 4] = [
        CacheMode::WriteBack,
        CacheMode::WriteThrough,
        CacheMode::WriteAround,
        CacheMode::PassThrough,
    ];

    pub fn code(self) -> u8 {
        match self {
            CacheMode::WriteBack => 0,
            CacheMode::WriteThrough => 1,
            CacheMode::WriteAround => 2,
            CacheMode::PassThrough => 3,
        }
    }

    pub fn from_code(code: u8) -> Option<CacheMode> {
        Self::ALL.into_iter().find(|m| m.code() == code)
    }

    pub fn name(self) -> &'static str {
        match self {
            CacheMode::WriteBack => "writeback",
            CacheMode::WriteThrough => "writethrough",
            CacheMode::WriteAround => "writearound",
            CacheMode::PassThrough => "passthrough",
        }
    }

    /// The name of a stored mode code (a volume table entry's), or
    /// "unknown" for a code this build does not know.
    pub fn name_of_code(code: u8) -> &'static str {
        CacheMode::from_code(code).map_or("unknown", CacheMode::name)
    }

    pub fn parse(name: &str) -> Option<CacheMode> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Do read misses get inserted into the cache in this mode?
    pub fn caches_reads(self) -> bool {
        self != CacheMode::PassThrough
    }

    /// Do writes keep a copy in the cache once written through?
    pub fn keeps_written_copy(self) -> bool {
        matches!(self, CacheMode::WriteBack | CacheMode::WriteThrough)
    }
}
