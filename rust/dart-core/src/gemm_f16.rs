//! `out = x @ w.T` in IEEE float16 for a few rows of `x` (1..=64): the linear layers of a float16 target's
//! decode and tree verification on a CPU. SGLang's `--dtype auto` serves a float32 checkpoint in float16
//! there, and no CPU of ours multiplies float16 natively: torch widens it row by row, so its float16
//! linears cost in proportion to their rows (all of SmolLM2-135M's layer shapes and its lm_head on the
//! 2-core AVX512-BF16 EPYC: 1.3 ms for one row, 10.7 for 8, 21.3 for 16, where bf16 took 1.8 to 2.7; this
//! product 1.2, 2.4 and 4.7 ms).
//!
//! Here each weight vector is widened to float32 as it is loaded (exact) and the input rows once per call,
//! float32 sums rounded once to float16 (nearest even): with AVX-512 in tiles of 16 lanes, up to 3 weight
//! rows and 8 input rows (`avx512`), else the float32 product's AVX2 tiles (8 lanes, F16C). As in the
//! other products, every output element is the same sequence of operations whatever the number of rows,
//! so a token gets the same bits verified in a tree or decoded alone. Without AVX2, FMA and F16C a
//! portable path computes the same products; it exists for correctness, not speed.

use crate::gemm::{blocked_product, GemmError};

/// float16 bits as a tile element (`gemm::avx2::Element`): a type of its own, because bf16 bits are the
/// other `u16` the tiles take.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct F16(pub u16);

/// Which kernel the float16 product runs here: `avx512`, `avx2-f16c` or `portable`.
pub fn kernel_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if avx512::available() {
            return "avx512";
        }
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
    if avx512::available() {
        return blocked_product(as_f16(x), w, out, rows, k, n, &|weights, block| {
            // SAFETY: `avx512::columns_block` needs AVX-512F, just detected on this CPU.
            unsafe { avx512::columns_block(&wide, weights, block, rows, k) }
        });
    }
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

/// float16 bits as `F16`s (the same memory).
pub fn as_f16(bits: &[u16]) -> &[F16] {
    // SAFETY: `F16` is `repr(transparent)` over `u16`: the same size, alignment and valid bit patterns,
    // so the same memory read as `F16`s is `bits.len()` valid values for the same lifetime.
    unsafe { std::slice::from_raw_parts(bits.as_ptr().cast::<F16>(), bits.len()) }
}

/// float16 bits as `F16`s (the same memory), to write.
pub fn as_f16_mut(bits: &mut [u16]) -> &mut [F16] {
    // SAFETY: as in `as_f16`; the exclusive borrow of `bits` moves to the returned slice.
    unsafe { std::slice::from_raw_parts_mut(bits.as_mut_ptr().cast::<F16>(), bits.len()) }
}

/// The product on the float32 product's AVX2 tiles alone (for the tests, where AVX-512 would take it).
#[cfg(all(test, target_arch = "x86_64"))]
fn avx2_product(x: &[u16], w: &[u16], out: &mut [u16], rows: usize, k: usize, n: usize) {
    assert!(crate::gemm::avx2::available());
    let wide: Vec<f32> = x.iter().map(|&bits| f16_to_f32(bits)).collect();
    blocked_product(
        as_f16(x),
        as_f16(w),
        as_f16_mut(out),
        rows,
        k,
        n,
        &|weights, block| {
            // SAFETY: AVX2, FMA and F16C, asserted above.
            unsafe { crate::gemm::avx2::columns_block(&wide, weights, block, rows, k) }
        },
    )
    .unwrap();
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

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{f16_to_f32, f32_to_f16, F16};
    use crate::gemm::{fold_lanes, PREFETCH_L2_BYTES};
    use std::arch::x86_64::{
        __m256i, __m512, _mm256_loadu_si256, _mm512_cvtph_ps, _mm512_fmadd_ps, _mm512_loadu_ps,
        _mm512_setzero_ps, _mm512_storeu_ps, _mm_prefetch, _MM_HINT_T1,
    };

    const LANES: usize = 16;
    /// Weight rows per tile: with 8 input rows, 24 accumulators, 3 weight vectors and an input vector
    /// take 28 of the 32 vector registers; each input vector loaded feeds 3 sums, each weight vector 8.
    const COLUMNS: usize = 3;

    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
    }

    /// `block` [columns, rows]: weight rows in threes (the last one or two alone) against input rows in
    /// tiles of up to 8.
    #[target_feature(enable = "avx512f")]
    pub(super) fn columns_block(x: &[f32], w: &[F16], block: &mut [F16], rows: usize, k: usize) {
        let columns = w.len() / k;
        let mut first = 0;
        while first < columns {
            let (weights, out) = (&w[first * k..], &mut block[first * rows..]);
            first += match columns - first {
                COLUMNS.. => column_tiles::<COLUMNS>(x, weights, out, rows, k),
                2 => column_tiles::<2>(x, weights, out, rows, k),
                _ => column_tiles::<1>(x, weights, out, rows, k),
            };
        }
    }

    /// All input rows against the first C weight rows of `weights`, into `out` ([C, rows]); returns C.
    #[target_feature(enable = "avx512f")]
    fn column_tiles<const C: usize>(
        x: &[f32],
        weights: &[F16],
        out: &mut [F16],
        rows: usize,
        k: usize,
    ) -> usize {
        let mut first = 0;
        while first < rows {
            let (tile_x, tile_out) = (&x[first * k..], &mut out[first..]);
            first += match rows - first {
                8.. => tile_dot::<8, C>(tile_x, weights, tile_out, rows, k),
                7 => tile_dot::<7, C>(tile_x, weights, tile_out, rows, k),
                6 => tile_dot::<6, C>(tile_x, weights, tile_out, rows, k),
                5 => tile_dot::<5, C>(tile_x, weights, tile_out, rows, k),
                4 => tile_dot::<4, C>(tile_x, weights, tile_out, rows, k),
                3 => tile_dot::<3, C>(tile_x, weights, tile_out, rows, k),
                2 => tile_dot::<2, C>(tile_x, weights, tile_out, rows, k),
                _ => tile_dot::<1, C>(tile_x, weights, tile_out, rows, k),
            };
        }
        C
    }

    /// 16 float16 values at `ptr`, widened to float32 (exact).
    ///
    /// # Safety
    /// `ptr..ptr + 16` must be readable values.
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(ptr: *const F16) -> __m512 {
        // SAFETY: the caller guarantees the 32 bytes at `ptr`; unaligned loads are allowed.
        _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(ptr.cast::<__m256i>()) })
    }

    /// Dot products of the first R rows of `x` (rows of `k`) with the first C rows of `weights`, into
    /// `out[c * stride + r]`; returns R. Each sum runs in the same order whatever R, C and the tile's
    /// place: 16 lanes along `k`, the lanes reduced in a fixed order, then the tail.
    #[target_feature(enable = "avx512f")]
    fn tile_dot<const R: usize, const C: usize>(
        x: &[f32],
        weights: &[F16],
        out: &mut [F16],
        stride: usize,
        k: usize,
    ) -> usize {
        assert!(x.len() >= R * k && weights.len() >= C * k && out.len() > (C - 1) * stride + R - 1);
        let mut acc: [[__m512; R]; C] = [[_mm512_setzero_ps(); R]; C];
        let body = k - k % LANES;
        for start in (0..body).step_by(LANES) {
            let mut wv: [__m512; C] = [_mm512_setzero_ps(); C];
            for (c, wv_c) in wv.iter_mut().enumerate() {
                // A prefetch is a hint: it never faults, even past the end of the weights.
                _mm_prefetch::<_MM_HINT_T1>(
                    weights
                        .as_ptr()
                        .wrapping_add(c * k + start + PREFETCH_L2_BYTES / size_of::<F16>())
                        .cast(),
                );
                // SAFETY: c * k + start + 16 <= c * k + body <= C * k <= weights.len() (asserted).
                *wv_c = unsafe { load16(weights.as_ptr().add(c * k + start)) };
            }
            for r in 0..R {
                // SAFETY: r * k + start + 16 <= (r + 1) * k <= R * k <= x.len() (asserted above).
                let xv = unsafe { _mm512_loadu_ps(x.as_ptr().add(r * k + start)) };
                for (acc_c, wv_c) in acc.iter_mut().zip(&wv) {
                    acc_c[r] = _mm512_fmadd_ps(*wv_c, xv, acc_c[r]);
                }
            }
        }
        for (c, acc_c) in acc.iter().enumerate() {
            let column = &weights[c * k..(c + 1) * k];
            for (r, acc_r) in acc_c.iter().enumerate() {
                let mut lanes = [0.0f32; LANES];
                // SAFETY: `lanes` holds exactly the 16 floats the store writes.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *acc_r) };
                let mut sum = fold_lanes(lanes);
                for i in body..k {
                    sum = f16_to_f32(column[i].0).mul_add(x[r * k + i], sum);
                }
                out[c * stride + r] = F16(f32_to_f16(sum));
            }
        }
        R
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::MAX_ROWS;

    /// `gemm`'s test values in [-1, 1), as float16 bits.
    fn values(len: usize, seed: u32) -> Vec<u16> {
        crate::gemm::tests::half_values(len, seed, f32_to_f16)
    }

    fn reference(x: &[u16], w: &[u16], rows: usize, k: usize, n: usize) -> Vec<f64> {
        crate::gemm::tests::half_reference(x, w, (rows, k, n), f16_to_f32)
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

    /// A float16 product as the tests call it: (x, w, out, rows, k, n).
    type Product = fn(&[u16], &[u16], &mut [u16], usize, usize, usize);

    fn public(x: &[u16], w: &[u16], out: &mut [u16], rows: usize, k: usize, n: usize) {
        skinny_matmul_f16(x, w, out, rows, k, n).unwrap();
    }

    /// The public product, and the AVX2 tiles on their own where AVX-512 takes the public one.
    fn products() -> Vec<Product> {
        let mut all: Vec<Product> = vec![public];
        #[cfg(target_arch = "x86_64")]
        if avx512::available() && crate::gemm::avx2::available() {
            all.push(avx2_product);
        }
        all
    }

    #[test]
    fn matches_a_float64_reference_for_every_tile_split() {
        for product in products() {
            assert_products_match_the_reference(product);
        }
    }

    fn assert_products_match_the_reference(product: Product) {
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
            product(&x, &w, &mut out, rows, k, n);
            assert_matches_the_reference(&x, &w, &out, rows, k);
        }
    }

    #[test]
    fn a_row_gets_the_same_bits_whatever_the_other_rows() {
        // Every row tile (1-8 rows; 9 = 8 + 1, 13 = 8 + 5, 16 = 8 + 8), tiles of 3 weight rows with 1 or
        // 2 left over (n = 200, 131), and tails past the 16- and 8-lane bodies (k = 100, 90).
        for product in products() {
            for (k, n) in [(96, 200), (100, 131), (90, 131)] {
                let x = values(16 * k, 3);
                let w = values(n * k, 4);
                for rows in [2, 3, 4, 5, 6, 7, 8, 9, 13, 16] {
                    let mut all = vec![0u16; rows * n];
                    product(&x[..rows * k], &w, &mut all, rows, k, n);
                    for m in 0..rows {
                        let mut alone = vec![0u16; n];
                        product(&x[m * k..(m + 1) * k], &w, &mut alone, 1, k, n);
                        assert_eq!(alone, all[m * n..(m + 1) * n], "row {m} of {rows}, k {k}");
                    }
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
