//! Row-wise layer ops benchmark: what SmolLM2-135M's 30 layers do besides products (two residual
//! add-norms of 576, a SiLU-and-mul of 2 x 1536, a rotary over 9 + 3 heads of 64), in bf16, at 1, 16 and
//! 64 rows, as dispatched (the CPU's widest vectors) and as the portable build computes them: the ratio
//! between the two is what the vector versions buy. Run: `cargo bench -p dart-core --bench rowwise`.
use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use dart_core::gemm_bf16::f32_to_bf16;
use dart_core::rowwise::{self, portable};

mod common;
use common::values;

const LAYERS: usize = 30;
const HIDDEN: usize = 576;
const INTERMEDIATE: usize = 1536;
const HEAD: usize = 64;
const ROTATED: usize = (9 + 3) * HEAD;

/// `common::values` in [-2, 2), as bf16 bits.
fn bits(len: usize, seed: u64) -> Vec<u16> {
    values(len, seed)
        .into_iter()
        .map(|v| f32_to_bf16(2.0 * v))
        .collect()
}

struct Layer {
    x: Vec<u16>,
    residual: Vec<u16>,
    gate_up: Vec<u16>,
    act: Vec<u16>,
    qk: Vec<u16>,
}

fn bench_layers(c: &mut Criterion) {
    let weight = bits(HIDDEN, 1);
    let (cos, sin) = (bits(HEAD / 2, 2), bits(HEAD / 2, 3));
    let mut group = c.benchmark_group("row-wise ops of 30 layers, bf16");
    group.measurement_time(Duration::from_secs(5));
    for rows in [1usize, 16, 64] {
        let mut layers: Vec<Layer> = (0..LAYERS as u64)
            .map(|l| Layer {
                x: bits(rows * HIDDEN, 10 + l),
                residual: bits(rows * HIDDEN, 100 + l),
                gate_up: bits(rows * 2 * INTERMEDIATE, 200 + l),
                act: vec![0; rows * INTERMEDIATE],
                qk: bits(rows * ROTATED, 300 + l),
            })
            .collect();
        for (name, wide) in [("dispatched", true), ("portable", false)] {
            group.bench_with_input(BenchmarkId::new(name, rows), &rows, |b, _| {
                b.iter(|| {
                    for layer in layers.iter_mut() {
                        for (x, r) in layer
                            .x
                            .chunks_exact_mut(HIDDEN)
                            .zip(layer.residual.chunks_exact_mut(HIDDEN))
                        {
                            if wide {
                                rowwise::add_rms_norm_row(x, r, &weight, 1e-5);
                                rowwise::add_rms_norm_row(x, r, &weight, 1e-5);
                            } else {
                                portable::add_rms_norm_row(x, r, &weight, 1e-5);
                                portable::add_rms_norm_row(x, r, &weight, 1e-5);
                            }
                        }
                        for (g, a) in layer
                            .gate_up
                            .chunks_exact(2 * INTERMEDIATE)
                            .zip(layer.act.chunks_exact_mut(INTERMEDIATE))
                        {
                            if wide {
                                rowwise::silu_and_mul_row(g, a);
                            } else {
                                portable::silu_and_mul_row(g, a);
                            }
                        }
                        for qk in layer.qk.chunks_exact_mut(ROTATED) {
                            if wide {
                                rowwise::rotary_row(qk, &cos, &sin, HEAD, true);
                            } else {
                                portable::rotary_row(qk, &cos, &sin, HEAD, true);
                            }
                        }
                    }
                    black_box(&layers);
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_layers);
criterion_main!(benches);
