//! Memory-mapped 3-gram store: file format, reader (implements [`crate::NextTokenModel`]), bounded-memory
//! builder, and importer of the reference `.trie` files. The format is specified in `STORE_FORMAT.md`.
pub mod builder;
pub mod error;
pub mod format;
pub mod import;
pub mod reader;
pub mod reftrie;
mod sorter;
pub mod writer;

pub use builder::{BuildOptions, StoreBuilder};
pub use error::{Result, StoreError};
pub use import::{import_reference, ImportStats};
pub use reader::{NgramStore, Node};
pub use writer::WriteStats;
