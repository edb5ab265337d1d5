//! Batched DART tree pruner (§4.3 of the method spec): per request, a beam search over the `[D, k]`
//! draft candidates scored by draft log-probabilities and an optional n-gram model, the top M nodes kept
//! (prefix-closed by construction), encoded as N = M + 1 nodes for SGLang's tree verify.
//!
//! * [`config`]: knobs and their per-level resolution and validation.
//! * [`search`]: the arena beam search and the deterministic order.
//! * [`encode`]: tokens / parents / depth / ancestor mask of one tree.
//! * [`graft`]: a chain from the request's own context grafted onto a searched tree.
//! * [`batch`]: input validation and rayon over requests.
//! * [`dict_model`]: a hash-map n-gram model (tests, benchmarks, Python-side tests).
pub mod batch;
pub mod config;
pub mod dict_model;
pub mod encode;
pub mod error;
pub mod graft;
pub mod search;

pub use batch::{
    prune_batch, prune_batch_with_chains, prune_single, BatchInput, ContextChains, TokenIds,
    TreeBatch,
};
pub use config::{PruneConfig, Resolved};
pub use dict_model::DictNgramModel;
pub use encode::TreeOut;
pub use error::PruneError;
pub use search::{Node, SearchScratch, TreeRequest};
