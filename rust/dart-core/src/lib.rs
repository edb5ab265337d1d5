//! DART core: a memory-mapped 3-gram store, the batched tree pruner, per-request context n-gram indexes, a few-row matmul, the
//! row-wise layer operations and the few-query attention for CPU serving.
//! Pure Rust; the Python bindings live in the `dart-py` crate.

pub mod attention;
pub mod context;
pub mod gemm;
pub mod gemm_bf16;
pub mod gemm_f16;
pub mod model;
pub mod prune;
pub mod rowwise;
pub mod store;
pub mod team;

pub use model::NextTokenModel;
