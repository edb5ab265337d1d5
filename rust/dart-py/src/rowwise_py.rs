//! Python bindings of `dart_core::rowwise`, one function per operation and element type
//! (`rms_norm_f32`, `rms_norm_bf16`, `rms_norm_f16`, ...). bf16 arrays hold the bits as int16: a torch bf16
//! tensor passes as `t.view(torch.int16).numpy()`, without a copy; float16 ones as uint16
//! (`t.view(torch.int16).numpy().view(numpy.uint16)`). Rows may be strided (the query slice of a fused qkv
//! projection) but each row must be contiguous. `add_rms_norm_*` and `rotary_*` write in place, as
//! SGLang's fused kernels do. The work is microseconds, so the GIL is kept: releasing and taking it
//! back would cost more.
use crate::bits::Bits;
use dart_core::rowwise;
use numpy::{PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

fn error(op: &str, message: String) -> PyErr {
    PyValueError::new_err(format!("{op}: {message}"))
}

fn contiguous<'a, T>(op: &str, name: &str, row: Option<&'a [T]>) -> PyResult<&'a [T]> {
    row.ok_or_else(|| error(op, format!("{name}'s rows are not contiguous")))
}

fn contiguous_mut<'a, T>(op: &str, name: &str, row: Option<&'a mut [T]>) -> PyResult<&'a mut [T]> {
    row.ok_or_else(|| error(op, format!("{name}'s rows are not contiguous")))
}

/// An array written by the call: one argument a Python caller may also pass as an input, or a
/// read-only array, which numpy's borrow check refuses (an error here, not a panic).
type Out<'py, T> = Bound<'py, PyArray2<T>>;

fn writable<'py, T: numpy::Element>(
    op: &str,
    name: &str,
    array: &Out<'py, T>,
) -> PyResult<PyReadwriteArray2<'py, T>> {
    array.try_readwrite().map_err(|e| {
        error(
            op,
            format!(
                "{name} cannot be written ({e}): pass a writeable array that is no other argument"
            ),
        )
    })
}

fn weight_of<'a, T>(
    op: &str,
    weight: &'a PyReadonlyArray1<'_, T>,
    width: usize,
) -> PyResult<&'a [T]>
where
    T: numpy::Element,
{
    weight
        .as_slice()
        .ok()
        .filter(|w| w.len() == width)
        .ok_or_else(|| error(op, format!("the weight must be contiguous, of {width}")))
}

fn rms_norm<T: Bits>(
    x: PyReadonlyArray2<'_, T>,
    weight: PyReadonlyArray1<'_, T>,
    out: Out<'_, T>,
    eps: f32,
    cast_before_weight: bool,
) -> PyResult<()> {
    const OP: &str = "rms_norm";
    let mut out = writable(OP, "out", &out)?;
    let (x, mut out) = (x.as_array(), out.as_array_mut());
    if x.shape() != out.shape() {
        return Err(error(
            OP,
            format!("x is {:?}, out {:?}", x.shape(), out.shape()),
        ));
    }
    let weight = weight_of(OP, &weight, x.shape()[1])?;
    for (x, mut out) in x.outer_iter().zip(out.outer_iter_mut()) {
        let x = contiguous(OP, "x", x.to_slice())?;
        let out = contiguous_mut(OP, "out", out.as_slice_mut())?;
        rowwise::rms_norm_row(
            T::compute(x),
            T::compute(weight),
            T::compute_mut(out),
            eps,
            cast_before_weight,
        );
    }
    Ok(())
}

fn add_rms_norm<T: Bits>(
    x: Out<'_, T>,
    residual: Out<'_, T>,
    weight: PyReadonlyArray1<'_, T>,
    eps: f32,
) -> PyResult<()> {
    const OP: &str = "add_rms_norm";
    let mut x = writable(OP, "x", &x)?;
    let mut residual = writable(OP, "residual", &residual)?;
    let (mut x, mut residual) = (x.as_array_mut(), residual.as_array_mut());
    if x.shape() != residual.shape() {
        return Err(error(
            OP,
            format!("x is {:?}, residual {:?}", x.shape(), residual.shape()),
        ));
    }
    let weight = weight_of(OP, &weight, x.shape()[1])?;
    for (mut x, mut residual) in x.outer_iter_mut().zip(residual.outer_iter_mut()) {
        rowwise::add_rms_norm_row(
            T::compute_mut(contiguous_mut(OP, "x", x.as_slice_mut())?),
            T::compute_mut(contiguous_mut(OP, "residual", residual.as_slice_mut())?),
            T::compute(weight),
            eps,
        );
    }
    Ok(())
}

fn silu_and_mul<T: Bits>(x: PyReadonlyArray2<'_, T>, out: Out<'_, T>) -> PyResult<()> {
    const OP: &str = "silu_and_mul";
    let mut out = writable(OP, "out", &out)?;
    let (x, mut out) = (x.as_array(), out.as_array_mut());
    if x.shape()[0] != out.shape()[0] || x.shape()[1] != 2 * out.shape()[1] {
        let message = format!(
            "x {:?} must be out {:?} twice as wide",
            x.shape(),
            out.shape()
        );
        return Err(error(OP, message));
    }
    for (x, mut out) in x.outer_iter().zip(out.outer_iter_mut()) {
        let x = contiguous(OP, "x", x.to_slice())?;
        let out = contiguous_mut(OP, "out", out.as_slice_mut())?;
        rowwise::silu_and_mul_row(T::compute(x), T::compute_mut(out));
    }
    Ok(())
}

fn rotary<T: Bits>(
    positions: PyReadonlyArray1<'_, i64>,
    cos_sin: PyReadonlyArray2<'_, T>,
    query: Out<'_, T>,
    key: Out<'_, T>,
    head_size: usize,
    neox: bool,
) -> PyResult<()> {
    const OP: &str = "rotary";
    let mut query = writable(OP, "query", &query)?;
    let mut key = writable(OP, "key", &key)?;
    let (positions, cos_sin) = (positions.as_array(), cos_sin.as_array());
    let (query, key) = (query.as_array_mut(), key.as_array_mut());
    let tokens = positions.len();
    let (table_rows, rotary_dim) = (cos_sin.shape()[0], cos_sin.shape()[1]);
    if query.shape()[0] != tokens || key.shape()[0] != tokens {
        let message = format!(
            "{tokens} positions for query {:?}, key {:?}",
            query.shape(),
            key.shape()
        );
        return Err(error(OP, message));
    }
    let fits = |width: usize| head_size > 0 && width.is_multiple_of(head_size);
    if !rotary_dim.is_multiple_of(2)
        || rotary_dim > head_size
        || !fits(query.shape()[1])
        || !fits(key.shape()[1])
    {
        let message = format!(
            "heads of {head_size} and a rotary width of {rotary_dim} do not fit query {:?}, key {:?}",
            query.shape(),
            key.shape()
        );
        return Err(error(OP, message));
    }
    let mut rows = Vec::with_capacity(tokens);
    for &position in positions.iter() {
        let row = usize::try_from(position)
            .ok()
            .filter(|p| *p < table_rows)
            .ok_or_else(|| {
                error(
                    OP,
                    format!("position {position} is outside the table of {table_rows}"),
                )
            })?;
        rows.push(row);
    }
    for (name, mut x) in [("query", query), ("key", key)] {
        for (mut x, &row) in x.outer_iter_mut().zip(&rows) {
            let angles = cos_sin.row(row);
            let (cos, sin) = contiguous(OP, "cos_sin", angles.to_slice())?.split_at(rotary_dim / 2);
            rowwise::rotary_row(
                T::compute_mut(contiguous_mut(OP, name, x.as_slice_mut())?),
                T::compute(cos),
                T::compute(sin),
                head_size,
                neox,
            );
        }
    }
    Ok(())
}

/// One Python function per element type: float32, bf16 as int16 bits and float16 as uint16 bits.
/// Arguments in brackets come first and are the same for all (the rotary's int64 positions).
macro_rules! typed {
    ($f32_name:ident, $bf16_name:ident, $f16_name:ident, $generic:ident, [$($pre:ident: $pre_ty:ty),*]
     ($($arg:ident: $ty:ident),*) $(, $extra:ident: $extra_ty:ty)*) => {
        #[pyfunction]
        fn $f32_name($($pre: $pre_ty,)* $($arg: $ty<'_, f32>,)* $($extra: $extra_ty),*) -> PyResult<()> {
            $generic($($pre,)* $($arg,)* $($extra),*)
        }
        #[pyfunction]
        fn $bf16_name($($pre: $pre_ty,)* $($arg: $ty<'_, i16>,)* $($extra: $extra_ty),*) -> PyResult<()> {
            $generic($($pre,)* $($arg,)* $($extra),*)
        }
        #[pyfunction]
        fn $f16_name($($pre: $pre_ty,)* $($arg: $ty<'_, u16>,)* $($extra: $extra_ty),*) -> PyResult<()> {
            $generic($($pre,)* $($arg,)* $($extra),*)
        }
    };
}

typed!(rms_norm_f32, rms_norm_bf16, rms_norm_f16, rms_norm, []
       (x: PyReadonlyArray2, weight: PyReadonlyArray1, out: Out), eps: f32, cast_before_weight: bool);
typed!(add_rms_norm_f32, add_rms_norm_bf16, add_rms_norm_f16, add_rms_norm, []
       (x: Out, residual: Out, weight: PyReadonlyArray1), eps: f32);
typed!(silu_and_mul_f32, silu_and_mul_bf16, silu_and_mul_f16, silu_and_mul, [] (x: PyReadonlyArray2, out: Out));
typed!(rotary_f32, rotary_bf16, rotary_f16, rotary, [positions: PyReadonlyArray1<'_, i64>]
       (cos_sin: PyReadonlyArray2, query: Out, key: Out), head_size: usize, neox: bool);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(rms_norm_f32, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(add_rms_norm_f32, m)?)?;
    m.add_function(wrap_pyfunction!(add_rms_norm_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(silu_and_mul_f32, m)?)?;
    m.add_function(wrap_pyfunction!(silu_and_mul_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(rotary_f32, m)?)?;
    m.add_function(wrap_pyfunction!(rotary_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm_f16, m)?)?;
    m.add_function(wrap_pyfunction!(add_rms_norm_f16, m)?)?;
    m.add_function(wrap_pyfunction!(silu_and_mul_f16, m)?)?;
    m.add_function(wrap_pyfunction!(rotary_f16, m)?)
}
