//! DART core: a memory-mapped 3-gram store, the batched tree pruner, per-request context n-gram indexes, a few-row matmul and the
//! row-wise layer operations for CPU serving.
//! Pure Rust; the Python bindings live in the `dart-py` crate.

pub mod context;
pub mod gemm;
pub mod gemm_bf16;
pub mod model;
pub mod prune;
pub mod rowwise;
pub mod store;
pub mod team;

pub use model::NextTokenModel;
