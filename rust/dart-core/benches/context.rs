//! Context-index benchmarks: indexing a 2,048-token prompt (a prefill), and one decode step of a batch of
//! 64 requests (2 accepted tokens appended, one chain of up to 15 tokens looked up each), over Zipf-like
//! token streams of a 49,152-token vocabulary. Run: `cargo bench -p dart-core --bench context`.
use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use dart_core::context::{ContextIndex, ContextSequence};

const VOCAB: u64 = 49_152;
const PROMPT: usize = 2_048;
const BS: usize = 64;

/// Skewed ids (small ones far more often), so that n-grams recur as in text.
fn stream(seed: u64, len: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 11) as f64 / (1u64 << 53) as f64;
            (u.powi(6) * VOCAB as f64) as u32
        })
        .collect()
}

fn benches(c: &mut Criterion) {
    let prompt = stream(1, PROMPT);
    c.bench_function("context/index_prompt_2048", |b| {
        b.iter(|| {
            let mut seq = ContextSequence::default();
            seq.extend(black_box(&prompt));
            seq
        })
    });

    let rids: Vec<String> = (0..BS).map(|r| format!("req-{r}")).collect();
    let prompts: Vec<Vec<u32>> = (0..BS).map(|r| stream(r as u64 + 2, PROMPT)).collect();
    let mut index = ContextIndex::default();
    let steps: Vec<Vec<u32>> = (0..BS).map(|r| stream(r as u64 + 100, 4096)).collect();
    let mut at = 0;
    c.bench_function("context/step_batch64", |b| {
        b.iter(|| {
            if at == 0 {
                // Back to the prompts every 2,047 steps (amortized), so the sequences stay bounded.
                for (rid, prompt) in rids.iter().zip(&prompts) {
                    index.set(rid, prompt);
                }
            }
            let mut found = 0;
            for (rid, tokens) in rids.iter().zip(&steps) {
                index.extend(rid, &tokens[at..at + 2]);
                found += index.get(rid).map_or(0, |s| s.chain(15).len());
            }
            at = (at + 2) % (4096 - 2);
            black_box(found)
        })
    });
}

criterion_group! {
    name = context;
    config = Criterion::default().sample_size(30).measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    targets = benches
}
criterion_main!(context);
