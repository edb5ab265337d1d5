//! Store benchmarks: query latency (2 context tokens, 25 query tokens, the pruner's pattern) and open time
//! on a small and a large synthetic Zipf(1.1) store over a 151,936-token vocabulary (Qwen-sized).
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use dart_core::store::{BuildOptions, NgramStore, StoreBuilder};
use dart_core::NextTokenModel;

const VOCAB: u64 = 151_936;

struct Lcg(u64);
impl Lcg {
    fn next_f64(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn zipf_cdf(v: usize, s: f64) -> Vec<f64> {
    let mut acc = 0.0;
    let mut cdf: Vec<f64> = (1..=v)
        .map(|r| {
            acc += 1.0 / (r as f64).powf(s);
            acc
        })
        .collect();
    for x in cdf.iter_mut() {
        *x /= acc;
    }
    cdf
}

fn corpus(tokens: usize, seed: u64) -> Vec<u32> {
    let cdf = zipf_cdf(VOCAB as usize, 1.1);
    let mut r = Lcg(seed);
    (0..tokens)
        .map(|_| {
            cdf.partition_point(|&c| c < r.next_f64())
                .min(VOCAB as usize - 1) as u32
        })
        .collect()
}

fn build(path: &Path, doc: &[u32]) {
    if path.exists() {
        return;
    }
    let mut o = BuildOptions::new(VOCAB);
    o.tmp_dir = path.parent().unwrap().to_path_buf();
    let mut b = StoreBuilder::new(o).unwrap();
    for chunk in doc.chunks(2000) {
        b.add_document(chunk).unwrap();
    }
    b.finish(path).unwrap();
}

fn stores() -> Vec<(&'static str, PathBuf, Vec<u32>)> {
    let dir = std::env::temp_dir().join("dart-store-bench");
    std::fs::create_dir_all(&dir).unwrap();
    [("small_100k", 100_000usize), ("large_5M", 5_000_000)]
        .into_iter()
        .map(|(name, n)| {
            let doc = corpus(n, 42);
            let p = dir.join(format!("{name}.ngs"));
            build(&p, &doc);
            (name, p, doc)
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    for (name, path, doc) in stores() {
        let st = NgramStore::open(&path).unwrap();
        let h = st.header();
        eprintln!(
            "{name}: nodes {}/{}/{}, {} bytes, {:.2} B/node",
            h.n1,
            h.n2,
            h.n3,
            h.file_len,
            h.file_len as f64 / (h.n1 + h.n2 + h.n3) as f64
        );
        // Contexts taken from the corpus (they exist), 25 query tokens drawn from the Zipf marginal.
        let q = corpus(25 * 256, 7);
        let mut out = [0f32; 25];
        let mut i = 0usize;
        c.bench_function(&format!("next_probs_ctx2_k25/{name}"), |b| {
            b.iter(|| {
                let s = (i * 7919) % (doc.len() - 2);
                let toks = &q[(i % 256) * 25..(i % 256) * 25 + 25];
                st.next_probs(Some(doc[s]), doc[s + 1], toks, &mut out);
                i += 1;
                black_box(out[0])
            })
        });
        c.bench_function(&format!("open/{name}"), |b| {
            b.iter(|| black_box(NgramStore::open(&path).unwrap()))
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1)).sample_size(50);
    targets = bench
}
criterion_main!(benches);
