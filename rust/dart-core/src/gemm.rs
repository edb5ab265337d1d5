//! `out = x @ w.T` for a few rows of `x` (1..=64): the linear layers of decode at small batches and of
//! tree verification, where the BLAS calls measured on a 2-core AVX2 EPYC cost up to 2x the one-row
//! call although both only stream `w` from memory once (benchmarks/results/throughput.md, run 14).
//!
//! Each weight row is read once and multiplied into every input row while it is in L1, 8 lanes at a
//! time, with one accumulator vector per (input row, weight row). Every output element is computed by
//! the same sequence of operations whatever the number of rows and wherever its row falls in a tile, so
//! a row's result does not depend on the other rows of the call: a token gets bit-identical logits
//! whether it is verified in a tree of 8 or decoded alone.

use std::sync::{Mutex, PoisonError};

use crate::team;

const LANES: usize = 8;
/// Output columns (weight rows) per claimed task: enough to amortise the claim, small enough that
/// all threads get work for the narrowest layers (576 columns).
const COLUMNS_PER_TASK: usize = 64;
/// How far ahead (in bytes) both products' tiles prefetch their weight stream into L2: the hardware
/// prefetcher alone (and the bf16 tile's own L1 prefetch, 2 KB ahead) left the 8-row tile stalling on
/// memory between its bursts of arithmetic (all of SmolLM2's linears on 2 cores, 8 rows: bf16 16.3
/// against 13.2 ms, float32 32.1 against 23.0; float32 32 rows 111 against 90; 1-4 rows level; 4 KB
/// was slower, 16 KB no better; benchmarks/results/throughput.md, run 48).
pub(crate) const PREFETCH_L2_BYTES: usize = 8192;
/// Most input rows one call takes: beyond that the BLAS's blocking wins.
pub const MAX_ROWS: usize = 64;

/// Why a product cannot be computed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GemmError {
    Shape(String),
}

impl std::fmt::Display for GemmError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GemmError::Shape(msg) => write!(f, "skinny matmul: {msg}"),
        }
    }
}

impl std::error::Error for GemmError {}

/// `out[m * n + j] = sum_k x[m * k + i] * w[j * k + i]` for `rows` rows of `x` (`rows * k` values),
/// `n` rows of `w` (`n * k`) and `out` of `rows * n`.
pub fn skinny_matmul(
    x: &[f32],
    w: &[f32],
    out: &mut [f32],
    rows: usize,
    k: usize,
    n: usize,
) -> Result<(), GemmError> {
    blocked_product(x, w, out, rows, k, n, &|weights, block| {
        columns_block(x, weights, block, rows, k)
    })
}

/// The frame both few-row products share: checks the lengths, then shares blocks of weight rows out
/// among the calling thread and the team's helpers (`team` says why not rayon). `block(weights,
/// columns)` computes one block in [weight rows of `weights`, rows] order into a small buffer, which
/// the same task then transposes into its stretch of each row of `out` while it is in cache (one
/// transpose of the whole output afterwards cost up to 4 ms of SmolLM2's 16-row forward, most of it
/// in the lm_head). An empty inner dimension gives zeros (empty sums).
pub(crate) fn blocked_product<T: Copy + Default + Send + Sync>(
    x: &[T],
    w: &[T],
    out: &mut [T],
    rows: usize,
    k: usize,
    n: usize,
    block: &(dyn Fn(&[T], &mut [T]) + Sync),
) -> Result<(), GemmError> {
    check_lengths(x.len(), w.len(), out.len(), rows, k, n)?;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        out.fill(T::default());
        return Ok(());
    }
    // Task t owns columns [t * COLUMNS_PER_TASK, ..) of every row of `out`. Each is claimed by exactly
    // one thread; the (uncontended) locks only carry the `&mut`s.
    let tasks = n.div_ceil(COLUMNS_PER_TASK);
    let mut pieces: Vec<Vec<&mut [T]>> = (0..tasks).map(|_| Vec::with_capacity(rows)).collect();
    for row in out.chunks_exact_mut(n) {
        for (task, piece) in row.chunks_mut(COLUMNS_PER_TASK).enumerate() {
            pieces[task].push(piece);
        }
    }
    let pieces: Vec<Mutex<Vec<&mut [T]>>> = pieces.into_iter().map(Mutex::new).collect();
    team::for_each_index(tasks, &|task| {
        let mut row_pieces = pieces[task].lock().unwrap_or_else(PoisonError::into_inner);
        let first = task * COLUMNS_PER_TASK;
        let count = row_pieces[0].len();
        let weights = &w[first * k..(first + count) * k];
        if rows == 1 {
            // One row: [columns, rows] order is the row's own order.
            block(weights, row_pieces[0]);
            return;
        }
        let mut by_column = vec![T::default(); count * rows];
        block(weights, &mut by_column);
        for (m, piece) in row_pieces.iter_mut().enumerate() {
            for (j, value) in piece.iter_mut().enumerate() {
                *value = by_column[j * rows + m];
            }
        }
    });
    Ok(())
}

/// The row limit and the three lengths a `rows x k` by `n x k` product needs (any element type).
fn check_lengths(
    x_len: usize,
    w_len: usize,
    out_len: usize,
    rows: usize,
    k: usize,
    n: usize,
) -> Result<(), GemmError> {
    if rows > MAX_ROWS {
        return Err(GemmError::Shape(format!("{rows} rows, at most {MAX_ROWS}")));
    }
    for (name, len, want) in [
        ("x", x_len, rows * k),
        ("w", w_len, n * k),
        ("out", out_len, rows * n),
    ] {
        if len != want {
            return Err(GemmError::Shape(format!(
                "{name} has {len} values, expected {want} (rows {rows}, k {k}, n {n})"
            )));
        }
    }
    Ok(())
}

/// One task: all input rows against a block of weight rows; `block` is [columns, rows].
fn columns_block(x: &[f32], w: &[f32], block: &mut [f32], rows: usize, k: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2::available() {
            // SAFETY: `avx2::columns_block` needs AVX2, FMA and F16C, all just detected on this CPU.
            unsafe { avx2::columns_block(x, w, block, rows, k) };
            return;
        }
    }
    for (weights, column) in w.chunks_exact(k).zip(block.chunks_exact_mut(rows)) {
        for (r, out) in column.iter_mut().enumerate() {
            *out = portable_dot(&x[r * k..(r + 1) * k], weights);
        }
    }
}

/// The same sums as the AVX2 path (8 lanes, then a fixed pairwise order), in portable code.
fn portable_dot(x: &[f32], weights: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let body = x.len() - x.len() % LANES;
    for (xs, ws) in x[..body]
        .chunks_exact(LANES)
        .zip(weights.chunks_exact(LANES))
    {
        for lane in 0..LANES {
            lanes[lane] += xs[lane] * ws[lane];
        }
    }
    let mut sum = fold_lanes(lanes);
    for i in body..x.len() {
        sum += x[i] * weights[i];
    }
    sum
}

/// The lanes added pairwise in a fixed tree (lane l with l + N/2, then l + N/4, ...; N a power of two):
/// every kernel that sums vector lanes ends with it, so a sum's order never depends on the tile.
#[inline(always)]
pub(crate) fn fold_lanes<const N: usize>(mut lanes: [f32; N]) -> f32 {
    let mut width = N / 2;
    while width > 0 {
        for l in 0..width {
            lanes[l] += lanes[l + width];
        }
        width /= 2;
    }
    lanes[0]
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{fold_lanes, LANES, PREFETCH_L2_BYTES};
    use crate::gemm_bf16::{bf16_to_f32, f32_to_bf16};
    use crate::gemm_f16::{f16_to_f32, f32_to_f16, F16};
    use std::arch::x86_64::{
        __m128i, __m256, _mm256_castsi256_ps, _mm256_cvtepu16_epi32, _mm256_cvtph_ps,
        _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps, _mm256_slli_epi32, _mm256_storeu_ps,
        _mm_loadu_si128, _mm_prefetch, _MM_HINT_T1,
    };

    /// Whether this CPU has what the tiles below need: AVX2 and FMA, and F16C for float16 weights (every
    /// CPU with AVX2 has it; asked all the same, since the tiles are compiled with it).
    pub(crate) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }

    /// A weight (and output) element of the tiles: float32, bf16 as its bits, or float16 (`F16`). The
    /// inputs are float32 either way (half-precision inputs are widened once per call, exactly), and so are
    /// the sums; a half-precision output is the float32 sum rounded once, to nearest even.
    pub(crate) trait Element: Copy {
        /// Up to how many input rows a tile takes one weight row (`columns_block`).
        const ONE_COLUMN_ROWS: usize;
        /// 8 consecutive values at `ptr`, as float32 lanes.
        ///
        /// # Safety
        /// `ptr..ptr + 8` must be readable values, and the CPU must have AVX2.
        unsafe fn load8(ptr: *const Self) -> __m256;
        fn to_f32(self) -> f32;
        fn from_f32(value: f32) -> Self;
    }

    impl Element for f32 {
        const ONE_COLUMN_ROWS: usize = ONE_COLUMN_ROWS;
        #[inline(always)]
        unsafe fn load8(ptr: *const f32) -> __m256 {
            // SAFETY: the caller guarantees the 8 floats at `ptr` and AVX2 (a superset of AVX).
            unsafe { _mm256_loadu_ps(ptr) }
        }
        #[inline(always)]
        fn to_f32(self) -> f32 {
            self
        }
        #[inline(always)]
        fn from_f32(value: f32) -> f32 {
            value
        }
    }

    impl Element for u16 {
        const ONE_COLUMN_ROWS: usize = 4;
        #[inline(always)]
        unsafe fn load8(ptr: *const u16) -> __m256 {
            // SAFETY: the caller guarantees the 16 bytes at `ptr` (unaligned loads are allowed) and AVX2.
            // Widening bf16 bits to the upper half of 32-bit lanes is the exact float32 value.
            unsafe {
                let bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(ptr.cast::<__m128i>()));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits))
            }
        }
        #[inline(always)]
        fn to_f32(self) -> f32 {
            bf16_to_f32(self)
        }
        #[inline(always)]
        fn from_f32(value: f32) -> u16 {
            f32_to_bf16(value)
        }
    }

    impl Element for F16 {
        // Tiles of 3 weight rows from one input row on: each weight vector's widening costs more than its
        // FMA, and three independent sums per tile keep the FMA unit fed (all of SmolLM2's layer shapes
        // and its lm_head, AVX512-BF16 EPYC, 1 / 2 / 4 rows: 1.61 / 1.99 / 2.92 ms with one weight row
        // per tile up to 4 rows, 1.40 / 1.49 / 2.03 with these; 8 rows level).
        const ONE_COLUMN_ROWS: usize = 0;
        #[inline(always)]
        unsafe fn load8(ptr: *const F16) -> __m256 {
            // SAFETY: the caller guarantees the 16 bytes at `ptr` (unaligned loads are allowed) and the
            // tiles' features (F16C among them, `available`). Widening float16 to float32 is exact.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(ptr.cast::<__m128i>())) }
        }
        #[inline(always)]
        fn to_f32(self) -> f32 {
            f16_to_f32(self.0)
        }
        #[inline(always)]
        fn from_f32(value: f32) -> F16 {
            F16(f32_to_f16(value))
        }
    }

    /// Up to this many input rows, a tile is one weight row and up to 8 input rows (8 accumulators): the
    /// product streams the weights once, in order, and is bound by memory.
    const ONE_COLUMN_ROWS: usize = 8;
    /// Beyond that, a tile is 3 weight rows and up to 4 input rows (12 accumulators, 3 weight vectors
    /// and one input vector: the 16 vector registers), so that each input vector loaded serves 3 weight
    /// rows. With one weight row per tile, 16 rows loaded 9 vectors per 8 FMAs, the input rows mostly
    /// from L2 (16 rows of a 1536-wide layer are 98 KB): all of SmolLM2's linears and its lm_head took
    /// 1.21x / 1.28x / 1.52x as long at 16 / 24 / 64 rows as with these tiles, but 3 weight rows per
    /// tile were 4-8% slower at 1-8 rows (float32, 2-core AVX2 EPYC; throughput.md, run 58).
    const WIDE_COLUMNS: usize = 3;
    const WIDE_ROWS: usize = 4;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn columns_block<W: Element>(
        x: &[f32],
        w: &[W],
        block: &mut [W],
        rows: usize,
        k: usize,
    ) {
        let columns = w.len() / k;
        let mut first = 0;
        while first < columns {
            let (weights, out) = (&w[first * k..], &mut block[first * rows..]);
            first += match columns - first {
                _ if rows <= W::ONE_COLUMN_ROWS => {
                    column_tiles::<W, 1, ONE_COLUMN_ROWS>(x, weights, out, rows, k)
                }
                WIDE_COLUMNS.. => {
                    column_tiles::<W, WIDE_COLUMNS, WIDE_ROWS>(x, weights, out, rows, k)
                }
                2 => column_tiles::<W, 2, WIDE_ROWS>(x, weights, out, rows, k),
                _ => column_tiles::<W, 1, WIDE_ROWS>(x, weights, out, rows, k),
            };
        }
    }

    /// All input rows against the first C weight rows of `weights`, into `out` ([C, rows]), in tiles of
    /// at most ROWS input rows (8 or 4); returns C.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn column_tiles<W: Element, const C: usize, const ROWS: usize>(
        x: &[f32],
        weights: &[W],
        out: &mut [W],
        rows: usize,
        k: usize,
    ) -> usize {
        let mut first = 0;
        while first < rows {
            let (tile_x, tile_out) = (&x[first * k..], &mut out[first..]);
            // One tile for whatever is left up to ROWS: 7 rows split 4 + 2 + 1 read each weight
            // vector three times and cost 16-22% more than 8 rows (the draft's head and MLP run at
            // 7 rows for trees of 8).
            first += match rows - first {
                8.. if ROWS >= 8 => tile_dot::<W, 8, C>(tile_x, weights, tile_out, rows, k),
                7 if ROWS >= 8 => tile_dot::<W, 7, C>(tile_x, weights, tile_out, rows, k),
                6 if ROWS >= 8 => tile_dot::<W, 6, C>(tile_x, weights, tile_out, rows, k),
                5 if ROWS >= 8 => tile_dot::<W, 5, C>(tile_x, weights, tile_out, rows, k),
                4.. => tile_dot::<W, 4, C>(tile_x, weights, tile_out, rows, k),
                3 => tile_dot::<W, 3, C>(tile_x, weights, tile_out, rows, k),
                2 => tile_dot::<W, 2, C>(tile_x, weights, tile_out, rows, k),
                _ => tile_dot::<W, 1, C>(tile_x, weights, tile_out, rows, k),
            };
        }
        C
    }

    /// Dot products of the first R rows of `x` (rows of `k`) with the first C rows of `weights`, into
    /// `out[c * stride + r]`; returns R. Each sum runs in the same order whatever R, C and the tile's
    /// place: 8 lanes along `k`, the lanes reduced in a fixed order, then the tail.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn tile_dot<W: Element, const R: usize, const C: usize>(
        x: &[f32],
        weights: &[W],
        out: &mut [W],
        stride: usize,
        k: usize,
    ) -> usize {
        assert!(x.len() >= R * k && weights.len() >= C * k && out.len() > (C - 1) * stride + R - 1);
        let mut acc: [[__m256; R]; C] = [[_mm256_setzero_ps(); R]; C];
        let body = k - k % LANES;
        for start in (0..body).step_by(LANES) {
            let mut wv: [__m256; C] = [_mm256_setzero_ps(); C];
            for (c, wv_c) in wv.iter_mut().enumerate() {
                // A prefetch is a hint: it never faults, even past the end of the weights.
                _mm_prefetch::<_MM_HINT_T1>(
                    weights
                        .as_ptr()
                        .wrapping_add(c * k + start + PREFETCH_L2_BYTES / size_of::<W>())
                        .cast(),
                );
                // SAFETY: c * k + start + LANES <= c * k + body <= C * k <= weights.len() (asserted);
                // AVX2 is enabled here.
                *wv_c = unsafe { W::load8(weights.as_ptr().add(c * k + start)) };
            }
            for r in 0..R {
                // SAFETY: r * k + start + LANES <= (r + 1) * k <= R * k <= x.len() (asserted above).
                let xv = unsafe { _mm256_loadu_ps(x.as_ptr().add(r * k + start)) };
                for (acc_c, wv_c) in acc.iter_mut().zip(&wv) {
                    acc_c[r] = _mm256_fmadd_ps(*wv_c, xv, acc_c[r]);
                }
            }
        }
        for (c, acc_c) in acc.iter().enumerate() {
            let column = &weights[c * k..(c + 1) * k];
            for (r, acc_r) in acc_c.iter().enumerate() {
                let mut lanes = [0.0f32; LANES];
                // SAFETY: `lanes` holds exactly the 8 floats the store writes.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *acc_r) };
                let mut sum = fold_lanes(lanes);
                for i in body..k {
                    sum = column[i].to_f32().mul_add(x[r * k + i], sum);
                }
                out[c * stride + r] = W::from_f32(sum);
            }
        }
        R
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn reference(x: &[f32], w: &[f32], rows: usize, k: usize, n: usize) -> Vec<f64> {
        let mut out = vec![0.0f64; rows * n];
        for m in 0..rows {
            for j in 0..n {
                out[m * n + j] = (0..k)
                    .map(|i| x[m * k + i] as f64 * w[j * k + i] as f64)
                    .sum();
            }
        }
        out
    }

    /// `values` rounded to a half-precision format by `round` (its bits).
    pub(crate) fn half_values(len: usize, seed: u32, round: fn(f32) -> u16) -> Vec<u16> {
        values(len, seed).into_iter().map(round).collect()
    }

    /// `x @ w.T` in float64 of half-precision bits widened by `widen`: what the half products approximate.
    pub(crate) fn half_reference(
        x: &[u16],
        w: &[u16],
        (rows, k, n): (usize, usize, usize),
        widen: fn(u16) -> f32,
    ) -> Vec<f64> {
        let mut out = vec![0.0f64; rows * n];
        for m in 0..rows {
            for j in 0..n {
                out[m * n + j] = (0..k)
                    .map(|i| widen(x[m * k + i]) as f64 * widen(w[j * k + i]) as f64)
                    .sum();
            }
        }
        out
    }

    /// Small deterministic pseudo-random values in [-1, 1) (the other kernels' tests take them too).
    pub(crate) fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn matches_a_float64_reference_for_every_tile_split() {
        for (rows, k, n) in [
            (1, 8, 3),
            (3, 13, 70),
            (8, 576, 130),
            (13, 100, 65),
            (64, 24, 5),
        ] {
            let (x, w) = (values(rows * k, 1), values(n * k, 2));
            let mut out = vec![0.0f32; rows * n];
            skinny_matmul(&x, &w, &mut out, rows, k, n).unwrap();
            for (got, want) in out.iter().zip(reference(&x, &w, rows, k, n)) {
                assert!(
                    (*got as f64 - want).abs() < 1e-4 * (k as f64).sqrt(),
                    "{got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn a_row_gets_the_same_bits_whatever_the_other_rows() {
        // k = 100 has a tail past the 8-lane body; n = 200 and 131 leave one and two weight rows past
        // the 3-row tiles (within a task of 64 columns and overall).
        for (k, n) in [(96, 200), (100, 131)] {
            let x = values(16 * k, 3);
            let w = values(n * k, 4);
            let mut all = vec![0.0f32; 16 * n];
            skinny_matmul(&x, &w, &mut all, 16, k, n).unwrap();
            for m in 0..16 {
                let mut alone = vec![0.0f32; n];
                skinny_matmul(&x[m * k..(m + 1) * k], &w, &mut alone, 1, k, n).unwrap();
                assert_eq!(alone, all[m * n..(m + 1) * n].to_vec(), "row {m}, k {k}");
            }
            for rows in [2, 3, 4, 5, 6, 7, 8, 9, 11] {
                let mut some = vec![0.0f32; rows * n];
                skinny_matmul(&x[..rows * k], &w, &mut some, rows, k, n).unwrap();
                assert_eq!(some, all[..rows * n].to_vec(), "{rows} rows, k {k}");
            }
        }
    }

    #[test]
    fn wrong_lengths_and_too_many_rows_are_errors() {
        let mut out = vec![0.0f32; 4];
        assert!(skinny_matmul(&[0.0; 7], &[0.0; 8], &mut out, 2, 4, 2).is_err());
        assert!(skinny_matmul(&[0.0; 8], &[0.0; 8], &mut out[..3], 2, 4, 2).is_err());
        let rows = MAX_ROWS + 1;
        let mut big = vec![0.0f32; rows];
        let err = skinny_matmul(&vec![0.0; rows], &[1.0], &mut big, rows, 1, 1).unwrap_err();
        assert!(err.to_string().contains("at most"));
    }

    #[test]
    fn empty_products_are_fine() {
        let mut out: Vec<f32> = vec![];
        skinny_matmul(&[], &[0.0; 4], &mut out, 0, 4, 1).unwrap();
        skinny_matmul(&[0.0; 4], &[], &mut out, 1, 4, 0).unwrap();
        let mut zeros = vec![1.0f32; 6];
        skinny_matmul(&[], &[], &mut zeros, 2, 0, 3).unwrap();
        assert_eq!(zeros, vec![0.0f32; 6]);
    }
}
