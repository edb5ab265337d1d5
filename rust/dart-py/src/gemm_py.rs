//! Python bindings of `dart_core::gemm::skinny_matmul`, `gemm_bf16::skinny_matmul_bf16` and
//! `gemm_f16::skinny_matmul_f16`: `skinny_matmul(x, w, out)` on float32 numpy arrays, the other two on
//! bf16 or float16 bits as uint16 (torch tensors pass through `.numpy()` without a copy). All run with the
//! GIL released.
use dart_core::{gemm, gemm_bf16, gemm_f16};
use numpy::{PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The (rows, k, n) of `out = x @ w.T`, once the shapes fit and every array is C-contiguous.
fn product_shape<T: numpy::Element>(
    x: &PyReadonlyArray2<'_, T>,
    w: &PyReadonlyArray2<'_, T>,
    out: &PyReadwriteArray2<'_, T>,
) -> PyResult<(usize, usize, usize)> {
    let (rows, k) = (x.shape()[0], x.shape()[1]);
    let n = w.shape()[0];
    if w.shape()[1] != k || out.shape() != [rows, n] {
        return Err(PyValueError::new_err(format!(
            "skinny matmul: x {:?}, w {:?}, out {:?} do not fit out = x @ w.T",
            x.shape(),
            w.shape(),
            out.shape()
        )));
    }
    // `as_slice` also takes Fortran-ordered arrays, whose flat order is not the row-major one read here.
    for (name, c_order) in [
        ("x", x.is_c_contiguous()),
        ("w", w.is_c_contiguous()),
        ("out", out.is_c_contiguous()),
    ] {
        if !c_order {
            return Err(PyValueError::new_err(format!(
                "skinny matmul: {name} is not C-contiguous"
            )));
        }
    }
    Ok((rows, k, n))
}

fn not_contiguous(_: numpy::NotContiguousError) -> PyErr {
    PyValueError::new_err("skinny matmul: an array is not contiguous")
}

/// out[m, j] = sum_i x[m, i] * w[j, i] for C-contiguous float32 x [rows, k], w [n, k], out [rows, n].
#[pyfunction]
fn skinny_matmul(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    w: PyReadonlyArray2<'_, f32>,
    mut out: PyReadwriteArray2<'_, f32>,
) -> PyResult<()> {
    let (rows, k, n) = product_shape(&x, &w, &out)?;
    let x = x.as_slice().map_err(not_contiguous)?;
    let w = w.as_slice().map_err(not_contiguous)?;
    let out = out.as_slice_mut().map_err(not_contiguous)?;
    py.detach(|| gemm::skinny_matmul(x, w, out, rows, k, n))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A half-precision product (`x, w, out, rows, k, n` on bits) as the bindings below call it.
type HalfProduct =
    fn(&[u16], &[u16], &mut [u16], usize, usize, usize) -> Result<(), gemm::GemmError>;

fn half_product(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, u16>,
    w: PyReadonlyArray2<'_, u16>,
    mut out: PyReadwriteArray2<'_, u16>,
    product: HalfProduct,
) -> PyResult<()> {
    let (rows, k, n) = product_shape(&x, &w, &out)?;
    let x = x.as_slice().map_err(not_contiguous)?;
    let w = w.as_slice().map_err(not_contiguous)?;
    let out = out.as_slice_mut().map_err(not_contiguous)?;
    py.detach(|| product(x, w, out, rows, k, n))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// The same product in bfloat16: x, w and out hold bf16 bits as uint16 (a torch bf16 tensor passes as
/// `t.view(torch.int16).numpy().view(numpy.uint16)`, without a copy); float32 sums, rounded once.
#[pyfunction]
fn skinny_matmul_bf16(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, u16>,
    w: PyReadonlyArray2<'_, u16>,
    out: PyReadwriteArray2<'_, u16>,
) -> PyResult<()> {
    half_product(py, x, w, out, gemm_bf16::skinny_matmul_bf16)
}

/// The same product in IEEE float16: x, w and out hold float16 bits as uint16 (a torch float16 tensor
/// passes as `t.view(torch.int16).numpy().view(numpy.uint16)`); float32 sums, rounded once.
#[pyfunction]
fn skinny_matmul_f16(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, u16>,
    w: PyReadonlyArray2<'_, u16>,
    out: PyReadwriteArray2<'_, u16>,
) -> PyResult<()> {
    half_product(py, x, w, out, gemm_f16::skinny_matmul_f16)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("SKINNY_MATMUL_MAX_ROWS", gemm::MAX_ROWS)?;
    // Whether the bf16 product runs its AVX512-BF16 kernel here (else a slow portable path).
    m.add("SKINNY_BF16_NATIVE", gemm_bf16::native_kernel())?;
    // Which kernel that is: `avx512-bf16`, `avx2` (widened to float32) or `portable` (slow).
    m.add("SKINNY_BF16_KERNEL", gemm_bf16::kernel_name())?;
    // Which kernel the float16 product runs: `avx512`, `avx2-f16c` (both widen to float32) or `portable`.
    m.add("SKINNY_F16_KERNEL", gemm_f16::kernel_name())?;
    m.add_function(wrap_pyfunction!(skinny_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(skinny_matmul_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(skinny_matmul_f16, m)?)
}
