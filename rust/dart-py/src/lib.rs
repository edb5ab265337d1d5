//! Python bindings: `sglang_dart._core`. Each submodule registers its own classes/functions.
use pyo3::prelude::*;

mod attention_py;
mod bits;
mod context_py;
mod gemm_py;
mod prune_py;
mod rowwise_py;
mod store_py;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    store_py::register(m)?;
    prune_py::register(m)?;
    gemm_py::register(m)?;
    context_py::register(m)?;
    rowwise_py::register(m)?;
    attention_py::register(m)?;
    Ok(())
}
