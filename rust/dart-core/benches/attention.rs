//! Few-query attention benchmark: one layer of SmolLM2-135M (9 query heads over 3 KV heads of 64) in
//! bf16, one request with 300 cached tokens in scattered pool slots, decoding one query and verifying
//! trees of 4, 8 and 16; 16 requests decoding one query each; and a long context (2,000 cached tokens)
//! decoded and verified in trees of 8 and 16. Run: `cargo bench -p dart-core --bench attention`.
use std::hint::black_box;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion};
use dart_core::attention::{attend, Inputs, Shape};
use dart_core::gemm_bf16::f32_to_bf16;

mod common;
use common::values;

const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const DIM: usize = 64;
const SLOTS: usize = 16_384;

fn bits(len: usize, seed: u64) -> Vec<u16> {
    values(len, seed)
        .into_iter()
        .map(|v| f32_to_bf16(2.0 * v))
        .collect()
}

fn bench_attention(c: &mut Criterion) {
    let k_cache = bits(SLOTS * KV_HEADS * DIM, 1);
    let v_cache = bits(SLOTS * KV_HEADS * DIM, 2);
    let shapes: [(usize, &[(usize, usize)]); 2] = [
        (300, &[(1, 1), (1, 4), (1, 8), (1, 16), (16, 1)]),
        (2000, &[(1, 1), (1, 8), (1, 16)]),
    ];
    for (cached, calls) in shapes {
        let name = format!("attention of one layer, bf16, {cached} cached tokens");
        let mut group = c.benchmark_group(name);
        group.measurement_time(Duration::from_secs(4));
        for &(requests, queries) in calls {
            bench_call(&mut group, &k_cache, &v_cache, cached, requests, queries);
        }
        group.finish();
    }
}

/// One call shape: `requests` requests of `cached` tokens each verifying `queries` queries.
fn bench_call(
    group: &mut BenchmarkGroup<'_, WallTime>,
    k_cache: &[u16],
    v_cache: &[u16],
    cached: usize,
    requests: usize,
    queries: usize,
) {
    let keys = cached + queries;
    let shape = Shape {
        requests,
        queries,
        keys,
        rows: requests * queries,
        heads: HEADS,
        kv_heads: KV_HEADS,
        dim: DIM,
        dim_v: DIM,
        slots: SLOTS,
    };
    let q = bits(shape.rows * HEADS * DIM, 3);
    // Scattered slots, as a pool that has served a while gives them.
    let key_loc: Vec<i64> = (0..requests * keys)
        .map(|i| ((i * 7919 + 13) % SLOTS) as i64)
        .collect();
    // Every query sees the cache and a chain of the new tokens up to itself.
    let mask: Vec<bool> = (0..requests * queries * keys)
        .map(|i| {
            let (query, key) = ((i / keys) % queries, i % keys);
            key < cached + query + 1
        })
        .collect();
    let query_row: Vec<i64> = (0..shape.rows as i64).collect();
    let query_valid = vec![true; shape.rows];
    let inputs = Inputs {
        q: &q,
        k_cache,
        v_cache,
        key_loc: &key_loc,
        mask: &mask,
        query_row: &query_row,
        query_valid: &query_valid,
        scale: 0.125,
    };
    let mut out = vec![0u16; shape.rows * HEADS * DIM];
    let id = BenchmarkId::new(format!("{requests} requests"), format!("{queries} queries"));
    group.bench_with_input(id, &shape, |b, shape| {
        b.iter(|| {
            attend(shape, &inputs, &mut out).unwrap();
            black_box(&out);
        })
    });
}

criterion_group!(benches, bench_attention);
criterion_main!(benches);
