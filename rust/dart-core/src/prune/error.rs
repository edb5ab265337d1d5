//! Errors of the pruner: every invalid input or configuration is reported, never a panic.
use std::fmt;

/// A configuration or input error of the pruner. The message says what was wrong and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PruneError(pub String);

impl PruneError {
    pub fn new(msg: impl Into<String>) -> PruneError {
        PruneError(msg.into())
    }
}

impl fmt::Display for PruneError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PruneError {}

pub type Result<T> = std::result::Result<T, PruneError>;

/// Returns early with a [`PruneError`] built from a format string.
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::prune::error::PruneError(format!($($arg)*)))
    };
}
pub(crate) use bail;
