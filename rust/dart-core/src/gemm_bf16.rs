//! `out = x @ w.T` in bfloat16 for a few rows of `x` (1..=64): the linear layers of a bf16 target's
//! decode at small batches and of its tree verification.
//!
//! On the 2-core EPYC with AVX512-BF16 torch's bf16 linears ran 4-6x slower than the memory holding the
//! weights can be read (all of SmolLM2-135M's linears: 23 ms for one row, 28 ms for 8, where summing the
//! same 269 MB took 5 ms; benchmarks/results/throughput.md, run 43). Here each weight row is read once
//! and multiplied into every input row while it is in L1, 32 bf16 pairs per `vdpbf16ps`, with float32
//! accumulators, then rounded once to bf16 (nearest even), as torch rounds its float32 sums.
//!
//! Every output element is computed by the same sequence of operations whatever the number of rows and
//! wherever its row falls in a tile, so a row's result does not depend on the other rows of the call: a
//! token gets bit-identical linears whether it is verified in a tree of 8 or decoded alone.
//! Without AVX512-BF16 but with AVX2 and FMA (AVX2-only EPYCs, AVX-512 Xeons before Cooper Lake) the
//! float32 product's AVX2 tiles run it: the input rows widened to float32 once per call, each weight
//! vector as it is loaded (exact both), float32 sums rounded once. There torch's bf16 linears cost in
//! proportion to their rows (all of SmolLM2-135M's linears and its lm_head on the 2-core AVX2 EPYC: 17-21
//! ms for one row, 116-143 for 8), these 16-21 and 26-37 ms (`benchmarks/results/throughput.md`, run
//! 119). Elsewhere a portable path computes the same products; it exists for correctness, not speed
//! (`kernel_name` says which one runs).

#[cfg(test)]
use crate::gemm::MAX_ROWS;
use crate::gemm::{blocked_product, GemmError};

/// bf16 values per 512-bit vector.
const LANES: usize = 32;

/// Whether this CPU runs the AVX512-BF16 kernel (else the portable path runs).
pub fn native_kernel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Which kernel the bf16 product runs here: `avx512-bf16` (dot products in bf16), `avx2` (the float32
/// product's tiles, each weight widened to float32 as it is loaded) or `portable`.
pub fn kernel_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if native_kernel() {
            return "avx512-bf16";
        }
        if crate::gemm::avx2::available() {
            return "avx2";
        }
    }
    "portable"
}

/// bf16 bits to float32 (exact).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// float32 to bf16 bits, rounding to nearest even; NaN stays a (quiet) NaN.
#[inline]
pub fn f32_to_bf16(value: f32) -> u16 {
    let bits = value.to_bits();
    if value.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let rounding = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

/// `out[m * n + j] = bf16(sum_k x[m * k + i] * w[j * k + i])` for `rows` rows of `x` (`rows * k` bf16
/// values as bits), `n` rows of `w` (`n * k`) and `out` of `rows * n`; blocks of weight rows are shared
/// out as in the float32 product (`gemm::blocked_product`).
pub fn skinny_matmul_bf16(
    x: &[u16],
    w: &[u16],
    out: &mut [u16],
    rows: usize,
    k: usize,
    n: usize,
) -> Result<(), GemmError> {
    let native = native_kernel();
    #[cfg(target_arch = "x86_64")]
    if !native && crate::gemm::avx2::available() {
        return widened_product(x, w, out, rows, k, n);
    }
    blocked_product(x, w, out, rows, k, n, &|weights, block| {
        #[cfg(target_arch = "x86_64")]
        if native {
            // SAFETY: both block functions need AVX-512F and AVX512-BF16, which `native_kernel`
            // detected on this CPU.
            unsafe {
                if rows >= avx512::PAIRED_FROM_ROWS {
                    avx512::paired_columns_block(x, weights, block, rows, k);
                } else {
                    avx512::columns_block(x, weights, block, rows, k);
                }
            }
            return;
        }
        let _ = native;
        portable_block(x, weights, block, rows, k);
    })
}

/// The product on the float32 tiles (AVX2 and FMA: the caller checks, this asserts), the inputs widened
/// to float32 once (exact), not in every tile that reads them.
#[cfg(target_arch = "x86_64")]
fn widened_product(
    x: &[u16],
    w: &[u16],
    out: &mut [u16],
    rows: usize,
    k: usize,
    n: usize,
) -> Result<(), GemmError> {
    assert!(
        crate::gemm::avx2::available(),
        "the widened bf16 product needs AVX2, FMA and F16C"
    );
    let wide: Vec<f32> = x.iter().map(|&bits| bf16_to_f32(bits)).collect();
    blocked_product(x, w, out, rows, k, n, &|weights, block| {
        // SAFETY: `gemm::avx2::columns_block` needs AVX2, FMA and F16C, asserted above.
        unsafe { crate::gemm::avx2::columns_block(&wide, weights, block, rows, k) }
    })
}

fn portable_block(x: &[u16], w: &[u16], block: &mut [u16], rows: usize, k: usize) {
    for (weights, column) in w.chunks_exact(k).zip(block.chunks_exact_mut(rows)) {
        for (r, out) in column.iter_mut().enumerate() {
            let sum = x[r * k..(r + 1) * k]
                .iter()
                .zip(weights)
                .fold(0.0f32, |acc, (a, b)| {
                    bf16_to_f32(*a).mul_add(bf16_to_f32(*b), acc)
                });
            *out = f32_to_bf16(sum);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{bf16_to_f32, f32_to_bf16, LANES};
    use crate::gemm::PREFETCH_L2_BYTES;
    use std::arch::x86_64::{
        __m512, __m512bh, __m512i, _mm512_add_epi32, _mm512_add_ps, _mm512_and_si512,
        _mm512_castps_si512, _mm512_cmp_ps_mask, _mm512_cvtss_f32, _mm512_dpbf16_ps,
        _mm512_loadu_ps, _mm512_loadu_si512, _mm512_mask_blend_epi32, _mm512_or_si512,
        _mm512_permute_ps, _mm512_set1_epi32, _mm512_setzero_ps, _mm512_shuffle_f32x4,
        _mm512_shuffle_ps, _mm512_srli_epi32, _mm512_storeu_si512, _mm_prefetch, _CMP_UNORD_Q,
        _MM_HINT_T0, _MM_HINT_T1,
    };

    /// 32 bf16 values at `ptr` as a `__m512bh`.
    ///
    /// # Safety
    /// `ptr..ptr + 32` must be readable `u16`s.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn load(ptr: *const u16) -> __m512bh {
        // SAFETY: the caller guarantees the 64 bytes at `ptr`; unaligned loads are allowed.
        let v: __m512i = unsafe { _mm512_loadu_si512(ptr.cast()) };
        // SAFETY: `__m512i` and `__m512bh` are both 64-byte vectors and every bit pattern is a valid
        // value of either; this reinterprets 32 u16 lanes as 32 bf16 lanes.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }

    /// From this many input rows on, weight rows are taken in pairs (`paired_columns_block`). With one
    /// weight row per tile each dot product needs a load of its own (the input vector), which bounds the
    /// in-cache rate; a pair feeds each input vector loaded to two. All of SmolLM2's linears on 2 cores,
    /// two builds interleaved: 9 / 12 / 16 / 24 / 32 rows 14.1 / 18.6 / 20.4 / 35.4 / 51.1 -> 12.7 /
    /// 17.3 / 18.9 / 32.2 / 40.0 ms; 8 rows level within 2%, one row 10% slower (two weight streams from
    /// memory instead of one), so fewer rows keep single weight rows (benchmarks/results/throughput.md,
    /// run 53).
    pub(super) const PAIRED_FROM_ROWS: usize = 9;

    /// `block` [columns, rows]: each weight row against row tiles of up to 8 inputs, one accumulator
    /// per (input row, weight row), so that each weight vector loaded feeds up to 8 dot products.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) fn columns_block(x: &[u16], w: &[u16], block: &mut [u16], rows: usize, k: usize) {
        for (weights, column) in w.chunks_exact(k).zip(block.chunks_exact_mut(rows)) {
            let mut first = 0;
            while first < rows {
                let (tile_x, tile_out) = (&x[first * k..], &mut column[first..]);
                // One tile for whatever is left up to 8 rows (7 split 4 + 2 + 1 read each weight
                // vector three times; the draft's head and MLP run at 7 rows for trees of 8).
                first += match rows - first {
                    8.. => tile_dot::<8>(tile_x, weights, tile_out, k),
                    7 => tile_dot::<7>(tile_x, weights, tile_out, k),
                    6 => tile_dot::<6>(tile_x, weights, tile_out, k),
                    5 => tile_dot::<5>(tile_x, weights, tile_out, k),
                    4 => tile_dot::<4>(tile_x, weights, tile_out, k),
                    3 => tile_dot::<3>(tile_x, weights, tile_out, k),
                    2 => tile_dot::<2>(tile_x, weights, tile_out, k),
                    _ => tile_dot::<1>(tile_x, weights, tile_out, k),
                };
            }
        }
    }

    /// `columns_block` with the weight rows taken in pairs (an odd last one alone).
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) fn paired_columns_block(
        x: &[u16],
        w: &[u16],
        block: &mut [u16],
        rows: usize,
        k: usize,
    ) {
        let paired = w.len() / (2 * k) * 2;
        let (pairs, single) = w.split_at(paired * k);
        let (pair_out, single_out) = block.split_at_mut(paired * rows);
        for (weights, columns) in pairs
            .chunks_exact(2 * k)
            .zip(pair_out.chunks_exact_mut(2 * rows))
        {
            let mut first = 0;
            while first < rows {
                let tile_x = &x[first * k..];
                first += match rows - first {
                    8.. => paired_tile_dot::<8>(tile_x, weights, columns, first, rows, k),
                    7 => paired_tile_dot::<7>(tile_x, weights, columns, first, rows, k),
                    6 => paired_tile_dot::<6>(tile_x, weights, columns, first, rows, k),
                    5 => paired_tile_dot::<5>(tile_x, weights, columns, first, rows, k),
                    4 => paired_tile_dot::<4>(tile_x, weights, columns, first, rows, k),
                    3 => paired_tile_dot::<3>(tile_x, weights, columns, first, rows, k),
                    2 => paired_tile_dot::<2>(tile_x, weights, columns, first, rows, k),
                    _ => paired_tile_dot::<1>(tile_x, weights, columns, first, rows, k),
                };
            }
        }
        columns_block(x, single, single_out, rows, k);
    }

    /// How far ahead (in bf16 values) a tile of 4 or more rows prefetches its weight stream into L1: with
    /// that much arithmetic per byte the hardware prefetcher alone fell behind (18 against 24 ms for 8
    /// rows of SmolLM2-sized layers streamed from memory on one core; one row gained nothing).
    const PREFETCH_AHEAD: usize = 1024;

    /// Dot products of the first R rows of `x` (rows of `k`) with `weights`; returns R. Each output's sum
    /// is the same sequence of operations whatever R (one accumulator per output).
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn tile_dot<const R: usize>(x: &[u16], weights: &[u16], out: &mut [u16], k: usize) -> usize {
        // Every load below reads inside these ranges, checked here once.
        assert!(x.len() >= R * k && weights.len() == k && out.len() >= R);
        let (xp, wp) = (x.as_ptr(), weights.as_ptr());
        let mut acc: [__m512; R] = [_mm512_setzero_ps(); R];
        let body = k - k % LANES;
        for start in (0..body).step_by(LANES) {
            // A prefetch is a hint: it never faults, even past the end of the weights.
            if R >= 4 {
                _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(start + PREFETCH_AHEAD).cast());
            }
            _mm_prefetch::<_MM_HINT_T1>(
                wp.wrapping_add(start + PREFETCH_L2_BYTES / size_of::<u16>())
                    .cast(),
            );
            // SAFETY: start + 32 <= body <= k == weights.len().
            let wv = unsafe { load(wp.add(start)) };
            for (r, acc_r) in acc.iter_mut().enumerate() {
                // SAFETY: r * k + start + 32 <= (r + 1) * k <= R * k <= x.len() (asserted above).
                let xv = unsafe { load(xp.add(r * k + start)) };
                *acc_r = _mm512_dpbf16_ps(*acc_r, xv, wv);
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            let mut sum = sum_lanes(*acc_r);
            for i in body..k {
                sum = bf16_to_f32(weights[i]).mul_add(bf16_to_f32(x[r * k + i]), sum);
            }
            out[r] = f32_to_bf16(sum);
        }
        R
    }

    /// The sum of the 16 lanes of `v` in one fixed tree: lanes i and i + 8, then i and i + 4, i and i + 2,
    /// i and i + 1 (so lane 0 ends up with ((v0 + v8) + (v4 + v12)) + ...). `sum_16_lanes` adds each of
    /// its vectors in this same tree, so a sum has the same bits whichever of the two took it.
    #[target_feature(enable = "avx512f")]
    fn sum_lanes(v: __m512) -> f32 {
        let a = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0b11_10_11_10>(v, v));
        let b = _mm512_add_ps(a, _mm512_shuffle_f32x4::<0b01_01_01_01>(a, a));
        let c = _mm512_add_ps(b, _mm512_permute_ps::<0b11_10_11_10>(b));
        let d = _mm512_add_ps(c, _mm512_permute_ps::<0b01_01_01_01>(c));
        _mm512_cvtss_f32(d)
    }

    /// The lane sums of 16 vectors (`sum_lanes`'s tree for each, every addition shared out over the
    /// lanes of one vector instead of 16 reductions of their own), as one vector: lane 4j + m holds the
    /// sum of `v[4m + j]`, reordered here to lane i for `v[i]`.
    #[target_feature(enable = "avx512f")]
    fn sum_16_lanes(v: &[__m512]) -> [f32; 16] {
        assert_eq!(v.len(), 16);
        // Lanes 0-7: a[i] + a[i + 8]; 8-15: b[i] + b[i + 8] (a, b = v[2p], v[2p + 1]).
        let halves: [__m512; 8] = std::array::from_fn(|p| {
            let (a, b) = (v[2 * p], v[2 * p + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
            )
        });
        // Quarter j: vector 4q + j's x[i] + x[i + 4] (x its sums above, i < 4).
        let quarters: [__m512; 4] = std::array::from_fn(|q| {
            let (a, b) = (halves[2 * q], halves[2 * q + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
            )
        });
        // Quarter j: [y0 + y2, y1 + y3] of vector 8s + j, then of vector 8s + 4 + j.
        let pairs: [__m512; 2] = std::array::from_fn(|s| {
            let (a, b) = (quarters[2 * s], quarters[2 * s + 1]);
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
                _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
            )
        });
        let (a, b) = (pairs[0], pairs[1]);
        let sums = _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(a, b),
            _mm512_shuffle_ps::<0b11_01_11_01>(a, b),
        );
        let mut lanes = [0.0f32; 16];
        // SAFETY: `lanes` is 64 writable bytes; unaligned stores are allowed.
        unsafe { _mm512_storeu_si512(lanes.as_mut_ptr().cast(), _mm512_castps_si512(sums)) };
        std::array::from_fn(|i| lanes[4 * (i % 4) + i / 4])
    }

    /// `f32_to_bf16` of 16 values at once (nearest even, NaN kept a quiet NaN), as u32 lanes.
    #[target_feature(enable = "avx512f")]
    fn rounded_to_bf16(values: [f32; 16]) -> [u32; 16] {
        // SAFETY: `values` is 64 readable bytes; unaligned loads are allowed.
        let vector = unsafe { _mm512_loadu_ps(values.as_ptr()) };
        let bits = _mm512_castps_si512(vector);
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(vector, vector);
        let low_bit = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let rounding = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), low_bit);
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, rounding));
        let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(0x0040));
        let out = _mm512_mask_blend_epi32(nan, rounded, quiet);
        let mut lanes = [0u32; 16];
        // SAFETY: `lanes` is 64 writable bytes.
        unsafe { _mm512_storeu_si512(lanes.as_mut_ptr().cast(), out) };
        lanes
    }

    /// `sum_16_lanes` adds each vector in `sum_lanes`'s order: float32 sums compared to the bit (a
    /// bf16 product's rounding would hide most differences of order).
    #[cfg(test)]
    #[test]
    fn sixteen_sums_at_once_have_the_bits_of_one_at_a_time() {
        if !(std::arch::is_x86_feature_detected!("avx512f")) {
            return;
        }
        let mut state = 12345u32;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            // Mantissas in full and 17 binades, so that the order of the additions shows.
            (state % 100_003) as f32 / 7.0 * 2f32.powi((state % 17) as i32 - 8) - 3000.0
        };
        for _ in 0..64 {
            let lanes: Vec<[f32; 16]> = (0..16).map(|_| std::array::from_fn(|_| next())).collect();
            // SAFETY: AVX-512F detected above; each array is 64 readable bytes.
            let (together, alone) = unsafe {
                let v: Vec<__m512> = lanes.iter().map(|l| _mm512_loadu_ps(l.as_ptr())).collect();
                let alone: Vec<f32> = v.iter().map(|&x| sum_lanes(x)).collect();
                (sum_16_lanes(&v), alone)
            };
            assert_eq!(
                together.map(f32::to_bits).to_vec(),
                alone.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
            // and these values tell orders apart: the plain left-to-right sum differs somewhere
            assert!(lanes
                .iter()
                .zip(&alone)
                .any(|(l, &a)| l.iter().sum::<f32>() != a));
        }
    }

    /// `tile_dot` for two weight rows at once (`weights`: 2 * k values), into `columns[c * rows +
    /// first + r]` for c = 0, 1; returns R. Each output's sum is `tile_dot`'s sequence of operations
    /// (its own accumulator, the same horizontal sum and tail; a full tile of 8 rows without a tail
    /// takes its 16 horizontal sums together, in the same tree), so pairing never changes a bit. Kept
    /// apart from `tile_dot` on purpose: one tile generic over the weight-row count ran the 8-row
    /// products 1-3% slower (run 53), and 1-8 rows are the decode and batch-1 verify path.
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn paired_tile_dot<const R: usize>(
        x: &[u16],
        weights: &[u16],
        columns: &mut [u16],
        first: usize,
        rows: usize,
        k: usize,
    ) -> usize {
        // Every load below reads inside these ranges, checked here once.
        assert!(x.len() >= R * k && weights.len() == 2 * k);
        assert!(first + R <= rows && columns.len() == 2 * rows);
        let (xp, wp) = (x.as_ptr(), weights.as_ptr());
        let mut acc: [[__m512; 2]; R] = [[_mm512_setzero_ps(); 2]; R];
        let body = k - k % LANES;
        for start in (0..body).step_by(LANES) {
            let mut wv = [wp; 2];
            for (c, wv_c) in wv.iter_mut().enumerate() {
                *wv_c = wp.wrapping_add(c * k + start);
                // A prefetch is a hint: it never faults, even past the end of the weights.
                if R >= 4 {
                    _mm_prefetch::<_MM_HINT_T0>(wv_c.wrapping_add(PREFETCH_AHEAD).cast());
                }
                _mm_prefetch::<_MM_HINT_T1>(
                    wv_c.wrapping_add(PREFETCH_L2_BYTES / size_of::<u16>())
                        .cast(),
                );
            }
            // SAFETY: c * k + start + 32 <= c * k + body <= (c + 1) * k <= weights.len() for c = 0, 1.
            let wv = unsafe { [load(wv[0]), load(wv[1])] };
            for (r, acc_r) in acc.iter_mut().enumerate() {
                // SAFETY: r * k + start + 32 <= (r + 1) * k <= R * k <= x.len() (asserted above).
                let xv = unsafe { load(xp.add(r * k + start)) };
                for (acc_rc, wv_c) in acc_r.iter_mut().zip(wv) {
                    *acc_rc = _mm512_dpbf16_ps(*acc_rc, xv, wv_c);
                }
            }
        }
        if R == 8 && body == k {
            // 16 sums without a tail: all at once (`sum_16_lanes`), rounded as one vector.
            let sums: [u32; 16] = rounded_to_bf16(sum_16_lanes(acc.as_flattened()));
            for (v, &bits) in sums.iter().enumerate() {
                let (r, c) = (v / 2, v % 2);
                columns[c * rows + first + r] = bits as u16;
            }
            return R;
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (c, acc_rc) in acc_r.iter().enumerate() {
                let mut sum = sum_lanes(*acc_rc);
                for i in body..k {
                    sum = bf16_to_f32(weights[c * k + i]).mul_add(bf16_to_f32(x[r * k + i]), sum);
                }
                columns[c * rows + first + r] = f32_to_bf16(sum);
            }
        }
        R
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `gemm`'s test values in [-1, 1), as bf16 bits.
    fn values(len: usize, seed: u32) -> Vec<u16> {
        crate::gemm::tests::half_values(len, seed, f32_to_bf16)
    }

    fn reference(x: &[u16], w: &[u16], rows: usize, k: usize, n: usize) -> Vec<f64> {
        crate::gemm::tests::half_reference(x, w, (rows, k, n), bf16_to_f32)
    }

    #[test]
    fn rounding_to_bf16_is_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(-2.0), 0xc000);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties go up to the even one.
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(f32_to_bf16(1.0 + 1.5 / 256.0), 0x3f81);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        for bits in [0x0000u16, 0x3f80, 0xbf80, 0x4049, 0x0001, 0x7f7f] {
            assert_eq!(f32_to_bf16(bf16_to_f32(bits)), bits);
        }
    }

    /// A bf16 product as the tests call it: (x, w, out, rows, k, n).
    type Product = fn(&[u16], &[u16], &mut [u16], usize, usize, usize) -> Result<(), GemmError>;

    /// Within one bf16 rounding of the result (2^-8 relative) plus float32 summation error of a float64
    /// reference, for every tile split.
    fn assert_matches_the_reference(product: Product) {
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
            product(&x, &w, &mut out, rows, k, n).unwrap();
            for (got, want) in out.iter().zip(reference(&x, &w, rows, k, n)) {
                let got = bf16_to_f32(*got) as f64;
                let tolerance = want.abs() / 256.0 + 1e-4 * (k as f64).sqrt();
                assert!((got - want).abs() <= tolerance, "{got} vs {want}");
            }
        }
    }

    /// Each row of a call of `rows` rows has the bits of the same row computed alone.
    fn assert_rows_keep_their_bits(product: Product, k: usize, n: usize, rows: &[usize]) {
        let x = values(16 * k, 3);
        let w = values(n * k, 4);
        for &rows in rows {
            let mut all = vec![0u16; rows * n];
            product(&x[..rows * k], &w, &mut all, rows, k, n).unwrap();
            for m in 0..rows {
                let mut alone = vec![0u16; n];
                product(&x[m * k..(m + 1) * k], &w, &mut alone, 1, k, n).unwrap();
                assert_eq!(
                    alone,
                    all[m * n..(m + 1) * n].to_vec(),
                    "row {m} of {rows}, k {k}"
                );
            }
        }
    }

    #[test]
    fn matches_a_float64_reference_for_every_tile_split() {
        assert_matches_the_reference(skinny_matmul_bf16);
    }

    #[test]
    fn a_row_gets_the_same_bits_whatever_the_other_rows() {
        // An odd number of weight rows and a k with a tail: paired and single weight rows, every tile
        // split (2-8 rows: one tile; 9 rows: 8 + 1; 13: 8 + 5; 15: 8 + 7; 16: 8 + 8) against the row
        // alone.
        assert_rows_keep_their_bits(
            skinny_matmul_bf16,
            100,
            201,
            &[2, 3, 4, 5, 6, 7, 8, 9, 13, 15, 16],
        );
        // No tail: the 8-row paired tiles sum their 16 outputs together (`sum_16_lanes`), the others
        // one by one (`sum_lanes`).
        assert_rows_keep_their_bits(skinny_matmul_bf16, 128, 201, &[8, 9, 15, 16]);
    }

    /// The AVX2 path on its own (the public function takes the AVX512-BF16 kernel where there is one).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_widened_avx2_path_matches_the_reference_and_keeps_rows_apart() {
        if !crate::gemm::avx2::available() {
            return;
        }
        assert_matches_the_reference(widened_product);
        // 1-4 rows: one weight row per tile; from 5: tiles of 3 weight rows and 4 inputs, with 1 or 2
        // weight rows left over (n = 200, 131) and a tail past the 8-lane body (k = 100).
        for (k, n) in [(96, 200), (100, 131)] {
            assert_rows_keep_their_bits(widened_product, k, n, &[2, 3, 4, 5, 7, 8, 9, 16]);
        }
    }

    #[test]
    fn wrong_lengths_and_too_many_rows_are_errors() {
        let mut out = vec![0u16; 4];
        assert!(skinny_matmul_bf16(&[0; 7], &[0; 8], &mut out, 2, 4, 2).is_err());
        assert!(skinny_matmul_bf16(&[0; 8], &[0; 8], &mut out[..3], 2, 4, 2).is_err());
        let rows = MAX_ROWS + 1;
        let mut big = vec![0u16; rows];
        let err = skinny_matmul_bf16(&vec![0; rows], &[0x3f80], &mut big, rows, 1, 1).unwrap_err();
        assert!(err.to_string().contains("at most"));
    }

    #[test]
    fn the_portable_path_matches_the_reference_too() {
        let (rows, k, n) = (5, 200, 40);
        let (x, w) = (values(rows * k, 5), values(n * k, 6));
        let mut block = vec![0u16; rows * n];
        portable_block(&x, &w, &mut block, rows, k);
        let want = reference(&x, &w, rows, k, n);
        for j in 0..n {
            for m in 0..rows {
                let (got, want) = (bf16_to_f32(block[j * rows + m]) as f64, want[m * n + j]);
                assert!(
                    (got - want).abs() <= want.abs() / 256.0 + 1e-3,
                    "{got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn empty_products_are_fine() {
        let mut out: Vec<u16> = vec![];
        skinny_matmul_bf16(&[], &[0; 4], &mut out, 0, 4, 1).unwrap();
        skinny_matmul_bf16(&[0; 4], &[], &mut out, 1, 4, 0).unwrap();
        let mut zeros = vec![0x3f80u16; 6];
        skinny_matmul_bf16(&[], &[], &mut zeros, 2, 0, 3).unwrap();
        assert_eq!(zeros, vec![0u16; 6]);
    }
}
