//! `out = x @ w.T` in IEEE float16 for a few rows of `x` (1..=64): the linear layers of a float16 target's
//! decode and tree verification on a CPU. SGLang's `--dtype auto` serves a float32 checkpoint in float16
//! there, and no CPU of ours multiplies float16 natively: torch widens it row by row, so its float16
//! linears cost in proportion to their rows (all of SmolLM2-135M's layer shapes and its lm_head on the
//! 2-core AVX512-BF16 EPYC: 1.5 ms for one row, 10.9 for 8, 21.7 for 16, where bf16 took 1.9 and 2.3).
//!
//! Here the float32 product's AVX2 tiles run it, each weight vector widened as it is loaded (F16C, exact)
//! and the input rows widened once per call, float32 sums rounded once to float16 (nearest even). As in
//! the other products, every output element is the same sequence of operations whatever the number of
//! rows, so a token gets the same bits verified in a tree or decoded alone. Without AVX2, FMA and F16C a
//! portable path computes the same products; it exists for correctness, not speed.

use crate::gemm::{blocked_product, GemmError};

/// float16 bits as a tile element (`gemm::avx2::Element`): a type of its own, because bf16 bits are the
/// other `u16` the tiles take.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct F16(pub u16);

/// Which kernel the float16 product runs here: `avx2-f16c` or `portable`.
pub fn kernel_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::gemm::avx2::available() {
            return "avx2-f16c";
        }
    }
    "portable"
}

/// float16 bits to float32 (exact, subnormals included).
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    let sign = u32::from(bits & 0x8000) << 16;
    let exponent = u32::from((bits >> 10) & 0x1f);
    let mantissa = u32::from(bits & 0x3ff);
    let magnitude = match exponent {
        // Zero or subnormal: mantissa * 2^-24, exact in float32.
        0 => (mantissa as f32 * f32::from_bits(0x3380_0000)).to_bits(),
        0x1f => 0x7f80_0000 | (mantissa << 13),
        _ => ((exponent + 112) << 23) | (mantissa << 13),
    };
    f32::from_bits(sign | magnitude)
}

/// float32 to float16 bits, rounding to nearest even; past the float16 range to infinity, below it to
/// (signed) zero through the subnormals; NaN stays a (quiet) NaN.
#[inline]
pub fn f32_to_f16(value: f32) -> u16 {
    let bits = value.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let magnitude = bits & 0x7fff_ffff;
    if magnitude > 0x7f80_0000 {
        return sign | 0x7e00 | ((magnitude >> 13) & 0x3ff) as u16;
    }
    let exponent = (magnitude >> 23) as i32; // biased by 127
    if exponent >= 143 {
        // |value| >= 2^16 (or infinite): past the largest float16, 65504.
        return sign | 0x7c00;
    }
    if exponent >= 113 {
        // A normal float16 (biased exponent 1..=30): drop 13 mantissa bits, rounding to nearest even. A
        // carry out of the mantissa lands in the exponent, which is the right neighbour (or infinity).
        let kept = (((exponent - 112) as u32) << 10) | ((magnitude >> 13) & 0x3ff);
        let dropped = magnitude & 0x1fff;
        let round_up = dropped > 0x1000 || (dropped == 0x1000 && kept & 1 == 1);
        return sign | (kept + u32::from(round_up)) as u16;
    }
    if exponent < 102 {
        // Below half the smallest subnormal (2^-25): rounds to zero.
        return sign;
    }
    // A subnormal float16 (units of 2^-24): the full significand shifted down, rounded to nearest even;
    // rounding up from the largest subnormal gives the smallest normal, whose bits follow on.
    let significand = (magnitude & 0x7f_ffff) | 0x80_0000;
    let shift = (126 - exponent) as u32; // 14..=24
    let kept = significand >> shift;
    let dropped = significand & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    let round_up = dropped > half || (dropped == half && kept & 1 == 1);
    sign | (kept + u32::from(round_up)) as u16
}

/// `out[m * n + j] = f16(sum_k x[m * k + i] * w[j * k + i])` for `rows` rows of `x` (`rows * k` float16
/// values as bits), `n` rows of `w` (`n * k`) and `out` of `rows * n`; blocks of weight rows are shared
/// out as in the float32 product (`gemm::blocked_product`).
pub fn skinny_matmul_f16(
    x: &[u16],
    w: &[u16],
    out: &mut [u16],
    rows: usize,
    k: usize,
    n: usize,
) -> Result<(), GemmError> {
    let wide: Vec<f32> = x.iter().map(|&bits| f16_to_f32(bits)).collect();
    let (w, out) = (as_f16(w), as_f16_mut(out));
    #[cfg(target_arch = "x86_64")]
    if crate::gemm::avx2::available() {
        return blocked_product(as_f16(x), w, out, rows, k, n, &|weights, block| {
            // SAFETY: `gemm::avx2::columns_block` needs AVX2, FMA and F16C, just detected on this CPU.
            unsafe { crate::gemm::avx2::columns_block(&wide, weights, block, rows, k) }
        });
    }
    blocked_product(as_f16(x), w, out, rows, k, n, &|weights, block| {
        portable_block(&wide, weights, block, rows, k)
    })
}

fn as_f16(bits: &[u16]) -> &[F16] {
    // SAFETY: `F16` is `repr(transparent)` over `u16`: the same size, alignment and valid bit patterns,
    // so the same memory read as `F16`s is `bits.len()` valid values for the same lifetime.
    unsafe { std::slice::from_raw_parts(bits.as_ptr().cast::<F16>(), bits.len()) }
}

fn as_f16_mut(bits: &mut [u16]) -> &mut [F16] {
    // SAFETY: as in `as_f16`; the exclusive borrow of `bits` moves to the returned slice.
    unsafe { std::slice::from_raw_parts_mut(bits.as_mut_ptr().cast::<F16>(), bits.len()) }
}

/// The product in portable code: float32 sums in order along `k`, rounded once.
fn portable_block(x: &[f32], w: &[F16], block: &mut [F16], rows: usize, k: usize) {
    for (weights, column) in w.chunks_exact(k).zip(block.chunks_exact_mut(rows)) {
        for (r, out) in column.iter_mut().enumerate() {
            let sum = x[r * k..(r + 1) * k]
                .iter()
                .zip(weights)
                .fold(0.0f32, |acc, (a, b)| a.mul_add(f16_to_f32(b.0), acc));
            *out = F16(f32_to_f16(sum));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::MAX_ROWS;

    /// `gemm`'s test values in [-1, 1), as float16 bits.
    fn values(len: usize, seed: u32) -> Vec<u16> {
        crate::gemm::tests::values(len, seed)
            .into_iter()
            .map(f32_to_f16)
            .collect()
    }

    fn reference(x: &[u16], w: &[u16], rows: usize, k: usize, n: usize) -> Vec<f64> {
        let mut out = vec![0.0f64; rows * n];
        for m in 0..rows {
            for j in 0..n {
                out[m * n + j] = (0..k)
                    .map(|i| f16_to_f32(x[m * k + i]) as f64 * f16_to_f32(w[j * k + i]) as f64)
                    .sum();
            }
        }
        out
    }

    #[test]
    fn every_float16_survives_the_round_trip() {
        for bits in 0..=u16::MAX {
            let wide = f16_to_f32(bits);
            if wide.is_nan() {
                assert!(f16_to_f32(f32_to_f16(wide)).is_nan(), "{bits:#06x}");
            } else {
                assert_eq!(f32_to_f16(wide), bits, "{bits:#06x} ({wide})");
            }
        }
    }

    #[test]
    fn rounding_to_float16_is_nearest_even() {
        assert_eq!(f32_to_f16(1.0), 0x3c00);
        assert_eq!(f32_to_f16(-2.0), 0xc000);
        // The smallest subnormal and the largest finite value.
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        // Halfway between neighbours, normal: 1 + 2^-11 lies between 1 and 1 + 2^-10 (ties to 1), 1 + 3 *
        // 2^-11 between 1 + 2^-10 and 1 + 2^-9 (ties up to the even one).
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00);
        assert_eq!(f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)), 0x3c02);
        assert_eq!(f32_to_f16(1.0 + 1.5 * 2f32.powi(-11)), 0x3c01);
        // Subnormal ties: 2^-25 (half the smallest) to zero, 3 * 2^-25 up to 2 * 2^-24, just above 2^-25
        // up to the smallest.
        assert_eq!(f32_to_f16(2f32.powi(-25)), 0x0000);
        assert_eq!(f32_to_f16(3.0 * 2f32.powi(-25)), 0x0002);
        assert_eq!(f32_to_f16(2f32.powi(-25) * 1.0001), 0x0001);
        assert_eq!(f32_to_f16(-2f32.powi(-26)), 0x8000);
        // The largest subnormal plus a half unit rounds into the smallest normal (even).
        assert_eq!(f32_to_f16(1023.5 * 2f32.powi(-24)), 0x0400);
        // Past the range: 65519 rounds to 65504, 65520 (the tie) and beyond to infinity.
        assert_eq!(f32_to_f16(65519.0), 0x7bff);
        assert_eq!(f32_to_f16(65520.0), 0x7c00);
        assert_eq!(f32_to_f16(-1e9), 0xfc00);
        assert_eq!(f32_to_f16(f32::INFINITY), 0x7c00);
        assert!(f16_to_f32(f32_to_f16(f32::NAN)).is_nan());
    }

    /// Within one float16 rounding of the result (2^-11 relative) plus float32 summation error of a
    /// float64 reference.
    fn assert_matches_the_reference(x: &[u16], w: &[u16], out: &[u16], rows: usize, k: usize) {
        let n = w.len() / k.max(1);
        for (got, want) in out.iter().zip(reference(x, w, rows, k, n)) {
            let got = f16_to_f32(*got) as f64;
            let tolerance = want.abs() / 2048.0 + 1e-4 * (k as f64).sqrt();
            assert!((got - want).abs() <= tolerance, "{got} vs {want}");
        }
    }

    #[test]
    fn matches_a_float64_reference_for_every_tile_split() {
        for (rows, k, n) in [
            (1, 32, 3),
            (3, 45, 70),
            (8, 576, 130),
            (13, 100, 65),
            (16, 1536, 20),
            (64, 64, 5),
        ] {
            let (x, w) = (values(rows * k, 1), values(n * k, 2));
            let mut out = vec![0u16; rows * n];
            skinny_matmul_f16(&x, &w, &mut out, rows, k, n).unwrap();
            assert_matches_the_reference(&x, &w, &out, rows, k);
        }
    }

    #[test]
    fn a_row_gets_the_same_bits_whatever_the_other_rows() {
        // 1-4 rows: one weight row per tile; from 5: tiles of 3 weight rows and 4 inputs, with 1 or 2
        // weight rows left over (n = 200, 131) and a tail past the 8-lane body (k = 100).
        for (k, n) in [(96, 200), (100, 131)] {
            let x = values(16 * k, 3);
            let w = values(n * k, 4);
            for rows in [2, 3, 4, 5, 7, 8, 9, 16] {
                let mut all = vec![0u16; rows * n];
                skinny_matmul_f16(&x[..rows * k], &w, &mut all, rows, k, n).unwrap();
                for m in 0..rows {
                    let mut alone = vec![0u16; n];
                    skinny_matmul_f16(&x[m * k..(m + 1) * k], &w, &mut alone, 1, k, n).unwrap();
                    assert_eq!(alone, all[m * n..(m + 1) * n], "row {m} of {rows}, k {k}");
                }
            }
        }
    }

    #[test]
    fn the_portable_path_matches_the_reference_too() {
        let (rows, k, n) = (5, 200, 40);
        let (x, w) = (values(rows * k, 5), values(n * k, 6));
        let wide: Vec<f32> = x.iter().map(|&b| f16_to_f32(b)).collect();
        let mut block = vec![F16::default(); rows * n];
        portable_block(&wide, as_f16(&w), &mut block, rows, k);
        let mut out = vec![0u16; rows * n];
        for j in 0..n {
            for m in 0..rows {
                out[m * n + j] = block[j * rows + m].0;
            }
        }
        assert_matches_the_reference(&x, &w, &out, rows, k);
    }

    #[test]
    fn wrong_lengths_and_too_many_rows_are_errors() {
        let mut out = vec![0u16; 4];
        assert!(skinny_matmul_f16(&[0; 7], &[0; 8], &mut out, 2, 4, 2).is_err());
        assert!(skinny_matmul_f16(&[0; 8], &[0; 8], &mut out[..3], 2, 4, 2).is_err());
        let rows = MAX_ROWS + 1;
        let mut big = vec![0u16; rows];
        let err = skinny_matmul_f16(&vec![0; rows], &[0x3c00], &mut big, rows, 1, 1).unwrap_err();
        assert!(err.to_string().contains("at most"));
    }

    #[test]
    fn empty_products_are_fine() {
        let mut out: Vec<u16> = vec![];
        skinny_matmul_f16(&[], &[0; 4], &mut out, 0, 4, 1).unwrap();
        skinny_matmul_f16(&[0; 4], &[], &mut out, 1, 4, 0).unwrap();
        let mut zeros = vec![0x3c00u16; 6];
        skinny_matmul_f16(&[], &[], &mut zeros, 2, 0, 3).unwrap();
        assert_eq!(zeros, vec![0u16; 6]);
    }
}
