//! Python bindings of the n-gram store: `NgramStore`, `NgramBuilder`, `import_reference_trie`,
//! `NgramFormatError`. Every error becomes a Python exception (OSError for I/O, `NgramFormatError`
//! (a ValueError) for bad files, ValueError for bad arguments); nothing here panics on user input.
use std::path::PathBuf;
use std::sync::Arc;

use dart_core::store::format::SECTION_NAMES;
use dart_core::store::{
    import_reference, BuildOptions, NgramStore, StoreBuilder, StoreError, WriteStats,
};
use dart_core::NextTokenModel;
use numpy::ndarray::Array2;
use numpy::{AllowTypeChange, IntoPyArray, PyArray1, PyArray2, PyArrayLike1, PyArrayLike2};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

create_exception!(
    _core,
    NgramFormatError,
    PyValueError,
    "The file is not a valid DART n-gram store (foreign, truncated, corrupted, or another format version)."
);

fn to_py(e: StoreError) -> PyErr {
    match e {
        StoreError::Io(io) => io.into(),
        StoreError::Invalid(m) => PyValueError::new_err(m),
        other => NgramFormatError::new_err(other.to_string()),
    }
}

fn check_id(t: i64, vocab: u64, what: &str) -> PyResult<u32> {
    if t < 0 || t as u64 >= vocab {
        return Err(PyValueError::new_err(format!(
            "{what} id {t} out of range for vocab size {vocab}"
        )));
    }
    Ok(t as u32)
}

/// Last two context tokens: `None` for `prev2` when only one is known. Empty context → None.
fn context_of(ctx: &[i64], vocab: u64) -> PyResult<Option<(Option<u32>, u32)>> {
    match ctx.len() {
        0 => Ok(None),
        1 => Ok(Some((None, check_id(ctx[0], vocab, "context token")?))),
        n => Ok(Some((
            Some(check_id(ctx[n - 2], vocab, "context token")?),
            check_id(ctx[n - 1], vocab, "context token")?,
        ))),
    }
}

/// Read-only, memory-mapped 3-gram store. `NgramStore(path)` opens in O(1) (header checks only).
/// The one mapping of the file in this object is shared (`Arc`) with every pruner call given the object.
#[pyclass(name = "NgramStore", module = "sglang_dart._core", frozen)]
pub struct PyNgramStore {
    pub(crate) inner: Arc<NgramStore>,
    path: String,
}

#[pymethods]
impl PyNgramStore {
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let inner = py.detach(|| NgramStore::open(&path)).map_err(to_py)?;
        Ok(PyNgramStore {
            inner: Arc::new(inner),
            path: path.to_string_lossy().into_owned(),
        })
    }

    #[getter]
    fn path(&self) -> &str {
        &self.path
    }
    #[getter]
    fn order(&self) -> u32 {
        self.inner.header().order
    }
    #[getter]
    fn vocab_size(&self) -> u64 {
        self.inner.header().vocab_size
    }
    #[getter]
    fn tokenizer_fingerprint(&self) -> u64 {
        self.inner.header().tokenizer_fingerprint
    }
    #[getter]
    fn total_tokens(&self) -> u64 {
        self.inner.header().total_tokens
    }
    /// Nodes per level: (tokens with a count, bigrams, trigrams).
    #[getter]
    fn node_counts(&self) -> (u64, u64, u64) {
        let h = self.inner.header();
        (h.n1, h.n2, h.n3)
    }
    #[getter]
    fn num_nodes(&self) -> u64 {
        let h = self.inner.header();
        h.n1 + h.n2 + h.n3
    }
    #[getter]
    fn file_bytes(&self) -> u64 {
        self.inner.file_bytes()
    }
    #[getter]
    fn min_count(&self) -> u64 {
        self.inner.header().min_count
    }
    #[getter]
    fn imported(&self) -> bool {
        self.inner.header().flags & dart_core::store::format::FLAG_IMPORTED != 0
    }

    /// Header fields and section sizes as a dict.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let h = self.inner.header();
        let d = PyDict::new(py);
        d.set_item("path", &self.path)?;
        d.set_item("format_version", h.version)?;
        d.set_item("order", h.order)?;
        d.set_item("vocab_size", h.vocab_size)?;
        d.set_item("tokenizer_fingerprint", h.tokenizer_fingerprint)?;
        d.set_item("total_tokens", h.total_tokens)?;
        d.set_item("nodes_per_level", vec![h.n1, h.n2, h.n3])?;
        d.set_item("nodes", h.n1 + h.n2 + h.n3)?;
        d.set_item("file_bytes", h.file_len)?;
        d.set_item("min_count", h.min_count)?;
        d.set_item(
            "imported",
            h.flags & dart_core::store::format::FLAG_IMPORTED != 0,
        )?;
        d.set_item("l2_offset_width", h.l2_off_width)?;
        let secs = PyDict::new(py);
        for (i, s) in h.sections.iter().enumerate() {
            secs.set_item(SECTION_NAMES[i], s.len)?;
        }
        d.set_item("section_bytes", secs)?;
        Ok(d)
    }

    /// `P(t | context)` for each t in `tokens` (reference semantics: trigram MLE, back-off to bigram, else
    /// 0). Only the last two context tokens matter; one token → bigram only; empty → zeros.
    fn next_probs<'py>(
        &self,
        py: Python<'py>,
        context: PyArrayLike1<'py, i64, AllowTypeChange>,
        tokens: PyArrayLike1<'py, i64, AllowTypeChange>,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let v = self.inner.vocab_size();
        let ctx = context_of(context.as_slice()?, v)?;
        let toks = tokens
            .as_slice()?
            .iter()
            .map(|&t| check_id(t, v, "token"))
            .collect::<PyResult<Vec<u32>>>()?;
        let mut out = vec![0f32; toks.len()];
        if let Some((p2, p1)) = ctx {
            self.inner.next_probs(p2, p1, &toks, &mut out);
        }
        Ok(out.into_pyarray(py))
    }

    /// Batched `next_probs`: `contexts` int `[B, 2]` (columns prev2, prev1; prev2 = -1 means unknown) or
    /// `[B, 1]`, `tokens` int `[B, K]` → float32 `[B, K]`.
    fn batch_next_probs<'py>(
        &self,
        py: Python<'py>,
        contexts: PyArrayLike2<'py, i64, AllowTypeChange>,
        tokens: PyArrayLike2<'py, i64, AllowTypeChange>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let v = self.inner.vocab_size();
        let c = contexts.as_array();
        let t = tokens.as_array();
        let (b, w) = c.dim();
        let (bt, k) = t.dim();
        if b != bt || !(w == 1 || w == 2) {
            return Err(PyValueError::new_err(format!(
                "contexts must be [B, 2] or [B, 1] and tokens [B, K] with the same B; got {:?} and {:?}",
                c.dim(),
                t.dim()
            )));
        }
        let mut ctxs = Vec::with_capacity(b);
        for row in c.rows() {
            let p1 = check_id(row[w - 1], v, "context token")?;
            let p2 = if w == 2 && row[0] != -1 {
                Some(check_id(row[0], v, "context token")?)
            } else {
                None
            };
            ctxs.push((p2, p1));
        }
        let mut toks = Vec::with_capacity(b * k);
        for &x in t.iter() {
            toks.push(check_id(x, v, "token")?);
        }
        let store = &self.inner;
        let out = py.detach(|| {
            let mut out = vec![0f32; b * k];
            if k > 0 {
                for (i, (row, o)) in toks.chunks(k).zip(out.chunks_mut(k)).enumerate() {
                    store.next_probs(ctxs[i].0, ctxs[i].1, row, o);
                }
            }
            out
        });
        let arr = Array2::from_shape_vec((b, k), out)
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok(arr.into_pyarray(py))
    }

    /// The `k` most likely next tokens after `context`, as `[(token, prob), ...]`, probability descending.
    #[pyo3(signature = (context, k = 10))]
    fn top_next(
        &self,
        context: PyArrayLike1<'_, i64, AllowTypeChange>,
        k: usize,
    ) -> PyResult<Vec<(u32, f32)>> {
        let v = self.inner.vocab_size();
        Ok(match context_of(context.as_slice()?, v)? {
            Some((p2, p1)) => self.inner.top_next(p2, p1, k),
            None => Vec::new(),
        })
    }

    /// Count of a 1-, 2- or 3-gram (0 if absent or pruned).
    fn count(&self, ngram: Vec<i64>) -> PyResult<u64> {
        if ngram.is_empty() || ngram.len() > 3 {
            return Err(PyValueError::new_err("ngram must have 1 to 3 tokens"));
        }
        let v = self.inner.vocab_size();
        let ids = ngram
            .iter()
            .map(|&t| check_id(t, v, "token"))
            .collect::<PyResult<Vec<u32>>>()?;
        Ok(self.inner.count(&ids))
    }

    /// Full integrity check (checksums of every section, CSR structure). O(file size). Raises
    /// `NgramFormatError` on failure.
    fn verify(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.verify()).map_err(to_py)
    }

    /// Reads one byte per page of the file (cache warming / resident-size measurement).
    fn touch_all(&self, py: Python<'_>) -> u64 {
        py.detach(|| self.inner.touch_all())
    }

    fn __repr__(&self) -> String {
        let h = self.inner.header();
        format!(
            "NgramStore(path={:?}, vocab_size={}, nodes=({}, {}, {}), file_bytes={})",
            self.path, h.vocab_size, h.n1, h.n2, h.n3, h.file_len
        )
    }
}

fn stats_dict<'py>(py: Python<'py>, s: &WriteStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("nodes_per_level", vec![s.n1, s.n2, s.n3])?;
    d.set_item("nodes", s.n1 + s.n2 + s.n3)?;
    d.set_item("total_tokens", s.total_tokens)?;
    d.set_item("file_bytes", s.file_bytes)?;
    d.set_item("pruned", s.pruned)?;
    Ok(d)
}

fn build_options(
    vocab_size: u64,
    tokenizer_fingerprint: u64,
    min_count: u64,
    memory_budget: u64,
    tmp_dir: Option<PathBuf>,
) -> PyResult<BuildOptions> {
    if min_count == 0 {
        return Err(PyValueError::new_err("min_count must be >= 1"));
    }
    let mut o = BuildOptions::new(vocab_size);
    o.tokenizer_fingerprint = tokenizer_fingerprint;
    o.min_count = min_count;
    o.memory_budget = memory_budget;
    if let Some(d) = tmp_dir {
        o.tmp_dir = d;
    }
    Ok(o)
}

/// Counts documents of token ids into a new store, with bounded memory (sorted runs spill to `tmp_dir`).
#[pyclass(module = "sglang_dart._core")]
pub struct NgramBuilder {
    inner: Option<StoreBuilder>,
}

impl NgramBuilder {
    fn get(&mut self) -> PyResult<&mut StoreBuilder> {
        self.inner
            .as_mut()
            .ok_or_else(|| PyValueError::new_err("builder already finished"))
    }
}

fn to_ids(x: &[i64], v: u64) -> PyResult<Vec<u32>> {
    x.iter().map(|&t| check_id(t, v, "token")).collect()
}

#[pymethods]
impl NgramBuilder {
    #[new]
    #[pyo3(signature = (vocab_size, tokenizer_fingerprint = 0, min_count = 1, memory_budget = 1 << 30, tmp_dir = None))]
    fn new(
        vocab_size: u64,
        tokenizer_fingerprint: u64,
        min_count: u64,
        memory_budget: u64,
        tmp_dir: Option<PathBuf>,
    ) -> PyResult<Self> {
        let o = build_options(
            vocab_size,
            tokenizer_fingerprint,
            min_count,
            memory_budget,
            tmp_dir,
        )?;
        Ok(NgramBuilder {
            inner: Some(StoreBuilder::new(o).map_err(to_py)?),
        })
    }

    /// Adds one document (1-D ints). Its windows are counted like the reference's.
    fn add_document(
        &mut self,
        py: Python<'_>,
        tokens: PyArrayLike1<'_, i64, AllowTypeChange>,
    ) -> PyResult<()> {
        let b = self.get()?;
        let ids = to_ids(tokens.as_slice()?, b.vocab_size())?;
        py.detach(|| b.add_document(&ids)).map_err(to_py)
    }

    /// Adds many documents given flat token ids and `offsets` (len = docs + 1, offsets[0] = 0,
    /// non-decreasing, offsets[-1] = len(flat)).
    fn add_documents(
        &mut self,
        py: Python<'_>,
        flat: PyArrayLike1<'_, i64, AllowTypeChange>,
        offsets: PyArrayLike1<'_, i64, AllowTypeChange>,
    ) -> PyResult<()> {
        let b = self.get()?;
        let ids = to_ids(flat.as_slice()?, b.vocab_size())?;
        let offs = offsets.as_slice()?;
        let ok = !offs.is_empty()
            && offs[0] == 0
            && offs.windows(2).all(|w| w[0] <= w[1])
            && *offs.last().unwrap_or(&-1) == ids.len() as i64;
        if !ok {
            return Err(PyValueError::new_err(
                "offsets must start at 0, be non-decreasing and end at len(flat)",
            ));
        }
        py.detach(|| {
            for w in offs.windows(2) {
                b.add_document(&ids[w[0] as usize..w[1] as usize])?;
            }
            Ok(())
        })
        .map_err(to_py)
    }

    #[getter]
    fn tokens(&self) -> u64 {
        self.inner.as_ref().map_or(0, |b| b.tokens)
    }
    #[getter]
    fn documents(&self) -> u64 {
        self.inner.as_ref().map_or(0, |b| b.documents)
    }
    #[getter]
    fn spilled_runs(&self) -> usize {
        self.inner.as_ref().map_or(0, |b| b.spilled_runs())
    }

    /// Merges the counts and writes the store to `path` (atomically). Returns build statistics.
    fn finish<'py>(&mut self, py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyDict>> {
        let b = self
            .inner
            .take()
            .ok_or_else(|| PyValueError::new_err("builder already finished"))?;
        let s = py.detach(|| b.finish(&path)).map_err(to_py)?;
        stats_dict(py, &s)
    }
}

/// Converts a reference `.trie` file into a store, streaming with bounded memory.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // mirrors the Python keyword arguments
#[pyo3(signature = (src, dst, vocab_size, tokenizer_fingerprint = 0, min_count = 1, memory_budget = 1 << 30, tmp_dir = None))]
fn import_reference_trie<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    vocab_size: u64,
    tokenizer_fingerprint: u64,
    min_count: u64,
    memory_budget: u64,
    tmp_dir: Option<PathBuf>,
) -> PyResult<Bound<'py, PyDict>> {
    let o = build_options(
        vocab_size,
        tokenizer_fingerprint,
        min_count,
        memory_budget,
        tmp_dir,
    )?;
    let s = py
        .detach(|| import_reference(&src, &dst, &o))
        .map_err(to_py)?;
    let d = stats_dict(py, &s.written)?;
    d.set_item("reference_order", s.reference_order)?;
    d.set_item("reference_nodes", s.reference_nodes)?;
    d.set_item("clamped_negative", s.clamped)?;
    d.set_item("skipped_deep", s.skipped_deep)?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyNgramStore>()?;
    m.add_class::<NgramBuilder>()?;
    m.add_function(wrap_pyfunction!(import_reference_trie, m)?)?;
    m.add("NgramFormatError", m.py().get_type::<NgramFormatError>())?;
    Ok(())
}
