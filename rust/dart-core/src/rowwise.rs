//! The row-wise operations of a decoder layer on a CPU, one pass per row: RMSNorm (with the residual
//! add fused in), SiLU-and-multiply, and rotary position embedding, in float32, bfloat16 or float16.
//!
//! SGLang's CPU engine computes each as a string of torch operations (RMSNorm with a residual: about
//! ten), and at the few rows of a decode or tree verify each operation costs its dispatch, not its
//! arithmetic: in a batch-1 SmolLM2 server these took 38% of a step. Here each is one call.
//!
//! Every value is rounded where torch rounds it (bf16 results of bf16 operations; float32 inside the
//! RMSNorm, which upcasts), so the results are torch's up to the order of the RMSNorm's sum of squares
//! and the last bit of `exp`. A row never depends on the other rows of the call.

use crate::gemm_bf16::bf16_to_f32;
#[cfg(test)]
use crate::gemm_bf16::f32_to_bf16;

/// An element type of these operations: float32, bfloat16 held as its bits, or float16 (`F16`).
pub trait Element: Copy + Send + Sync {
    fn to_f32(self) -> f32;
    /// Rounded to this type (nearest even for bf16).
    fn from_f32(value: f32) -> Self;
}

impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        value
    }
}

impl Element for u16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16_to_f32(self)
    }
    /// `gemm_bf16::f32_to_bf16` without its early return, so that a row of them vectorises.
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        let bits = value.to_bits();
        let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
        let quiet_nan = (bits >> 16) | 0x0040;
        let is_nan = bits & 0x7fff_ffff > 0x7f80_0000;
        (if is_nan { quiet_nan } else { rounded }) as u16
    }
}

/// bf16 bits as a signed 16-bit integer: how a torch bf16 tensor reaches numpy without a copy
/// (`t.view(torch.int16).numpy()`).
impl Element for i16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        (self as u16).to_f32()
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        u16::from_f32(value) as i16
    }
}

/// float16 (SGLang's `--dtype auto` serves a float32 checkpoint in float16 on a CPU), rounded to nearest
/// even.
impl Element for crate::gemm_f16::F16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        crate::gemm_f16::f16_to_f32(self.0)
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        Self(crate::gemm_f16::f32_to_f16(value))
    }
}

/// Lanes of the partial sums: independent accumulators that the compiler keeps in one vector. The
/// lanes and their final sum are in a fixed order, so a row's result is the same on every CPU.
const SUM_LANES: usize = 16;

/// Sum of squares of `value(i)` for a row of `n`, in float32.
#[inline(always)]
fn sum_of_squares(n: usize, value: impl Fn(usize) -> f32) -> f32 {
    let mut partial = [0.0f32; SUM_LANES];
    let full = n / SUM_LANES * SUM_LANES;
    for base in (0..full).step_by(SUM_LANES) {
        for (lane, p) in partial.iter_mut().enumerate() {
            let v = value(base + lane);
            *p += v * v;
        }
    }
    for (lane, p) in partial.iter_mut().enumerate().take(n - full) {
        let v = value(full + lane);
        *p += v * v;
    }
    partial.iter().sum()
}

/// The operations' bodies, as compiled for any x86-64 (or other CPU) without runtime dispatch: the
/// dispatched versions below compile these same bodies for wider vectors, and the benchmark compares them.
pub mod portable {
    use super::*;

    #[inline(always)]
    pub fn rms_norm_row<T: Element>(
        x: &[T],
        weight: &[T],
        out: &mut [T],
        eps: f32,
        cast_before_weight: bool,
    ) {
        let n = x.len().min(weight.len()).min(out.len());
        let (x, weight, out) = (&x[..n], &weight[..n], &mut out[..n]);
        let mean = sum_of_squares(n, |i| x[i].to_f32()) / n as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
            let normed = v.to_f32() * scale;
            let normed = if cast_before_weight {
                T::from_f32(normed).to_f32()
            } else {
                normed
            };
            *o = T::from_f32(normed * w.to_f32());
        }
    }

    #[inline(always)]
    pub fn add_rms_norm_row<T: Element>(x: &mut [T], residual: &mut [T], weight: &[T], eps: f32) {
        let n = x.len().min(residual.len()).min(weight.len());
        let (x, residual, weight) = (&mut x[..n], &mut residual[..n], &weight[..n]);
        let mean = sum_of_squares(n, |i| x[i].to_f32() + residual[i].to_f32()) / n as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((a, b), w) in x.iter_mut().zip(residual.iter_mut()).zip(weight) {
            let s = a.to_f32() + b.to_f32();
            *b = T::from_f32(s);
            *a = T::from_f32(s * scale * w.to_f32());
        }
    }

    /// e^x in float32 to about 1 ulp, branch-free so that a row of them vectorises: x = n ln2 + r with
    /// |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial, times 2^n built in the exponent bits.
    #[inline(always)]
    pub(crate) fn exp_f32(x: f32) -> f32 {
        const LN2_HI: f32 = 0.693_145_75;
        const LN2_LO: f32 = 1.428_606_8e-6;
        // Adding and taking back 1.5 * 2^23 rounds to an integer (nearest even) with plain float
        // arithmetic, which every x86-64 vectorises (`f32::round` needs SSE4.1 or a libm call).
        const ROUND: f32 = 12_582_912.0;
        let clamped = x.clamp(-87.0, 88.0);
        let shifted = clamped * std::f32::consts::LOG2_E + ROUND;
        let n = shifted - ROUND;
        let r = (clamped - n * LN2_HI) - n * LN2_LO;
        let mut p = 1.0 / 5040.0;
        p = p * r + 1.0 / 720.0;
        p = p * r + 1.0 / 120.0;
        p = p * r + 1.0 / 24.0;
        p = p * r + 1.0 / 6.0;
        p = p * r + 0.5;
        p = p * r + 1.0;
        p = p * r + 1.0;
        // n sits in the low bits of `shifted` (ROUND's bits plus n): 2^n from integer operations alone.
        let exponent = shifted
            .to_bits()
            .wrapping_sub(ROUND.to_bits())
            .wrapping_add(127);
        let value = p * f32::from_bits(exponent << 23);
        // Past the clamp: 0 below (e^-87 is already 1.6e-38), infinity above.
        let value = if x > 88.72 { f32::INFINITY } else { value };
        if x < -87.0 {
            0.0
        } else {
            value
        }
    }

    #[inline(always)]
    pub fn silu_and_mul_row<T: Element>(x: &[T], out: &mut [T]) {
        let (gate, up) = x.split_at(out.len().min(x.len() / 2));
        for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
            let a = g.to_f32();
            let silu = T::from_f32(a / (1.0 + exp_f32(-a)));
            *o = T::from_f32(silu.to_f32() * u.to_f32());
        }
    }

    #[inline(always)]
    pub fn rotary_row<T: Element>(x: &mut [T], cos: &[T], sin: &[T], head_size: usize, neox: bool) {
        let half = cos.len().min(sin.len()).min(head_size / 2);
        let round = |v: f32| T::from_f32(v).to_f32();
        let rotate = |a: T, b: T, c: T, s: T| {
            let (a, b, c, s) = (a.to_f32(), b.to_f32(), c.to_f32(), s.to_f32());
            (
                T::from_f32(round(a * c) - round(b * s)),
                T::from_f32(round(b * c) + round(a * s)),
            )
        };
        for head in x.chunks_exact_mut(head_size.max(1)) {
            if neox {
                let (x1, rest) = head.split_at_mut(half);
                for (((a, b), c), s) in x1.iter_mut().zip(&mut rest[..half]).zip(cos).zip(sin) {
                    (*a, *b) = rotate(*a, *b, *c, *s);
                }
            } else {
                for ((pair, c), s) in head[..2 * half].chunks_exact_mut(2).zip(cos).zip(sin) {
                    (pair[0], pair[1]) = rotate(pair[0], pair[1], *c, *s);
                }
            }
        }
    }
}

/// Each public operation runs its `portable` body compiled for the widest vectors this CPU has. The
/// bodies do the same float operations in the same order whatever the width (no fused multiply-adds:
/// Rust never contracts `a * b + c`), so every version gives the same bits.
macro_rules! dispatch {
    ($(#[$doc:meta])* $name:ident($($arg:ident: $ty:ty),*)) => {
        $(#[$doc])*
        pub fn $name<T: Element>($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx2")]
                unsafe fn wide<T: Element>($($arg: $ty),*) {
                    portable::$name($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                unsafe fn avx2<T: Element>($($arg: $ty),*) {
                    portable::$name($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                {
                    // SAFETY: `wide` only enables AVX-512F/BW and AVX2, which this CPU has (AVX-512F
                    // implies AVX2; checked just above); its arguments are safe slices.
                    return unsafe { wide::<T>($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: as above, for AVX2.
                    return unsafe { avx2::<T>($($arg),*) };
                }
            }
            portable::$name($($arg),*)
        }
    };
}

dispatch! {
    /// `out = x / sqrt(mean(x²) + eps) * weight` for one row, in float32, rounded once to T (torch's
    /// `(x * rsqrt(var + eps) * w).to(dtype)`); with `cast_before_weight` the normalised row is rounded
    /// to T before the weight multiplies it, and the product rounded again (`w * (...).to(dtype)`, as
    /// HF's Llama and the DART drafter compute it).
    rms_norm_row(x: &[T], weight: &[T], out: &mut [T], eps: f32, cast_before_weight: bool)
}

dispatch! {
    /// The residual add fused into RMSNorm, in place as SGLang's fused kernels do it: `sum = x +
    /// residual` in float32, then `residual = sum` rounded to T and `x = rms_norm(sum)` normalised from
    /// the float32 sum (as torch's `RMSNorm.forward_native(x, residual)` computes it).
    add_rms_norm_row(x: &mut [T], residual: &mut [T], weight: &[T], eps: f32)
}

dispatch! {
    /// `out[j] = silu(x[j]) * x[half + j]` for one row of `2 * half` values, rounded as torch's
    /// `F.silu(a) * b` in T: silu in float32 rounded to T, then the product rounded to T.
    silu_and_mul_row(x: &[T], out: &mut [T])
}

dispatch! {
    /// Rotary embedding of one token's heads, in place: `x` holds `heads * head_size` values; the first
    /// `2 * cos.len()` of each head rotate by the angles whose cosines and sines are `cos`, `sin`, the
    /// rest stay. NeoX style pairs value i with i + cos.len(); GPT-J style pairs 2i with 2i + 1. Each
    /// product and sum is rounded to T, as torch's `x1 * cos - x2 * sin` in T.
    rotary_row(x: &mut [T], cos: &[T], sin: &[T], head_size: usize, neox: bool)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f32, rel: f32) -> bool {
        (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-30)
    }

    /// Deterministic values in [-10, 10): several binades, both signs.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        crate::gemm::tests::values(n, seed)
            .into_iter()
            .map(|v| v * 10.0)
            .collect()
    }

    #[test]
    fn exp_is_accurate_over_the_range() {
        let mut x = -87.0f32;
        while x < 88.0 {
            assert!(
                close(portable::exp_f32(x), x.exp(), 4e-7),
                "exp({x}) = {} vs {}",
                portable::exp_f32(x),
                x.exp()
            );
            x += 0.0137;
        }
        assert_eq!(portable::exp_f32(100.0), f32::INFINITY);
        assert_eq!(portable::exp_f32(-100.0), 0.0);
        assert_eq!(portable::exp_f32(0.0), 1.0);
    }

    #[test]
    fn bf16_rounding_is_the_gemm_module_s() {
        for v in values(10_000, 3)
            .into_iter()
            .chain([f32::NAN, f32::INFINITY, -0.0, 1e-40])
        {
            assert_eq!(u16::from_f32(v), f32_to_bf16(v), "{v}");
        }
    }

    #[test]
    fn rms_norm_matches_the_formula() {
        let x = values(577, 1);
        let w: Vec<f32> = (0..577).map(|i| 0.5 + (i % 7) as f32 / 10.0).collect();
        let mut out = vec![0.0; 577];
        rms_norm_row(&x, &w, &mut out, 1e-5, false);
        let mean = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 577.0;
        for i in 0..577 {
            let want = x[i] as f64 / (mean + 1e-5).sqrt() * w[i] as f64;
            assert!(
                close(out[i], want as f32, 1e-5),
                "{i}: {} vs {want}",
                out[i]
            );
        }
    }

    #[test]
    fn add_rms_norm_leaves_the_sum_and_its_norm() {
        let x: Vec<u16> = values(70, 2).iter().map(|v| f32_to_bf16(*v)).collect();
        let r: Vec<u16> = values(70, 5).iter().map(|v| f32_to_bf16(*v)).collect();
        let w = vec![f32_to_bf16(1.0); 70];
        let (mut out, mut res) = (x.clone(), r.clone());
        add_rms_norm_row(&mut out, &mut res, &w, 1e-6);
        let sums: Vec<f32> = (0..70)
            .map(|i| bf16_to_f32(x[i]) + bf16_to_f32(r[i]))
            .collect();
        let sums_bf16: Vec<u16> = sums.iter().map(|s| f32_to_bf16(*s)).collect();
        assert_eq!(res, sums_bf16);
        let mean = sums.iter().map(|s| s * s).sum::<f32>() / 70.0;
        for i in 0..70 {
            let (got, want) = (bf16_to_f32(out[i]), sums[i] / (mean + 1e-6).sqrt());
            assert!(close(got, want, 8e-3), "{i}: {got} vs {want}");
        }
    }

    #[test]
    fn silu_and_mul_rounds_as_torch() {
        let x: Vec<u16> = values(64, 4).iter().map(|v| f32_to_bf16(*v)).collect();
        let mut out = vec![0u16; 32];
        silu_and_mul_row(&x, &mut out);
        for j in 0..32 {
            let a = bf16_to_f32(x[j]) as f64;
            let silu = f32_to_bf16((a / (1.0 + (-a).exp())) as f32);
            let want = f32_to_bf16(bf16_to_f32(silu) * bf16_to_f32(x[32 + j]));
            assert_eq!(out[j], want, "{j}");
        }
    }

    #[test]
    fn rotary_rotates_pairs_and_keeps_the_rest() {
        // One head of 6, rotary over 4: pairs (0, 2), (1, 3) in NeoX style, (0, 1), (2, 3) in GPT-J's.
        let x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let (cos, sin) = ([0.0f32, 1.0], [1.0f32, 0.0]);
        let mut out = x;
        rotary_row(&mut out, &cos, &sin, 6, true);
        assert_eq!(out, [-3.0, 2.0, 1.0, 4.0, 5.0, 6.0]);
        let mut out = x;
        rotary_row(&mut out, &cos, &sin, 6, false);
        assert_eq!(out, [-2.0, 1.0, 3.0, 4.0, 5.0, 6.0]);
    }

    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        same_bits_on_every_instruction_set(f32_to_bf16);
        same_bits_on_every_instruction_set(|v| {
            crate::gemm_f16::F16(crate::gemm_f16::f32_to_f16(v))
        });
    }

    /// The dispatched operations against the portable ones, on values rounded by `round`.
    fn same_bits_on_every_instruction_set<T>(round: impl Fn(f32) -> T)
    where
        T: Element + Default + PartialEq + std::fmt::Debug,
    {
        let x: Vec<T> = values(3 * 1536 + 7, 6).iter().map(|v| round(*v)).collect();
        let w: Vec<T> = values(1536, 7).iter().map(|v| round(*v / 10.0)).collect();
        let (mut norm_wide, mut norm_portable) =
            (vec![T::default(); 1536], vec![T::default(); 1536]);
        for cast in [false, true] {
            rms_norm_row(&x[..1536], &w, &mut norm_wide, 1e-5, cast);
            portable::rms_norm_row(&x[..1536], &w, &mut norm_portable, 1e-5, cast);
            assert_eq!(norm_wide, norm_portable);
        }
        let (mut a, mut b) = (x[..1536].to_vec(), x[1536..3072].to_vec());
        let (mut c, mut d) = (a.clone(), b.clone());
        add_rms_norm_row(&mut a, &mut b, &w, 1e-5);
        portable::add_rms_norm_row(&mut c, &mut d, &w, 1e-5);
        assert_eq!((a, b), (c, d));
        let (mut silu_wide, mut silu_portable) =
            (vec![T::default(); 1536], vec![T::default(); 1536]);
        silu_and_mul_row(&x[..3072], &mut silu_wide);
        portable::silu_and_mul_row(&x[..3072], &mut silu_portable);
        assert_eq!(silu_wide, silu_portable);
        for neox in [true, false] {
            let (mut wide, mut scalar) = (x[..576].to_vec(), x[..576].to_vec());
            rotary_row(&mut wide, &w[..32], &w[32..64], 64, neox);
            portable::rotary_row(&mut scalar, &w[..32], &w[32..64], 64, neox);
            assert_eq!(wide, scalar);
        }
    }
}
