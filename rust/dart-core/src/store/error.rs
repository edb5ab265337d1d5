//! Errors of the n-gram store. Every malformed input maps to one of these; the reader never panics on it.
use std::fmt;

#[derive(Debug)]
pub enum StoreError {
    /// The operating system refused a read/write/map.
    Io(std::io::Error),
    /// The file is not a DART n-gram store (wrong magic) — e.g. a foreign file or a reference `.trie`.
    BadMagic,
    /// A store written by another (future or past) version of the format.
    UnsupportedVersion(u32),
    /// Header or sections are inconsistent: truncated, corrupted, or checksum mismatch.
    Corrupt(String),
    /// The caller passed something invalid (vocab size, token id, options).
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, StoreError>;

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Io(e) => write!(f, "I/O error: {e}"),
            StoreError::BadMagic => write!(f, "not a DART n-gram store (bad magic)"),
            StoreError::UnsupportedVersion(v) => write!(
                f,
                "unsupported n-gram store format version {v} (this build reads version {})",
                super::format::VERSION
            ),
            StoreError::Corrupt(m) => write!(f, "corrupt n-gram store: {m}"),
            StoreError::Invalid(m) => write!(f, "invalid argument: {m}"),
        }
    }
}

impl std::error::Error for StoreError {}

impl From<std::io::Error> for StoreError {
    fn from(e: std::io::Error) -> Self {
        StoreError::Io(e)
    }
}

pub(crate) fn corrupt<T>(msg: impl Into<String>) -> Result<T> {
    Err(StoreError::Corrupt(msg.into()))
}

pub(crate) fn invalid<T>(msg: impl Into<String>) -> Result<T> {
    Err(StoreError::Invalid(msg.into()))
}
