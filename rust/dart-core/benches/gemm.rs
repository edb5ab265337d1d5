//! Few-row matmul benchmark: SmolLM2-135M's layer shapes (qkv 576->960, o 576->576, gate/up 576->3072,
//! down 1536->576) at 1, 8 and 16 rows, with 30 copies of each weight so that, as in serving, they stream
//! from memory rather than sit in cache. Run: `cargo bench -p dart-core --bench gemm`.
use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use dart_core::gemm::skinny_matmul;
use dart_core::gemm_bf16::{f32_to_bf16, skinny_matmul_bf16};

mod common;
use common::values;

const LAYERS: usize = 30;
const SHAPES: [(usize, usize); 4] = [(960, 576), (576, 576), (3072, 576), (576, 1536)];

fn bench_model_linears(c: &mut Criterion) {
    let weights: Vec<Vec<Vec<f32>>> = (0..LAYERS)
        .map(|layer| {
            SHAPES
                .iter()
                .enumerate()
                .map(|(i, (n, k))| values(n * k, (layer * 8 + i) as u64))
                .collect()
        })
        .collect();
    let bytes: usize = SHAPES.iter().map(|(n, k)| n * k * 4).sum::<usize>() * LAYERS;
    let mut group = c.benchmark_group("linears of 30 layers");
    group.measurement_time(Duration::from_secs(10));
    group.throughput(Throughput::Bytes(bytes as u64));
    for rows in [1usize, 8, 16] {
        let inputs: Vec<Vec<f32>> = SHAPES.iter().map(|(_, k)| values(rows * k, 99)).collect();
        let mut outs: Vec<Vec<f32>> = SHAPES.iter().map(|(n, _)| vec![0.0; rows * n]).collect();
        group.bench_with_input(BenchmarkId::from_parameter(rows), &rows, |b, &rows| {
            b.iter(|| {
                for layer in &weights {
                    for (i, (n, k)) in SHAPES.iter().enumerate() {
                        skinny_matmul(&inputs[i], &layer[i], &mut outs[i], rows, *k, *n).unwrap();
                    }
                }
                black_box(&outs);
            })
        });
    }
    group.finish();
}

/// The same layers in bf16 (`gemm_bf16`; the portable path where the CPU lacks AVX512-BF16).
fn bench_model_linears_bf16(c: &mut Criterion) {
    let bits = |v: Vec<f32>| v.into_iter().map(f32_to_bf16).collect::<Vec<u16>>();
    let weights: Vec<Vec<Vec<u16>>> = (0..LAYERS)
        .map(|layer| {
            SHAPES
                .iter()
                .enumerate()
                .map(|(i, (n, k))| bits(values(n * k, (layer * 8 + i) as u64)))
                .collect()
        })
        .collect();
    let bytes: usize = SHAPES.iter().map(|(n, k)| n * k * 2).sum::<usize>() * LAYERS;
    let mut group = c.benchmark_group("bf16 linears of 30 layers");
    group.measurement_time(Duration::from_secs(10));
    group.throughput(Throughput::Bytes(bytes as u64));
    for rows in [1usize, 8, 16] {
        let inputs: Vec<Vec<u16>> = SHAPES
            .iter()
            .map(|(_, k)| bits(values(rows * k, 99)))
            .collect();
        let mut outs: Vec<Vec<u16>> = SHAPES.iter().map(|(n, _)| vec![0; rows * n]).collect();
        group.bench_with_input(BenchmarkId::from_parameter(rows), &rows, |b, &rows| {
            b.iter(|| {
                for layer in &weights {
                    for (i, (n, k)) in SHAPES.iter().enumerate() {
                        skinny_matmul_bf16(&inputs[i], &layer[i], &mut outs[i], rows, *k, *n)
                            .unwrap();
                    }
                }
                black_box(&outs);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_model_linears, bench_model_linears_bf16);
criterion_main!(benches);
