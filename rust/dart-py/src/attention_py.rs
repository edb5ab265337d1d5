//! Python binding of `dart_core::attention::attend`: `attend_f32`, `attend_bf16` and `attend_f16` (half
//! precision as its bits, `bits::Bits`). Every array must be C-contiguous; shapes are read from them.
//! Runs with the GIL released.
use crate::bits::Bits;
use dart_core::attention::{self, Inputs, Shape};
use numpy::{PyArray3, PyArrayMethods, PyReadonlyArray2, PyReadonlyArray3, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

fn error(message: String) -> PyErr {
    PyValueError::new_err(format!("attention: {message}"))
}

fn flat<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    name: &str,
    array: &'a numpy::PyReadonlyArray<'_, T, D>,
) -> PyResult<&'a [T]> {
    if !array.is_c_contiguous() {
        return Err(error(format!("{name} is not C-contiguous")));
    }
    array
        .as_slice()
        .map_err(|_| error(format!("{name} is not contiguous")))
}

/// The plan's arrays: key_loc, mask, query_row, query_valid, and the scale.
type Plan<'py> = (
    PyReadonlyArray2<'py, i64>,
    PyReadonlyArray3<'py, bool>,
    PyReadonlyArray2<'py, i64>,
    PyReadonlyArray2<'py, bool>,
    f32,
);

fn attend<T: Bits>(
    py: Python<'_>,
    q: PyReadonlyArray3<'_, T>,
    k_cache: PyReadonlyArray3<'_, T>,
    v_cache: PyReadonlyArray3<'_, T>,
    (key_loc, mask, query_row, query_valid, scale): Plan<'_>,
    out: Bound<'_, PyArray3<T>>,
) -> PyResult<()> {
    let mut out = out.try_readwrite().map_err(|e| {
        error(format!(
            "out cannot be written ({e}): pass a writeable array that is no other argument"
        ))
    })?;
    let (qs, ks, vs, ms) = (q.shape(), k_cache.shape(), v_cache.shape(), mask.shape());
    let shape = Shape {
        requests: ms[0],
        queries: ms[1],
        keys: ms[2],
        rows: qs[0],
        heads: qs[1],
        kv_heads: ks[1],
        dim: qs[2],
        dim_v: vs[2],
        slots: ks[0],
    };
    let os = out.shape();
    if ks[2] != qs[2] || vs[..2] != ks[..2] || os != [qs[0], qs[1], vs[2]] {
        return Err(error(format!(
            "q {qs:?}, k_cache {ks:?}, v_cache {vs:?} and out {os:?} do not fit \
             [rows, heads, dim], [slots, kv_heads, dim], [slots, kv_heads, dim_v], [rows, heads, dim_v]"
        )));
    }
    for (name, s) in [
        ("key_loc", key_loc.shape()),
        ("query_row", query_row.shape()),
        ("query_valid", query_valid.shape()),
    ] {
        let want = if name == "key_loc" {
            [ms[0], ms[2]]
        } else {
            [ms[0], ms[1]]
        };
        if s != want {
            return Err(error(format!(
                "{name} is {s:?}, {want:?} expected for mask {ms:?}"
            )));
        }
    }
    let inputs = Inputs {
        q: T::compute(flat("q", &q)?),
        k_cache: T::compute(flat("k_cache", &k_cache)?),
        v_cache: T::compute(flat("v_cache", &v_cache)?),
        key_loc: flat("key_loc", &key_loc)?,
        mask: flat("mask", &mask)?,
        query_row: flat("query_row", &query_row)?,
        query_valid: flat("query_valid", &query_valid)?,
        scale,
    };
    if !out.is_c_contiguous() {
        return Err(error("out is not C-contiguous".into()));
    }
    let out = T::compute_mut(
        out.as_slice_mut()
            .map_err(|_| error("out is not contiguous".into()))?,
    );
    py.detach(|| attention::attend(&shape, &inputs, out))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// One Python function per element type: `attend_f32`, `attend_bf16` on bf16 bits (int16) and
/// `attend_f16` on float16 bits (uint16).
macro_rules! typed {
    ($(#[$doc:meta])* $name:ident, $t:ty) => {
        $(#[$doc])*
        #[pyfunction]
        #[allow(clippy::too_many_arguments)]
        fn $name(
            py: Python<'_>,
            q: PyReadonlyArray3<'_, $t>,
            k_cache: PyReadonlyArray3<'_, $t>,
            v_cache: PyReadonlyArray3<'_, $t>,
            key_loc: PyReadonlyArray2<'_, i64>,
            mask: PyReadonlyArray3<'_, bool>,
            query_row: PyReadonlyArray2<'_, i64>,
            query_valid: PyReadonlyArray2<'_, bool>,
            scale: f32,
            out: Bound<'_, PyArray3<$t>>,
        ) -> PyResult<()> {
            let args = (key_loc, mask, query_row, query_valid, scale);
            attend(py, q, k_cache, v_cache, args, out)
        }
    };
}

typed!(
    /// `out[row, h] = softmax(q[row, h] · K^T * scale | mask) V` for each valid query slot of each
    /// request, K and V read from the pool at `key_loc`; rows no valid slot names are left as they are.
    attend_f32,
    f32
);
typed!(
    /// `attend_f32` in bf16, the values as int16 bits; float32 inside, the output rounded once.
    attend_bf16,
    i16
);

typed!(
    /// `attend_f32` in float16, the values as uint16 bits; float32 inside, the output rounded once.
    attend_f16,
    u16
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(attend_f32, m)?)?;
    m.add_function(wrap_pyfunction!(attend_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(attend_f16, m)?)
}
