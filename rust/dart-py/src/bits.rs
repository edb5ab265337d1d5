//! How the bindings take half-precision arrays: numpy has no bfloat16 and the `numpy` crate's float16
//! needs another dependency, so torch tensors pass as their bits (`t.view(torch.int16).numpy()`, no copy):
//! bf16 as int16, float16 as uint16 (`.view(numpy.uint16)`). `Bits` maps each numpy element type to the
//! type `dart_core` computes on.
use dart_core::gemm_f16::{as_f16, as_f16_mut, F16};
use dart_core::rowwise::Element;

/// A numpy element type and the type the operations compute on, which has its bits: float32 and bf16
/// (int16) themselves, float16 (uint16) as `F16`.
pub trait Bits: numpy::Element + Sized {
    type Compute: Element;
    fn compute(values: &[Self]) -> &[Self::Compute];
    fn compute_mut(values: &mut [Self]) -> &mut [Self::Compute];
}

impl Bits for f32 {
    type Compute = f32;
    fn compute(values: &[f32]) -> &[f32] {
        values
    }
    fn compute_mut(values: &mut [f32]) -> &mut [f32] {
        values
    }
}

impl Bits for i16 {
    type Compute = i16;
    fn compute(values: &[i16]) -> &[i16] {
        values
    }
    fn compute_mut(values: &mut [i16]) -> &mut [i16] {
        values
    }
}

impl Bits for u16 {
    type Compute = F16;
    fn compute(values: &[u16]) -> &[F16] {
        as_f16(values)
    }
    fn compute_mut(values: &mut [u16]) -> &mut [F16] {
        as_f16_mut(values)
    }
}
