//! Python bindings of the batched pruner: `prune_batch(...)` and the test/benchmark n-gram model
//! `DictNgramModel`. The compute runs with the GIL released; outputs are numpy arrays that own the Rust
//! buffers (no copy). Every error becomes a `ValueError` (`TypeError` for a wrong `store` type).
use std::sync::Arc;

use dart_core::prune::{
    self, BatchInput, ContextChains, DictNgramModel, PruneConfig, TokenIds, TreeBatch,
};
use dart_core::store::NgramStore;
use numpy::ndarray::{Array2, Array3};
use numpy::PyUntypedArrayMethods;
use numpy::{
    IntoPyArray, PyArray2, PyArray3, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::store_py::PyNgramStore;

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// In-memory order-3 n-gram model with the reference semantics (MLE trigram, back-off to the bigram).
/// For tests and benchmarks; production uses `NgramStore`.
#[pyclass(name = "DictNgramModel", module = "sglang_dart._core", frozen)]
pub struct PyDictNgramModel {
    inner: Arc<DictNgramModel>,
}

#[pymethods]
impl PyDictNgramModel {
    /// `counts`: dict mapping tuples of 1 to 3 token ids to counts ≥ 1 (every prefix counted too).
    #[new]
    #[pyo3(signature = (counts, vocab_size = None))]
    fn new(counts: &Bound<'_, PyDict>, vocab_size: Option<u64>) -> PyResult<Self> {
        let mut entries: Vec<(Vec<u32>, u64)> = Vec::with_capacity(counts.len());
        for (k, v) in counts.iter() {
            let ngram: Vec<u32> = k
                .cast::<PyTuple>()
                .map_err(|_| value_error("counts keys must be tuples of token ids"))?
                .extract()
                .map_err(|_| {
                    value_error(format!("counts key {k} must hold token ids in [0, 2^32)"))
                })?;
            let c: u64 = v
                .extract()
                .map_err(|_| value_error(format!("count of {k} must be an int >= 1")))?;
            entries.push((ngram, c));
        }
        let m = DictNgramModel::from_counts(entries.iter().map(|(g, c)| (&g[..], *c)), vocab_size)
            .map_err(value_error)?;
        Ok(Self { inner: Arc::new(m) })
    }

    /// Counts the 1/2/3-grams of every document (1-D int arrays) like the reference builder.
    #[staticmethod]
    #[pyo3(signature = (documents, vocab_size = None))]
    fn from_documents(
        py: Python<'_>,
        documents: Vec<PyReadonlyArray1<'_, i64>>,
        vocab_size: Option<u64>,
    ) -> PyResult<Self> {
        let mut docs: Vec<Vec<u32>> = Vec::with_capacity(documents.len());
        for (i, d) in documents.iter().enumerate() {
            let d = d.as_array();
            if let Some(t) = d.iter().find(|&&t| !(0..1 << 32).contains(&t)) {
                return Err(value_error(format!(
                    "documents[{i}] has token {t} outside [0, 2^32)"
                )));
            }
            docs.push(d.iter().map(|&t| t as u32).collect());
        }
        let m = py
            .detach(|| DictNgramModel::from_documents(docs.iter().map(|d| &d[..]), vocab_size))
            .map_err(value_error)?;
        Ok(Self { inner: Arc::new(m) })
    }

    /// `P(t | prev2, prev1)` for every t of `tokens` (float32 values as floats).
    #[pyo3(signature = (prev2, prev1, tokens))]
    fn next_probs(&self, prev2: Option<u32>, prev1: u32, tokens: Vec<u32>) -> Vec<f32> {
        use dart_core::NextTokenModel;
        let mut out = vec![0.0; tokens.len()];
        self.inner.next_probs(prev2, prev1, &tokens, &mut out);
        out
    }

    #[getter]
    fn vocab_size(&self) -> Option<u64> {
        self.inner.vocab_size()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

/// The n-gram model handed to the pruner.
enum Model {
    NoNgram,
    Dict(Arc<DictNgramModel>),
    Store(Arc<NgramStore>),
}

impl Model {
    fn from_py(store: Option<&Bound<'_, PyAny>>) -> PyResult<Model> {
        let Some(store) = store else {
            return Ok(Model::NoNgram);
        };
        if let Ok(m) = store.cast::<PyDictNgramModel>() {
            return Ok(Model::Dict(m.get().inner.clone()));
        }
        if let Ok(m) = store.cast::<PyNgramStore>() {
            return Ok(Model::Store(m.get().inner.clone()));
        }
        Err(PyTypeError::new_err(format!(
            "store must be None, an NgramStore or a DictNgramModel, got {}",
            store.get_type().name()?
        )))
    }

    fn vocab_size(&self) -> Option<u64> {
        match self {
            Model::NoNgram => None,
            Model::Dict(m) => m.vocab_size(),
            Model::Store(m) => Some(m.vocab_size()),
        }
    }

    fn run(
        &self,
        cfg: &PruneConfig,
        input: &BatchInput<'_>,
        chains: Option<&ContextChains<'_>>,
        vocab: Option<u64>,
    ) -> prune::error::Result<TreeBatch> {
        match self {
            Model::NoNgram => {
                prune::prune_batch_with_chains::<DictNgramModel>(cfg, None, input, chains, vocab)
            }
            Model::Dict(m) => prune::prune_batch_with_chains(cfg, Some(&**m), input, chains, vocab),
            Model::Store(m) => {
                prune::prune_batch_with_chains(cfg, Some(&**m), input, chains, vocab)
            }
        }
    }
}

enum Tokens<'py> {
    I32(PyReadonlyArray3<'py, i32>),
    I64(PyReadonlyArray3<'py, i64>),
}

type Trees<'py> = (
    Bound<'py, PyArray2<i64>>,
    Bound<'py, PyArray2<i32>>,
    Bound<'py, PyArray2<i32>>,
    Bound<'py, PyArray3<bool>>,
);

fn contiguous<'a, T>(
    r: Result<&'a [T], numpy::NotContiguousError>,
    name: &str,
) -> PyResult<&'a [T]> {
    r.map_err(|_| value_error(format!("{name} must be C-contiguous")))
}

/// Prunes a batch of draft trees. See `sglang_dart.pruner.prune_batch` for the documented API.
///
/// Returns `(tokens [bs, N] int64, parents [bs, N] int32, depth [bs, N] int32, tree_mask [bs, N, N] bool)`.
/// The pruner's defaults (Rust's `PruneConfig::default()`, the reference's values) as a dict.
#[pyfunction]
fn default_prune_config(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PruneConfig::default();
    let out = PyDict::new(py);
    out.set_item("topk", d.topk)?;
    out.set_item("beam_width", d.beam_width)?;
    out.set_item("num_nodes", d.num_nodes)?;
    out.set_item("ngram_weight", d.ngram_weight)?;
    out.set_item("level_weight_exponent", d.level_weight_exponent)?;
    out.set_item("logit_weight_base", d.logit_weight_base)?;
    out.set_item("eps", d.eps)?;
    out.set_item("ngram_at_level0", d.ngram_at_level0)?;
    out.set_item("level_weights", d.level_weights)?;
    out.set_item("logit_weights", d.logit_weights)?;
    Ok(out)
}

#[pyfunction]
#[pyo3(signature = (
    token_ids, probs, roots, context, eos_ids, *, store = None, vocab_size = None, topk = None,
    beam_width = None, num_nodes = None, ngram_weight = None, level_weight_exponent = None,
    logit_weight_base = None, eps = None, ngram_at_level0 = None, level_weights = None,
    logit_weights = None, chains = None, chain_nodes = 0
))]
#[allow(clippy::too_many_arguments)]
fn prune_batch<'py>(
    py: Python<'py>,
    token_ids: &Bound<'py, PyAny>,
    probs: &Bound<'py, PyAny>,
    roots: &Bound<'py, PyAny>,
    context: &Bound<'py, PyAny>,
    eos_ids: Vec<i64>,
    store: Option<&Bound<'py, PyAny>>,
    vocab_size: Option<u64>,
    topk: Option<usize>,
    beam_width: Option<usize>,
    num_nodes: Option<usize>,
    ngram_weight: Option<f64>,
    level_weight_exponent: Option<f64>,
    logit_weight_base: Option<f64>,
    eps: Option<f64>,
    ngram_at_level0: Option<bool>,
    level_weights: Option<Vec<f64>>,
    logit_weights: Option<Vec<f64>>,
    chains: Option<&Bound<'py, PyAny>>,
    chain_nodes: usize,
) -> PyResult<Trees<'py>> {
    let probs: PyReadonlyArray3<'py, f32> = probs
        .extract()
        .map_err(|_| value_error("probs must be a 3-D float32 numpy array [bs, D, k]"))?;
    let tokens = if let Ok(t) = token_ids.extract::<PyReadonlyArray3<'py, i64>>() {
        Tokens::I64(t)
    } else if let Ok(t) = token_ids.extract::<PyReadonlyArray3<'py, i32>>() {
        Tokens::I32(t)
    } else {
        return Err(value_error(
            "token_ids must be a 3-D int64 or int32 numpy array [bs, D, k]",
        ));
    };
    let roots: PyReadonlyArray1<'py, i64> = roots
        .extract()
        .map_err(|_| value_error("roots must be a 1-D int64 numpy array [bs]"))?;
    let context: PyReadonlyArray2<'py, i64> = context
        .extract()
        .map_err(|_| value_error("context must be a 2-D int64 numpy array [bs, 2]"))?;

    let shape = probs.shape().to_vec();
    let tok_shape = match &tokens {
        Tokens::I32(t) => t.shape().to_vec(),
        Tokens::I64(t) => t.shape().to_vec(),
    };
    if tok_shape != shape {
        return Err(value_error(format!(
            "token_ids shape {tok_shape:?} != probs shape {shape:?}"
        )));
    }
    let (bs, depth, k) = (shape[0], shape[1], shape[2]);
    if roots.shape() != [bs] {
        return Err(value_error(format!(
            "roots shape {:?} != [bs] = [{bs}]",
            roots.shape()
        )));
    }
    if context.shape() != [bs, 2] {
        return Err(value_error(format!(
            "context shape {:?} != [bs, 2] = [{bs}, 2]",
            context.shape()
        )));
    }
    let chains: Option<PyReadonlyArray2<'py, i64>> = chains
        .map(|c| {
            c.extract()
                .map_err(|_| value_error("chains must be a 2-D int64 numpy array [bs, width]"))
        })
        .transpose()?;
    if let Some(c) = &chains {
        if c.shape()[0] != bs {
            return Err(value_error(format!(
                "chains shape {:?} does not have bs = {bs} rows",
                c.shape()
            )));
        }
    }
    let model = Model::from_py(store)?;
    let vocab = vocab_size.or(model.vocab_size());
    // Unset knobs take `PruneConfig::default()`, the one place the defaults are written.
    let d = PruneConfig::default();
    let cfg = PruneConfig {
        topk: topk.or(d.topk),
        beam_width: beam_width.unwrap_or(d.beam_width),
        num_nodes: num_nodes.unwrap_or(d.num_nodes),
        ngram_weight: ngram_weight.unwrap_or(d.ngram_weight),
        level_weight_exponent: level_weight_exponent.unwrap_or(d.level_weight_exponent),
        logit_weight_base: logit_weight_base.unwrap_or(d.logit_weight_base),
        eps: eps.unwrap_or(d.eps),
        ngram_at_level0: ngram_at_level0.unwrap_or(d.ngram_at_level0),
        level_weights: level_weights.or(d.level_weights),
        logit_weights: logit_weights.or(d.logit_weights),
    };
    let token_slice = match &tokens {
        Tokens::I32(t) => TokenIds::I32(contiguous(t.as_slice(), "token_ids")?),
        Tokens::I64(t) => TokenIds::I64(contiguous(t.as_slice(), "token_ids")?),
    };
    let input = BatchInput {
        batch_size: bs,
        depth,
        k,
        token_ids: token_slice,
        probs: contiguous(probs.as_slice(), "probs")?,
        roots: contiguous(roots.as_slice(), "roots")?,
        context: contiguous(context.as_slice(), "context")?,
        eos_ids: &eos_ids,
    };
    let chain_input = match &chains {
        Some(c) => Some(ContextChains {
            tokens: contiguous(c.as_slice(), "chains")?,
            width: c.shape()[1],
            max_new: chain_nodes,
        }),
        None => None,
    };
    let out = py
        .detach(|| model.run(&cfg, &input, chain_input.as_ref(), vocab))
        .map_err(value_error)?;
    let n = out.n;
    let shape_err =
        |e: numpy::ndarray::ShapeError| value_error(format!("internal shape error: {e}"));
    Ok((
        Array2::from_shape_vec((bs, n), out.tokens)
            .map_err(shape_err)?
            .into_pyarray(py),
        Array2::from_shape_vec((bs, n), out.parents)
            .map_err(shape_err)?
            .into_pyarray(py),
        Array2::from_shape_vec((bs, n), out.depth)
            .map_err(shape_err)?
            .into_pyarray(py),
        Array3::from_shape_vec((bs, n, n), out.tree_mask)
            .map_err(shape_err)?
            .into_pyarray(py),
    ))
}

/// Number of pool candidates a tree of `depth` levels with `k` columns has under these knobs.
#[pyfunction]
#[pyo3(signature = (depth, k, *, topk = None, beam_width = 20))]
fn candidate_count(depth: usize, k: usize, topk: Option<usize>, beam_width: usize) -> u64 {
    PruneConfig {
        topk,
        beam_width,
        ..Default::default()
    }
    .candidate_count(depth, k)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDictNgramModel>()?;
    m.add_function(wrap_pyfunction!(prune_batch, m)?)?;
    m.add_function(wrap_pyfunction!(candidate_count, m)?)?;
    m.add_function(wrap_pyfunction!(default_prune_config, m)?)?;
    Ok(())
}
