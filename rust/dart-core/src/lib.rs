//! DART core: a memory-mapped 3-gram store and the batched tree pruner.
//! Pure Rust; the Python bindings live in the `dart-py` crate.

pub mod model;
pub mod prune;
pub mod store;

pub use model::NextTokenModel;
