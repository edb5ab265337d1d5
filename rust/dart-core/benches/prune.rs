//! Pruner benchmarks at the reference defaults (D = 8, k = 25, beam 20, M = 60): one tree on the calling
//! thread, and a batch of 64 trees over rayon's global pool, with no n-gram, the hash-map model and the
//! memory-mapped store, both built from a synthetic Zipf(1.1) corpus of 2M tokens over a 151,936-token
//! vocabulary (≥ 1M trie nodes). Run: `cargo bench -p dart-core --bench prune`.
use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use dart_core::prune::{
    prune_batch, prune_single, BatchInput, DictNgramModel, PruneConfig, SearchScratch, TokenIds,
    TreeOut, TreeRequest,
};
use dart_core::store::{BuildOptions, NgramStore, StoreBuilder};
use dart_core::NextTokenModel;

const VOCAB: u64 = 151_936;
const CORPUS_TOKENS: usize = 2_000_000;
const BS: usize = 64;
const D: usize = 8;
const K: usize = 25;

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

struct Zipf(Vec<f64>);
impl Zipf {
    fn new(v: usize, s: f64) -> Zipf {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=v)
            .map(|r| {
                acc += 1.0 / (r as f64).powf(s);
                acc
            })
            .collect();
        cdf.iter_mut().for_each(|x| *x /= acc);
        Zipf(cdf)
    }
    fn draw(&self, r: &mut Lcg) -> u32 {
        let u = r.next_f64();
        self.0.partition_point(|&c| c < u).min(self.0.len() - 1) as u32
    }
}

/// Draft-like inputs: Zipf-drawn candidates, peaked softmax probabilities (sorted descending).
struct Inputs {
    tokens: Vec<i64>,
    probs: Vec<f32>,
    roots: Vec<i64>,
    context: Vec<i64>,
}

fn inputs(z: &Zipf, seed: u64) -> Inputs {
    let mut r = Lcg(seed);
    let tokens = (0..BS * D * K).map(|_| i64::from(z.draw(&mut r))).collect();
    let mut probs = Vec::with_capacity(BS * D * K);
    for _ in 0..BS * D {
        let logits: Vec<f64> = (0..K).map(|j| -(j as f64) * 0.4 + r.next_f64()).collect();
        let sum: f64 = logits.iter().map(|x| x.exp()).sum();
        probs.extend(logits.iter().map(|x| (x.exp() / sum) as f32));
    }
    let roots = (0..BS).map(|_| i64::from(z.draw(&mut r))).collect();
    let context = (0..2 * BS).map(|_| i64::from(z.draw(&mut r))).collect();
    Inputs {
        tokens,
        probs,
        roots,
        context,
    }
}

fn bench_model<M: NextTokenModel + ?Sized>(
    c: &mut Criterion,
    name: &str,
    model: Option<&M>,
    inp: &Inputs,
) {
    let cfg = PruneConfig::default();
    let resolved = cfg.resolve(D, K).unwrap();
    let eos = [2u32];
    let toks: Vec<u32> = inp.tokens.iter().map(|&t| t as u32).collect();
    let n = resolved.n();
    let mut scratch = SearchScratch::default();
    let (mut t, mut p, mut d, mut m, mut idx) = (
        vec![0; n],
        vec![0; n],
        vec![0; n],
        vec![false; n * n],
        vec![],
    );
    let mut r = 0;
    c.bench_function(&format!("prune/one_tree/{name}"), |b| {
        b.iter(|| {
            let cells = D * K;
            let req = TreeRequest {
                tokens: &toks[r * cells..(r + 1) * cells],
                probs: &inp.probs[r * cells..(r + 1) * cells],
                prev1: Some(inp.context[2 * r + 1] as u32),
                root: inp.roots[r] as u32,
            };
            let out = TreeOut {
                tokens: &mut t,
                parents: &mut p,
                depth: &mut d,
                tree_mask: &mut m,
            };
            prune_single(
                &resolved,
                model,
                black_box(&req),
                &eos,
                &mut scratch,
                &mut idx,
                out,
            );
            r = (r + 1) % BS;
        })
    });
    let eos64 = [2i64];
    let batch = BatchInput {
        batch_size: BS,
        depth: D,
        k: K,
        token_ids: TokenIds::I64(&inp.tokens),
        probs: &inp.probs,
        roots: &inp.roots,
        context: &inp.context,
        eos_ids: &eos64,
    };
    c.bench_function(
        &format!(
            "prune/batch{BS}_{}threads/{name}",
            rayon::current_num_threads()
        ),
        |b| b.iter(|| black_box(prune_batch(&cfg, model, black_box(&batch), Some(VOCAB)).unwrap())),
    );
}

fn benches(c: &mut Criterion) {
    let z = Zipf::new(VOCAB as usize, 1.1);
    let mut r = Lcg(42);
    let corpus: Vec<u32> = (0..CORPUS_TOKENS).map(|_| z.draw(&mut r)).collect();
    let inp = inputs(&z, 7);

    bench_model::<DictNgramModel>(c, "no_ngram", None, &inp);

    let dict = DictNgramModel::from_documents([&corpus[..]], Some(VOCAB)).unwrap();
    eprintln!("hash-map model: {} n-grams", dict.len());
    bench_model(c, "hashmap_model", Some(&dict), &inp);
    drop(dict);

    let dir = std::env::temp_dir().join(format!("dart-prune-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bench.dng");
    let mut builder = StoreBuilder::new(BuildOptions::new(VOCAB)).unwrap();
    builder.add_document(&corpus).unwrap();
    builder.finish(&path).unwrap();
    let store = NgramStore::open(&path).unwrap();
    let h = store.header();
    eprintln!(
        "store: {} bytes, n2 = {}, n3 = {}",
        store.file_bytes(),
        h.n2,
        h.n3
    );
    bench_model(c, "store", Some(&store), &inp);
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group! {
    name = prune;
    config = Criterion::default().sample_size(50).measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    targets = benches
}
criterion_main!(prune);
