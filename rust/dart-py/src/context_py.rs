//! Python binding of `dart_core::context::ContextIndex`: `ContextIndex()` with `set(rid, tokens)`,
//! `extend(rid, tokens)`, `chains(rids, width)` (one `[bs, width]` int64 array, -1 padded),
//! `match_lens(rids, cap)` and `keep_only(rids)`. Token ids must be in [0, 2^24).
use dart_core::context::{ContextIndex, MAX_TOKEN};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray2};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

fn checked(tokens: Vec<i64>) -> PyResult<Vec<u32>> {
    if let Some(t) = tokens
        .iter()
        .find(|&&t| !(0..=i64::from(MAX_TOKEN)).contains(&t))
    {
        return Err(PyValueError::new_err(format!(
            "context token {t} is outside [0, 2^24)"
        )));
    }
    Ok(tokens.into_iter().map(|t| t as u32).collect())
}

#[pyclass(name = "ContextIndex", module = "sglang_dart._core")]
#[derive(Default)]
struct PyContextIndex {
    inner: ContextIndex,
}

#[pymethods]
impl PyContextIndex {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// The request's whole sequence (a continuation of the indexed one only appends the difference).
    fn set(&mut self, rid: &str, tokens: Vec<i64>) -> PyResult<()> {
        self.inner.set(rid, &checked(tokens)?);
        Ok(())
    }

    /// Tokens appended to the request's sequence.
    fn extend(&mut self, rid: &str, tokens: Vec<i64>) -> PyResult<()> {
        self.inner.extend(rid, &checked(tokens)?);
        Ok(())
    }

    /// Each request's chain (`dart_core::context`), at most `width` tokens, -1 after its end (all -1 for a
    /// request not indexed).
    fn chains<'py>(
        &self,
        py: Python<'py>,
        rids: Vec<String>,
        width: usize,
    ) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let mut out = Array2::from_elem((rids.len(), width), -1i64);
        for (r, rid) in rids.iter().enumerate() {
            let Some(seq) = self.inner.get(rid) else {
                continue; // not indexed: no chain
            };
            for (j, &t) in seq.chain(width).iter().enumerate() {
                out[[r, j]] = i64::from(t);
            }
        }
        Ok(out.into_pyarray(py))
    }

    /// Each request's match length (`ContextSequence::match_len`, at most `cap`; 0 for a request not
    /// indexed).
    fn match_lens(&self, rids: Vec<String>, cap: usize) -> Vec<usize> {
        rids.iter()
            .map(|rid| self.inner.get(rid).map_or(0, |seq| seq.match_len(cap)))
            .collect()
    }

    /// The request's indexed tokens.
    fn tokens(&self, rid: &str) -> Option<Vec<u32>> {
        self.inner.get(rid).map(|s| s.tokens().to_vec())
    }

    fn keep_only(&mut self, rids: Vec<String>) {
        let rids: Vec<&str> = rids.iter().map(String::as_str).collect();
        self.inner.keep_only(&rids);
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyContextIndex>()
}
