//! Masked attention of a few queries per request over keys read from a paged KV pool: the decode and
//! tree-verify attention of a CPU server, one call per layer, in float32 or bfloat16.
//!
//! torch's CPU SDPA runs a task per (request, query head) that costs about 20 us in bf16 whatever its size,
//! and the Python caller first gathers every key and value row into new tensors: at one request a bf16
//! SmolLM2 layer's attention took 0.1-0.3 ms for a few microseconds of arithmetic (a fifth of a batch-1
//! DART step; benchmarks/results/throughput.md, runs 110-111). Here one call reads the pool where it lies,
//! shares (request, KV head, block of query rows) tasks out among the team (`team`), and writes the output.
//!
//! A query's result depends only on its own row: its scores are one dot product per key, and the softmax
//! and the weighted sum of values run over the keys in their column order, the keys it may not see adding
//! exact zeros. The AVX-512 path shares loads between rows and keys (two query rows against eight keys,
//! four rows against each value row) but keeps one accumulator per output, each summed in one fixed
//! order. So a token attends bit-identically whether it is decoded alone or verified in a tree, wherever
//! its ancestors sit among the tree's columns, and whatever else the batch holds.

use std::sync::{Mutex, PoisonError};

use crate::gemm::fold_lanes;
use crate::rowwise::{portable::exp_f32, Element};
use crate::team;

/// Partial sums of a dot product (one vector); query and key rows are zero-padded to a multiple.
const DOT_LANES: usize = 16;
/// Keys scored together (the AVX-512 path folds their 16-lane partial sums into one vector of scores).
const KEY_BLOCK: usize = 8;
/// Value columns summed in one pass over the keys (four vectors); value rows are zero-padded to a multiple.
const VALUE_BLOCK: usize = 64;
/// Query rows (query, head) a task takes at most: enough to share the gathered keys, few enough that one
/// request's decode or tree splits over both cores of a small machine.
const ROWS_PER_TASK: usize = 16;
/// Query rows a task takes in a call with many (a prefill chunk): a task gathers its request's keys once,
/// and three times the rows share that gather (a 2,048-token causal prefill, one SmolLM2 layer on the
/// 2-core EPYC: 45 ms in tasks of 16 rows, 36 in tasks of 48). Used where the call still gives every
/// thread of the team `TASKS_PER_THREAD` such tasks.
const LONG_ROWS_PER_TASK: usize = 48;
const TASKS_PER_THREAD: usize = 4;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionError(pub String);

impl std::fmt::Display for AttentionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "attention: {}", self.0)
    }
}

impl std::error::Error for AttentionError {}

/// Sizes of one call. Queries and keys are laid out per request, padded to `queries` and `keys`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub requests: usize,
    pub queries: usize,
    pub keys: usize,
    /// Rows of `q` and `out` (the flat token rows).
    pub rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub dim: usize,
    pub dim_v: usize,
    /// Rows of the KV pool.
    pub slots: usize,
}

/// What one call reads. `q` is [rows, heads, dim]; `k_cache` [slots, kv_heads, dim] and `v_cache`
/// [slots, kv_heads, dim_v]; `key_loc` [requests, keys] the pool slot of each key; `mask` [requests,
/// queries, keys] which keys each query sees; `query_row` [requests, queries] the row of `q` and `out`
/// of each query slot, used where `query_valid` [requests, queries] is true.
pub struct Inputs<'a, T> {
    pub q: &'a [T],
    pub k_cache: &'a [T],
    pub v_cache: &'a [T],
    pub key_loc: &'a [i64],
    pub mask: &'a [bool],
    pub query_row: &'a [i64],
    pub query_valid: &'a [bool],
    pub scale: f32,
}

fn check(
    shape: &Shape,
    x: &Inputs<'_, impl Element>,
    out_len: usize,
) -> Result<(), AttentionError> {
    let s = shape;
    if s.dim == 0 {
        return Err(AttentionError("heads of dimension 0".into()));
    }
    if s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) {
        return Err(AttentionError(format!(
            "{} query heads cannot share {} KV heads",
            s.heads, s.kv_heads
        )));
    }
    let lengths = [
        ("q", x.q.len(), s.rows * s.heads * s.dim),
        ("k_cache", x.k_cache.len(), s.slots * s.kv_heads * s.dim),
        ("v_cache", x.v_cache.len(), s.slots * s.kv_heads * s.dim_v),
        ("key_loc", x.key_loc.len(), s.requests * s.keys),
        ("mask", x.mask.len(), s.requests * s.queries * s.keys),
        ("query_row", x.query_row.len(), s.requests * s.queries),
        ("query_valid", x.query_valid.len(), s.requests * s.queries),
        ("out", out_len, s.rows * s.heads * s.dim_v),
    ];
    for (name, len, want) in lengths {
        if len != want {
            return Err(AttentionError(format!(
                "{name} holds {len} values, {want} expected for {s:?}"
            )));
        }
    }
    if let Some(slot) = x.key_loc.iter().find(|&&v| v < 0 || v as usize >= s.slots) {
        return Err(AttentionError(format!(
            "key slot {slot} is outside the pool of {} slots",
            s.slots
        )));
    }
    Ok(())
}

/// One task: request `request`, KV head `kv_head`, and its query rows `rows` (query index, head).
struct Task<'a, T> {
    request: usize,
    kv_head: usize,
    rows: Vec<(usize, usize)>,
    outs: Vec<&'a mut [T]>,
}

/// `out[query_row[r, i], h] = softmax(q[query_row[r, i], h] · K_r^T * scale, masked by mask[r, i]) V_r`
/// for every valid query slot (r, i) and head h, where K_r, V_r are the pool rows of `key_loc[r]` under
/// h's KV head. Rows of `out` no valid slot names are left as they are; a query that sees no key gets
/// zeros. Two valid slots naming one row are an error.
pub fn attend<T: Element>(
    shape: &Shape,
    inputs: &Inputs<'_, T>,
    out: &mut [T],
) -> Result<(), AttentionError> {
    attend_with(shape, inputs, out, Path::Fastest)
}

/// Which kernels a call runs: the fastest this CPU has, or the portable loops (which tests check
/// directly, since the machines they run on take the AVX-512 path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Fastest,
    #[cfg_attr(not(test), allow(dead_code))]
    Portable,
}

fn attend_with<T: Element>(
    shape: &Shape,
    inputs: &Inputs<'_, T>,
    out: &mut [T],
    path: Path,
) -> Result<(), AttentionError> {
    check(shape, inputs, out.len())?;
    let s = *shape;
    if s.rows == 0 || s.heads == 0 || s.dim_v == 0 {
        return Ok(());
    }
    let group = s.heads / s.kv_heads;
    let query_rows = inputs.query_valid.iter().filter(|&&valid| valid).count() * s.heads;
    let per_task = if query_rows >= LONG_ROWS_PER_TASK * TASKS_PER_THREAD * team::threads() {
        LONG_ROWS_PER_TASK
    } else {
        ROWS_PER_TASK
    };
    // Hand each (row, head) stretch of `out` to the one task that writes it; the (uncontended) locks
    // only carry the `&mut`s to whichever thread claims the task.
    let mut stretches: Vec<Option<&mut [T]>> = out.chunks_exact_mut(s.dim_v).map(Some).collect();
    let mut tasks: Vec<Mutex<Task<'_, T>>> = Vec::new();
    for request in 0..s.requests {
        let slots = request * s.queries..(request + 1) * s.queries;
        let valid: Vec<(usize, usize)> = slots
            .filter(|&slot| inputs.query_valid[slot])
            .map(|slot| {
                let row = inputs.query_row[slot];
                if row < 0 || row as usize >= s.rows {
                    return Err(AttentionError(format!(
                        "query row {row} is outside the {} rows of q",
                        s.rows
                    )));
                }
                Ok((slot - request * s.queries, row as usize))
            })
            .collect::<Result<_, _>>()?;
        for kv_head in 0..s.kv_heads {
            let mut rows = Vec::with_capacity(valid.len() * group);
            let mut outs = Vec::with_capacity(valid.len() * group);
            for &(query, row) in &valid {
                for head in kv_head * group..(kv_head + 1) * group {
                    let stretch = stretches[row * s.heads + head].take().ok_or_else(|| {
                        AttentionError(format!("two query slots name row {row} of q"))
                    })?;
                    rows.push((query, head));
                    outs.push(stretch);
                }
            }
            while !rows.is_empty() {
                let take = rows.len().min(per_task);
                let rest_rows = rows.split_off(take);
                let rest_outs = outs.split_off(take);
                tasks.push(Mutex::new(Task {
                    request,
                    kv_head,
                    rows: std::mem::replace(&mut rows, rest_rows),
                    outs: std::mem::replace(&mut outs, rest_outs),
                }));
            }
        }
    }
    team::for_each_index(tasks.len(), &|index| {
        let mut task = tasks[index].lock().unwrap_or_else(PoisonError::into_inner);
        run_task(&s, inputs, &mut task, path);
    });
    Ok(())
}

fn run_task<T: Element>(s: &Shape, x: &Inputs<'_, T>, task: &mut Task<'_, T>, path: Path) {
    // The scratch is borrowed out here: code the compiler does not inline into `wide` (the thread-local's
    // `with` closure, a closure handed to a helper) is compiled for the baseline CPU, without AVX-512.
    SCRATCH.with_borrow_mut(|scratch| {
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx512bw,avx2")]
            unsafe fn wide<T: Element>(
                s: &Shape,
                x: &Inputs<'_, T>,
                task: &mut Task<'_, T>,
                scratch: &mut Scratch,
            ) {
                task_body::<T, avx512::Blocks>(s, x, task, scratch)
            }
            if path == Path::Fastest
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
            {
                // SAFETY: `wide` only enables AVX-512F/BW and AVX2, which this CPU has (AVX-512F
                // implies AVX2; checked just above); its arguments are safe references.
                return unsafe { wide(s, x, task, scratch) };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = path; // one path only here
        task_body::<T, Portable>(s, x, task, scratch)
    })
}

/// Buffers a thread reuses from task to task: fresh ones cost page faults and clearing, as much as the
/// arithmetic of a decode step's task.
#[derive(Default)]
struct Scratch {
    key_rows: Vec<f32>,
    values: Vec<f32>,
    queries: Vec<f32>,
    weights: Vec<f32>,
    sums: Vec<f32>,
    seen: Vec<bool>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// The first `len` values of `buffer`, grown if needed; their contents are whatever was there.
fn sized<V: Copy + Default>(buffer: &mut Vec<V>, len: usize) -> &mut [V] {
    if buffer.len() < len {
        buffer.resize(len, V::default());
    }
    &mut buffer[..len]
}

/// `dst = src` as float32, zero-padded to `dst`'s length.
#[inline(always)]
fn widen<T: Element>(dst: &mut [f32], src: &[T]) {
    let (head, tail) = dst.split_at_mut(src.len());
    for (d, v) in head.iter_mut().zip(src) {
        *d = v.to_f32();
    }
    tail.fill(0.0);
}

/// Which of the first `keys` keys at least one of the task's rows sees, in `buffer`. Past the last of
/// them every row's weights are exact zeros, which change no sum: a task stops there (the early rows of
/// a causal prefill skip the later keys) and its rows get the bits they would over all the keys.
fn seen_by_any<'b, T>(
    task: &Task<'_, T>,
    masks: &[bool],
    keys: usize,
    buffer: &'b mut Vec<bool>,
) -> &'b [bool] {
    let seen = sized(buffer, keys);
    seen.fill(false);
    let mut previous = None;
    for &(query, _) in &task.rows {
        // A query's heads sit side by side in the task: its mask row is read once.
        if previous.replace(query) == Some(query) {
            continue;
        }
        for (any, &sees) in seen.iter_mut().zip(&masks[query * keys..][..keys]) {
            *any |= sees;
        }
    }
    seen
}

/// One task's work: gather its request's keys and values under its KV head as float32, score them
/// against its query rows, softmax each row over the keys it sees, and sum the values. Keys no row of the
/// task sees stay zero, so an unwritten pool slot (any bits) never reaches a sum.
#[inline(always)]
fn task_body<T: Element, K: Kernels>(
    s: &Shape,
    x: &Inputs<'_, T>,
    task: &mut Task<'_, T>,
    scratch: &mut Scratch,
) {
    let (dim, dim_v) = (s.dim, s.dim_v);
    let lanes_q = dim.div_ceil(DOT_LANES) * DOT_LANES;
    let lanes_v = dim_v.div_ceil(VALUE_BLOCK) * VALUE_BLOCK;
    let rows = task.rows.len();
    // Mask rows are `s.keys` long; the task reads only up to the last key any of its rows sees.
    let masks = &x.mask[task.request * s.queries * s.keys..][..s.queries * s.keys];
    let seen = seen_by_any(task, masks, s.keys, &mut scratch.seen);
    let keys = seen.iter().rposition(|&any| any).map_or(0, |last| last + 1);
    if keys == 0 {
        // No key to see: zeros, as for a query whose mask hides every key.
        for out in task.outs.iter_mut() {
            out.fill(T::from_f32(0.0));
        }
        return;
    }
    // Scores are taken KEY_BLOCK keys at a time; the padding keys are zeros no softmax reads.
    let keys_padded = keys.div_ceil(KEY_BLOCK) * KEY_BLOCK;
    let key_rows = sized(&mut scratch.key_rows, keys_padded * lanes_q); // [keys_padded, lanes_q]
    let values = sized(&mut scratch.values, keys * lanes_v); // [keys, lanes_v]
    for (j, (key, value)) in key_rows
        .chunks_exact_mut(lanes_q)
        .zip(values.chunks_exact_mut(lanes_v))
        .enumerate()
    {
        if !seen[j] {
            key.fill(0.0);
            value.fill(0.0);
            continue;
        }
        let base = x.key_loc[task.request * s.keys + j] as usize * s.kv_heads + task.kv_head;
        widen(key, &x.k_cache[base * dim..][..dim]);
        widen(value, &x.v_cache[base * dim_v..][..dim_v]);
    }
    key_rows[keys * lanes_q..].fill(0.0);
    let queries = sized(&mut scratch.queries, rows * lanes_q); // [rows, lanes_q]
    for (n, &(query, head)) in task.rows.iter().enumerate() {
        let row = x.query_row[task.request * s.queries + query] as usize;
        widen(
            &mut queries[n * lanes_q..][..lanes_q],
            &x.q[(row * s.heads + head) * dim..][..dim],
        );
    }
    // [rows, keys_padded]: scores, then softmax numerators
    let weights = sized(&mut scratch.weights, rows * keys_padded);
    K::scores(queries, key_rows, lanes_q, x.scale, weights);
    for (&(query, _), row) in task.rows.iter().zip(weights.chunks_exact_mut(keys_padded)) {
        softmax_numerators(&mut row[..keys], &masks[query * s.keys..][..keys]);
    }
    let sums = sized(&mut scratch.sums, rows * lanes_v); // [rows, lanes_v]
    let mut totals = [0.0f32; LONG_ROWS_PER_TASK];
    let weighted = Weighted {
        weights,
        stride: keys_padded,
        values,
        keys,
        lanes_v,
    };
    K::weighted_sums(weighted, sums, &mut totals);
    for ((out, row_sums), total) in task
        .outs
        .iter_mut()
        .zip(sums.chunks_exact(lanes_v))
        .zip(totals)
    {
        let inverse = if total > 0.0 { 1.0 / total } else { 0.0 };
        for (o, acc) in out.iter_mut().zip(row_sums) {
            *o = T::from_f32(acc * inverse);
        }
    }
}

/// How a task takes its scores and weighted sums: the portable loops below, or AVX-512 blocks where
/// `wide` runs. Each computes every score and every output column by one fixed sequence of operations
/// whatever the other rows and keys of the call, so on one machine a row's result depends only on its
/// own query, the keys it sees and their values.
trait Kernels {
    /// `scores[n * keys_padded + j] = (queries[n] · key_rows[j]) * scale`: rows of `lanes_q` floats,
    /// `keys_padded` (a multiple of `KEY_BLOCK`) key rows.
    fn scores(queries: &[f32], key_rows: &[f32], lanes_q: usize, scale: f32, scores: &mut [f32]);
    /// Row n's weighted sum of the values into `sums[n * lanes_v..]` and the sum of its weights into
    /// `totals[n]`, both over the first `keys` keys in their order: a key the row does not see (weight 0)
    /// changes neither, wherever it sits.
    fn weighted_sums(w: Weighted<'_>, sums: &mut [f32], totals: &mut [f32]);
}

/// What the weighted sums read: softmax numerators, row n at `weights[n * stride..]` (its first `keys`
/// used), and the gathered values, `[keys, lanes_v]`.
#[derive(Clone, Copy)]
struct Weighted<'a> {
    weights: &'a [f32],
    stride: usize,
    values: &'a [f32],
    keys: usize,
    lanes_v: usize,
}

struct Portable;

impl Kernels for Portable {
    #[inline(always)]
    fn scores(queries: &[f32], key_rows: &[f32], lanes_q: usize, scale: f32, scores: &mut [f32]) {
        let keys_padded = key_rows.len() / lanes_q;
        for (q, row) in queries
            .chunks_exact(lanes_q)
            .zip(scores.chunks_exact_mut(keys_padded))
        {
            for (w, k) in row.iter_mut().zip(key_rows.chunks_exact(lanes_q)) {
                *w = dot(q, k) * scale;
            }
        }
    }

    #[inline(always)]
    fn weighted_sums(w: Weighted<'_>, sums: &mut [f32], totals: &mut [f32]) {
        for ((row, dst), total) in w
            .weights
            .chunks_exact(w.stride)
            .zip(sums.chunks_exact_mut(w.lanes_v))
            .zip(totals)
        {
            *total = weighted_sum(&row[..w.keys], w.values, w.lanes_v, dst);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Weighted, KEY_BLOCK, VALUE_BLOCK};
    use std::arch::x86_64::*;

    /// Only `run_task`'s `wide`, which runs after detecting AVX-512F, instantiates a task with it.
    pub(super) struct Blocks;

    impl super::Kernels for Blocks {
        #[inline(always)]
        fn scores(
            queries: &[f32],
            key_rows: &[f32],
            lanes_q: usize,
            scale: f32,
            scores: &mut [f32],
        ) {
            // SAFETY: this impl is used only inside `wide`, on a CPU with AVX-512F (see `Blocks`).
            unsafe { score_rows(queries, key_rows, lanes_q, scale, scores) }
        }

        #[inline(always)]
        fn weighted_sums(w: Weighted<'_>, sums: &mut [f32], totals: &mut [f32]) {
            let rows = sums.len() / w.lanes_v;
            let mut first = 0;
            while first < rows {
                let tile = Weighted {
                    weights: &w.weights[first * w.stride..],
                    ..w
                };
                let (out, total) = (&mut sums[first * w.lanes_v..], &mut totals[first..]);
                // SAFETY: as above.
                first += unsafe {
                    match rows - first {
                        4.. => value_tile::<4>(tile, out, total),
                        3 => value_tile::<3>(tile, out, total),
                        2 => value_tile::<2>(tile, out, total),
                        _ => value_tile::<1>(tile, out, total),
                    }
                };
            }
        }
    }

    /// Every row's scores, `KEY_BLOCK` keys at a time, two rows at once: each key vector loaded feeds
    /// both rows. A score is its key's 16-lane partial sums (the column chunks in order), folded by
    /// `fold8`: the same operations whether its row was paired or not.
    #[target_feature(enable = "avx512f")]
    fn score_rows(queries: &[f32], key_rows: &[f32], lanes_q: usize, scale: f32, out: &mut [f32]) {
        let keys_padded = key_rows.len() / lanes_q;
        let rows = queries.len() / lanes_q;
        let mut first = 0;
        while first < rows {
            let (q, dst) = (&queries[first * lanes_q..], &mut out[first * keys_padded..]);
            first += match rows - first {
                2.. => score_tile::<2>(q, key_rows, lanes_q, scale, dst),
                _ => score_tile::<1>(q, key_rows, lanes_q, scale, dst),
            };
        }
    }

    /// The scores of R query rows against every key row; returns R.
    #[target_feature(enable = "avx512f")]
    fn score_tile<const R: usize>(
        queries: &[f32],
        key_rows: &[f32],
        lanes_q: usize,
        scale: f32,
        out: &mut [f32],
    ) -> usize {
        let keys_padded = key_rows.len() / lanes_q;
        // Every access below falls inside these ranges, checked here once.
        assert!(lanes_q.is_multiple_of(16) && keys_padded.is_multiple_of(KEY_BLOCK));
        assert!(queries.len() >= R * lanes_q && out.len() >= R * keys_padded);
        let (qp, kp) = (queries.as_ptr(), key_rows.as_ptr());
        let scale = _mm256_set1_ps(scale);
        for block in (0..keys_padded).step_by(KEY_BLOCK) {
            let mut acc = [[_mm512_setzero_ps(); KEY_BLOCK]; R];
            for c in (0..lanes_q).step_by(16) {
                let mut qv = [_mm512_setzero_ps(); R];
                for (r, q) in qv.iter_mut().enumerate() {
                    // SAFETY: r * lanes_q + c + 16 <= R * lanes_q <= queries.len().
                    *q = unsafe { _mm512_loadu_ps(qp.add(r * lanes_q + c)) };
                }
                for j in 0..KEY_BLOCK {
                    // SAFETY: (block + j) * lanes_q + c + 16 <= keys_padded * lanes_q.
                    let kv = unsafe { _mm512_loadu_ps(kp.add((block + j) * lanes_q + c)) };
                    for (acc_r, q) in acc.iter_mut().zip(&qv) {
                        acc_r[j] = _mm512_fmadd_ps(*q, kv, acc_r[j]);
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                let scores = _mm256_mul_ps(fold8(acc_r), scale);
                // SAFETY: r * keys_padded + block + 8 <= R * keys_padded <= out.len().
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(r * keys_padded + block), scores) };
            }
        }
        R
    }

    /// Lane j of the result is the sum of the 16 lanes of `v[j]`, added in one pattern for every j:
    /// (x0 + x2) + (x1 + x3) within each 128-bit quarter, then (q0 + q1) + (q2 + q3) across quarters.
    #[target_feature(enable = "avx512f")]
    fn fold8(v: &[__m512; KEY_BLOCK]) -> __m256 {
        // [a0+a2, b0+b2, a1+a3, b1+b3] in each quarter
        let pairs = |a, b| _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        // [a, b, c, d], each (x0+x2)+(x1+x3) of its quarter, from two `pairs`
        let quads = |ab, cd| {
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b01_00_01_00>(ab, cd),
                _mm512_shuffle_ps::<0b11_10_11_10>(ab, cd),
            )
        };
        // quarters [x.q0 + x.q1, x.q2 + x.q3, y.q0 + y.q1, y.q2 + y.q3]
        let halves = |x, y| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
            )
        };
        let t0 = quads(pairs(v[0], v[1]), pairs(v[2], v[3]));
        let t1 = quads(pairs(v[4], v[5]), pairs(v[6], v[7]));
        let h = halves(t0, t1);
        // quarters [t0's sums, t1's sums, (again)]
        _mm512_castps512_ps256(halves(h, h))
    }

    /// Weighted sums of R rows: each value vector loaded once feeds the R rows' accumulators, each a
    /// chain of fused multiply-adds over the keys in order; the weights' totals are plain sums in the
    /// same order (taken along the first block of columns). Returns R.
    #[target_feature(enable = "avx512f")]
    fn value_tile<const R: usize>(w: Weighted<'_>, sums: &mut [f32], totals: &mut [f32]) -> usize {
        let Weighted {
            weights,
            stride,
            values,
            keys,
            lanes_v,
        } = w;
        // Every access below falls inside these ranges, checked here once.
        assert!(lanes_v.is_multiple_of(VALUE_BLOCK) && values.len() >= keys * lanes_v);
        assert!(keys <= stride && weights.len() >= (R - 1) * stride + keys);
        assert!(sums.len() >= R * lanes_v && totals.len() >= R);
        let mut total = [0.0f32; R];
        for column in (0..lanes_v).step_by(VALUE_BLOCK) {
            let mut acc = [[_mm512_setzero_ps(); 4]; R];
            for j in 0..keys {
                // SAFETY: j * lanes_v + column + 64 <= keys * lanes_v <= values.len().
                let v = unsafe {
                    let p = values.as_ptr().add(j * lanes_v + column);
                    [
                        _mm512_loadu_ps(p),
                        _mm512_loadu_ps(p.add(16)),
                        _mm512_loadu_ps(p.add(32)),
                        _mm512_loadu_ps(p.add(48)),
                    ]
                };
                for (r, (acc_r, total_r)) in acc.iter_mut().zip(total.iter_mut()).enumerate() {
                    let weight = weights[r * stride + j];
                    if column == 0 {
                        *total_r += weight;
                    }
                    let w = _mm512_set1_ps(weight);
                    for (a, &vi) in acc_r.iter_mut().zip(&v) {
                        *a = _mm512_fmadd_ps(w, vi, *a);
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                for (i, a) in acc_r.iter().enumerate() {
                    // SAFETY: r * lanes_v + column + 16 * i + 16 <= R * lanes_v <= sums.len().
                    unsafe {
                        _mm512_storeu_ps(sums.as_mut_ptr().add(r * lanes_v + column + 16 * i), *a)
                    };
                }
            }
        }
        totals[..R].copy_from_slice(&total);
        R
    }
}

/// `a · b` for rows of a multiple of `DOT_LANES`: lane l sums the products of the columns l, l + 16, ...
/// in order, then the lanes are added pairwise in a fixed tree. The same operations for every call, so
/// a score depends only on its query and key.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; DOT_LANES];
    for (a, b) in a.chunks_exact(DOT_LANES).zip(b.chunks_exact(DOT_LANES)) {
        // Fixed-length arrays, so the compiler sees one vector (a runtime-length zip it splits up).
        let a: &[f32; DOT_LANES] = a.try_into().expect("a chunk of DOT_LANES");
        let b: &[f32; DOT_LANES] = b.try_into().expect("a chunk of DOT_LANES");
        for l in 0..DOT_LANES {
            lanes[l] += a[l] * b[l];
        }
    }
    fold_lanes(lanes)
}

/// A row of scores in place becomes e^(score - max) where `mask` lets the query see the key, 0 where
/// not (the max over the seen keys; all zeros if it sees none). Exact whatever the lanes' order: a max.
#[inline(always)]
fn softmax_numerators(row: &mut [f32], mask: &[bool]) {
    // Whole chunks as fixed-size arrays and the tail apart, so that the lanes stay in registers (a
    // runtime-length chunk kept them in memory, a store and a load per chunk).
    let split = row.len() - row.len() % DOT_LANES;
    let mut lanes = [f32::NEG_INFINITY; DOT_LANES];
    let take_max = |lanes: &mut [f32; DOT_LANES], chunk: &[f32], seen: &[bool]| {
        for ((lane, &w), &seen) in lanes.iter_mut().zip(chunk).zip(seen) {
            *lane = if seen && w > *lane { w } else { *lane };
        }
    };
    for (chunk, seen) in row[..split]
        .chunks_exact(DOT_LANES)
        .zip(mask[..split].chunks_exact(DOT_LANES))
    {
        take_max(&mut lanes, chunk, seen);
    }
    take_max(&mut lanes, &row[split..], &mask[split..]);
    let max = lanes
        .iter()
        .fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
    for (w, &seen) in row.iter_mut().zip(mask) {
        let numerator = exp_f32(*w - max);
        *w = if seen { numerator } else { 0.0 };
    }
}

/// `sums = sum_j weights[j] * values[j]` over the keys in order, `VALUE_BLOCK` columns at a time in
/// independent vectors; returns `sum_j weights[j]`, also in order (taken along the first block).
#[inline(always)]
fn weighted_sum(weights: &[f32], values: &[f32], lanes_v: usize, sums: &mut [f32]) -> f32 {
    let mut total = 0.0f32;
    for (column, dst) in sums.chunks_exact_mut(VALUE_BLOCK).enumerate() {
        let mut acc = [0.0f32; VALUE_BLOCK];
        let mut sum = 0.0f32;
        for (&w, v) in weights.iter().zip(values.chunks_exact(lanes_v)) {
            let v: &[f32; VALUE_BLOCK] = v[column * VALUE_BLOCK..][..VALUE_BLOCK]
                .try_into()
                .expect("a block of VALUE_BLOCK columns");
            for (a, &value) in acc.iter_mut().zip(v) {
                *a += w * value;
            }
            sum += w;
        }
        dst.copy_from_slice(&acc);
        if column == 0 {
            total = sum;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm_bf16::{bf16_to_f32, f32_to_bf16};

    const PATHS: [Path; 2] = [Path::Fastest, Path::Portable];

    /// A small deterministic generator (no dependency for tests).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    /// The definition, in float64, one (request, query, head) at a time.
    fn reference(s: &Shape, x: &Inputs<'_, f32>) -> Vec<f32> {
        let mut out = vec![0.0f32; s.rows * s.heads * s.dim_v];
        let group = s.heads / s.kv_heads;
        for r in 0..s.requests {
            for i in 0..s.queries {
                let slot = r * s.queries + i;
                if !x.query_valid[slot] {
                    continue;
                }
                let row = x.query_row[slot] as usize;
                for h in 0..s.heads {
                    let g = h / group;
                    let q = &x.q[(row * s.heads + h) * s.dim..][..s.dim];
                    let visible: Vec<usize> =
                        (0..s.keys).filter(|&j| x.mask[slot * s.keys + j]).collect();
                    let score = |j: usize| {
                        let loc = x.key_loc[r * s.keys + j] as usize;
                        let k = &x.k_cache[(loc * s.kv_heads + g) * s.dim..][..s.dim];
                        q.iter()
                            .zip(k)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            * x.scale as f64
                    };
                    let max = visible.iter().map(|&j| score(j)).fold(f64::MIN, f64::max);
                    let mut total = 0.0;
                    let mut acc = vec![0.0f64; s.dim_v];
                    for &j in &visible {
                        let w = (score(j) - max).exp();
                        total += w;
                        let loc = x.key_loc[r * s.keys + j] as usize;
                        let v = &x.v_cache[(loc * s.kv_heads + g) * s.dim_v..][..s.dim_v];
                        for (a, b) in acc.iter_mut().zip(v) {
                            *a += w * *b as f64;
                        }
                    }
                    for (d, a) in acc.iter().enumerate() {
                        out[(row * s.heads + h) * s.dim_v + d] = if visible.is_empty() {
                            0.0
                        } else {
                            (a / total) as f32
                        };
                    }
                }
            }
        }
        out
    }

    struct Case {
        shape: Shape,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        key_loc: Vec<i64>,
        mask: Vec<bool>,
        query_row: Vec<i64>,
        query_valid: Vec<bool>,
    }

    impl Case {
        fn inputs(&self) -> Inputs<'_, f32> {
            Inputs {
                q: &self.q,
                k_cache: &self.k,
                v_cache: &self.v,
                key_loc: &self.key_loc,
                mask: &self.mask,
                query_row: &self.query_row,
                query_valid: &self.query_valid,
                scale: 0.125,
            }
        }
    }

    /// Requests with different numbers of queries (padding slots invalid), tree-like masks, keys in
    /// scattered pool slots, and 9 query heads over 3 KV heads.
    fn case(seed: u64, requests: usize, queries: usize, keys: usize) -> Case {
        let mut rng = Lcg(seed);
        let (heads, kv_heads, dim, dim_v, slots) = (9, 3, 64, 48, keys * requests + 7);
        let mut query_valid = vec![false; requests * queries];
        let mut query_row = vec![0i64; requests * queries];
        let mut rows = 0;
        for r in 0..requests {
            let count = 1 + (r * 5 + seed as usize) % queries;
            for i in 0..count {
                query_valid[r * queries + i] = true;
                query_row[r * queries + i] = rows as i64;
                rows += 1;
            }
        }
        let mask = (0..requests * queries * keys)
            .map(|_| rng.next() > -0.6)
            .collect();
        let key_loc = (0..requests * keys)
            .map(|i| ((i * 7919) % slots) as i64)
            .collect();
        let shape = Shape {
            requests,
            queries,
            keys,
            rows,
            heads,
            kv_heads,
            dim,
            dim_v,
            slots,
        };
        let mut fill = |n: usize| (0..n).map(|_| rng.next() * 2.0).collect::<Vec<f32>>();
        Case {
            q: fill(rows * heads * dim),
            k: fill(slots * kv_heads * dim),
            v: fill(slots * kv_heads * dim_v),
            shape,
            key_loc,
            mask,
            query_row,
            query_valid,
        }
    }

    #[test]
    fn matches_the_definition_in_float32() {
        // Keys below, at and past a block of 8; 1 to 32 queries (tiles of 1 and 2 rows for scores, 1 to 4
        // for values).
        for (seed, requests, queries, keys) in [
            (1, 1, 1, 5),
            (2, 1, 9, 300),
            (3, 4, 4, 37),
            (4, 3, 16, 17),
            (9, 2, 32, 8),
            (10, 1, 31, 9),
        ] {
            let c = case(seed, requests, queries, keys);
            let want = reference(&c.shape, &c.inputs());
            for path in PATHS {
                let mut out = vec![0.0f32; c.shape.rows * c.shape.heads * c.shape.dim_v];
                attend_with(&c.shape, &c.inputs(), &mut out, path).unwrap();
                for (a, b) in out.iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= 2e-5 * (1.0 + b.abs()),
                        "{path:?}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn matches_the_definition_in_bf16() {
        let c = case(5, 2, 9, 120);
        let bits = |v: &[f32]| v.iter().map(|&x| f32_to_bf16(x)).collect::<Vec<u16>>();
        let (q, k, v) = (bits(&c.q), bits(&c.k), bits(&c.v));
        let inputs = Inputs {
            q: &q,
            k_cache: &k,
            v_cache: &v,
            key_loc: &c.key_loc,
            mask: &c.mask,
            query_row: &c.query_row,
            query_valid: &c.query_valid,
            scale: 0.125,
        };
        let mut out = vec![0u16; c.shape.rows * c.shape.heads * c.shape.dim_v];
        attend(&c.shape, &inputs, &mut out).unwrap();
        let mut portable = vec![0u16; out.len()];
        attend_with(&c.shape, &inputs, &mut portable, Path::Portable).unwrap();
        // The reference on the same bf16 values, rounded once.
        let back = |v: &[u16]| v.iter().map(|&x| bf16_to_f32(x)).collect::<Vec<f32>>();
        let (qf, kf, vf) = (back(&q), back(&k), back(&v));
        let want = reference(
            &c.shape,
            &Inputs {
                q: &qf,
                k_cache: &kf,
                v_cache: &vf,
                ..c.inputs()
            },
        );
        for ((a, p), b) in out.iter().zip(&portable).zip(&want) {
            let (a, p) = (bf16_to_f32(*a), bf16_to_f32(*p));
            assert!((a - b).abs() <= 8e-3 * (1.0 + b.abs()), "{a} vs {b}");
            assert!(
                (p - b).abs() <= 8e-3 * (1.0 + b.abs()),
                "portable: {p} vs {b}"
            );
        }
    }

    /// A query's output is bit-identical alone and among others, with its keys moved to other columns
    /// and unseen keys between them: decode and tree verify agree exactly.
    #[test]
    fn a_row_does_not_depend_on_the_others() {
        for path in PATHS {
            row_alone_and_among_others(path);
        }
    }

    fn row_alone_and_among_others(path: Path) {
        let c = case(6, 1, 9, 40);
        let mut out = vec![0.0f32; c.shape.rows * c.shape.heads * c.shape.dim_v];
        attend_with(&c.shape, &c.inputs(), &mut out, path).unwrap();
        let visible: Vec<usize> = (0..c.shape.keys).filter(|&j| c.mask[j]).collect();
        // The same query alone, its visible keys in the same order but at other columns, among unseen ones.
        let keys = visible.len() * 2 + 3;
        let mut key_loc = vec![0i64; keys];
        let mut mask = vec![false; keys];
        for (n, &j) in visible.iter().enumerate() {
            key_loc[2 * n + 1] = c.key_loc[j];
            mask[2 * n + 1] = true;
        }
        let shape = Shape {
            queries: 1,
            keys,
            rows: 1,
            ..c.shape
        };
        let q = c.q[..c.shape.heads * c.shape.dim].to_vec();
        let inputs = Inputs {
            q: &q,
            key_loc: &key_loc,
            mask: &mask,
            query_row: &[0],
            query_valid: &[true],
            ..c.inputs()
        };
        let mut alone = vec![0.0f32; c.shape.heads * c.shape.dim_v];
        attend_with(&shape, &inputs, &mut alone, path).unwrap();
        assert_eq!(alone, out[..alone.len()].to_vec(), "{path:?}");
    }

    /// A causal prefill long enough for the long tasks (`LONG_ROWS_PER_TASK`), each of whose tasks stops
    /// at its last row's keys: every query gets the bits it gets decoded alone over its prefix, so a
    /// prompt's K/V do not depend on whether a prefill or decode steps computed them.
    #[test]
    fn a_prefill_row_equals_its_decode() {
        for path in PATHS {
            prefill_rows_against_decodes(path);
        }
    }

    fn prefill_rows_against_decodes(path: Path) {
        let queries = 400;
        let mut c = case(8, 1, queries, queries);
        assert!(queries * c.shape.heads >= LONG_ROWS_PER_TASK * TASKS_PER_THREAD * 2);
        c.query_valid.fill(true);
        for (i, row) in c.query_row.iter_mut().enumerate() {
            *row = i as i64;
        }
        for (n, sees) in c.mask.iter_mut().enumerate() {
            *sees = n % queries <= n / queries;
        }
        let shape = Shape {
            rows: queries,
            ..c.shape
        };
        // Every slot is a query now: a row of q for each.
        let mut rng = Lcg(9);
        let q: Vec<f32> = (0..queries * shape.heads * shape.dim)
            .map(|_| rng.next() * 2.0)
            .collect();
        let inputs = Inputs {
            q: &q,
            ..c.inputs()
        };
        let mut out = vec![0.0f32; queries * shape.heads * shape.dim_v];
        attend_with(&shape, &inputs, &mut out, path).unwrap();
        let stretch = shape.heads * shape.dim_v;
        for i in (0..queries).step_by(37).chain([queries - 1]) {
            let decode = Shape {
                queries: 1,
                keys: i + 1,
                rows: 1,
                ..shape
            };
            let row_q = &q[i * shape.heads * shape.dim..][..shape.heads * shape.dim];
            let alone_inputs = Inputs {
                q: row_q,
                key_loc: &c.key_loc[..i + 1],
                mask: &vec![true; i + 1],
                query_row: &[0],
                query_valid: &[true],
                ..c.inputs()
            };
            let mut alone = vec![0.0f32; stretch];
            attend_with(&decode, &alone_inputs, &mut alone, path).unwrap();
            assert_eq!(alone, out[i * stretch..][..stretch], "{path:?}, query {i}");
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let c = case(7, 2, 4, 10);
        let mut out = vec![0.0f32; c.shape.rows * c.shape.heads * c.shape.dim_v];
        let mut key_loc = c.key_loc.clone();
        key_loc[3] = c.shape.slots as i64;
        let err = attend(
            &c.shape,
            &Inputs {
                key_loc: &key_loc,
                ..c.inputs()
            },
            &mut out,
        )
        .unwrap_err();
        assert!(err.0.contains("outside the pool"), "{err}");
        let mut query_row = c.query_row.clone();
        query_row[1] = 0;
        let err = attend(
            &c.shape,
            &Inputs {
                query_row: &query_row,
                ..c.inputs()
            },
            &mut out,
        )
        .unwrap_err();
        assert!(err.0.contains("two query slots"), "{err}");
        let err = attend(&c.shape, &c.inputs(), &mut out[1..]).unwrap_err();
        assert!(err.0.contains("out holds"), "{err}");
        let shape = Shape {
            kv_heads: 2,
            ..c.shape
        };
        assert!(attend(&shape, &c.inputs(), &mut out).is_err());
        let shape = Shape { dim: 0, ..c.shape };
        assert!(attend(&shape, &c.inputs(), &mut out).is_err());
    }

    #[test]
    fn no_keys_give_zeros() {
        let c = case(11, 2, 3, 4);
        let shape = Shape { keys: 0, ..c.shape };
        let inputs = Inputs {
            key_loc: &[],
            mask: &[],
            ..c.inputs()
        };
        let mut out = vec![1.0f32; c.shape.rows * c.shape.heads * c.shape.dim_v];
        attend(&shape, &inputs, &mut out).unwrap();
        assert!(out.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn unwritten_slots_never_reach_a_sum() {
        let mut c = case(8, 1, 4, 12);
        // Key 0's slot holds NaN and no query sees key 0.
        for i in 0..c.shape.queries {
            c.mask[i * c.shape.keys] = false;
        }
        let slot = c.key_loc[0] as usize;
        let width = c.shape.kv_heads * c.shape.dim;
        c.k[slot * width..(slot + 1) * width].fill(f32::NAN);
        let width_v = c.shape.kv_heads * c.shape.dim_v;
        c.v[slot * width_v..(slot + 1) * width_v].fill(f32::NAN);
        // No other key may share that slot.
        for j in 1..c.shape.keys {
            if c.key_loc[j] as usize == slot {
                c.key_loc[j] = ((slot + 1) % c.shape.slots) as i64;
            }
        }
        let mut out = vec![0.0f32; c.shape.rows * c.shape.heads * c.shape.dim_v];
        attend(&c.shape, &c.inputs(), &mut out).unwrap();
        assert!(out.iter().all(|x| x.is_finite()));
    }
}
