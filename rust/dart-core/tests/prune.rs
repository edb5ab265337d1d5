//! Integration tests of the batched pruner: output invariants (proptest), top-M optimality and
//! prefix-closure against a brute-force check, determinism across thread counts, and input errors.
use dart_core::prune::{
    prune_batch, prune_single, BatchInput, DictNgramModel, PruneConfig, SearchScratch, TokenIds,
    TreeBatch, TreeOut, TreeRequest,
};
use proptest::prelude::*;

fn rng(seed: &mut u64) -> u64 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *seed >> 33
}

struct Case {
    bs: usize,
    d: usize,
    k: usize,
    tokens: Vec<i64>,
    probs: Vec<f32>,
    roots: Vec<i64>,
    context: Vec<i64>,
    eos: Vec<i64>,
}

impl Case {
    fn random(seed: u64, bs: usize, d: usize, k: usize, vocab: u64, ties: bool) -> Case {
        let mut s = seed;
        let cells = bs * d * k;
        let tokens = (0..cells).map(|_| (rng(&mut s) % vocab) as i64).collect();
        let probs = (0..cells)
            .map(|_| {
                if ties {
                    [1.0, 0.5, 0.25, 0.0][(rng(&mut s) % 4) as usize]
                } else {
                    (rng(&mut s) % 1000) as f32 / 1000.0
                }
            })
            .collect();
        let roots = (0..bs).map(|_| (rng(&mut s) % vocab) as i64).collect();
        let context = (0..2 * bs)
            .map(|_| (rng(&mut s) % (vocab + 1)) as i64 - 1)
            .collect();
        let eos = vec![(rng(&mut s) % vocab) as i64];
        Case {
            bs,
            d,
            k,
            tokens,
            probs,
            roots,
            context,
            eos,
        }
    }

    fn input(&self) -> BatchInput<'_> {
        BatchInput {
            batch_size: self.bs,
            depth: self.d,
            k: self.k,
            token_ids: TokenIds::I64(&self.tokens),
            probs: &self.probs,
            roots: &self.roots,
            context: &self.context,
            eos_ids: &self.eos,
        }
    }
}

fn model(seed: u64, vocab: u64) -> DictNgramModel {
    let mut s = seed;
    let docs: Vec<Vec<u32>> = (0..20)
        .map(|_| {
            (0..rng(&mut s) % 50)
                .map(|_| (rng(&mut s) % vocab) as u32)
                .collect()
        })
        .collect();
    DictNgramModel::from_documents(docs.iter().map(|d| &d[..]), Some(vocab)).unwrap()
}

/// Exactly N nodes, root first, parents earlier, depth = parent's + 1 (depth-ascending), mask = closure.
fn check_invariants(out: &TreeBatch, roots: &[i64]) {
    let n = out.n;
    assert_eq!(out.tokens.len(), out.batch_size * n);
    assert_eq!(out.tree_mask.len(), out.batch_size * n * n);
    for (r, &root) in roots.iter().enumerate().take(out.batch_size) {
        let (t, p, d) = (
            &out.tokens[r * n..][..n],
            &out.parents[r * n..][..n],
            &out.depth[r * n..][..n],
        );
        let mask = &out.tree_mask[r * n * n..][..n * n];
        assert_eq!((t[0], p[0], d[0]), (root, -1, 0));
        for i in 1..n {
            assert!(
                p[i] >= 0 && (p[i] as usize) < i,
                "parent of {i} is {}",
                p[i]
            );
            assert_eq!(d[i], d[p[i] as usize] + 1);
            assert!(d[i] >= d[i - 1]);
        }
        for i in 0..n {
            let mut want = vec![false; n];
            let mut j = i as i32;
            while j >= 0 {
                want[j as usize] = true;
                j = p[j as usize];
            }
            assert_eq!(&mask[i * n..(i + 1) * n], &want[..], "mask row {i}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold(seed in any::<u64>(), bs in 0usize..4, d in 1usize..6, k in 1usize..8, w in 1usize..6,
                       m_frac in 0.0f64..=1.0, ties in any::<bool>(), with_model in any::<bool>(),
                       level0 in any::<bool>()) {
        let vocab = 10;
        let case = Case::random(seed, bs, d, k, vocab, ties);
        let mut cfg = PruneConfig { beam_width: w, ngram_at_level0: level0, ..PruneConfig::default() };
        cfg.num_nodes = (cfg.candidate_count(d, k) as f64 * m_frac) as usize;
        let m = model(seed ^ 0xABCD, vocab);
        let out = prune_batch(&cfg, with_model.then_some(&m), &case.input(), Some(vocab)).unwrap();
        prop_assert_eq!(out.n, cfg.num_nodes + 1);
        check_invariants(&out, &case.roots);
    }

    /// The kept set is the top M of the pool by (score desc, index asc) and is prefix-closed.
    #[test]
    fn selection_is_top_m_and_prefix_closed(seed in any::<u64>(), d in 1usize..6, k in 1usize..8,
                                            w in 1usize..6, m_frac in 0.0f64..=1.0, ties in any::<bool>()) {
        let vocab = 6;
        let case = Case::random(seed, 1, d, k, vocab, ties);
        let mut cfg = PruneConfig { beam_width: w, ..PruneConfig::default() };
        cfg.num_nodes = (cfg.candidate_count(d, k) as f64 * m_frac) as usize;
        let resolved = cfg.resolve(d, k).unwrap();
        let m = model(seed, vocab);
        let toks: Vec<u32> = case.tokens.iter().map(|&t| t as u32).collect();
        let req = TreeRequest { tokens: &toks, probs: &case.probs, prev1: None, root: case.roots[0] as u32 };
        let mut s = SearchScratch::default();
        let n = resolved.n();
        let (mut t, mut p, mut dd, mut mask) = (vec![0; n], vec![0; n], vec![0; n], vec![false; n * n]);
        let out = TreeOut { tokens: &mut t, parents: &mut p, depth: &mut dd, tree_mask: &mut mask };
        let mut idx = Vec::new();
        prune_single(&resolved, Some(&m), &req, &[], &mut s, &mut idx, out);
        let kept: std::collections::HashSet<u32> = s.selected.iter().copied().collect();
        prop_assert_eq!(kept.len(), cfg.num_nodes);
        let worst_kept = s.selected.iter().map(|&i| (s.arena[i as usize].score, i))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
        for (i, node) in s.arena.iter().enumerate().skip(1) {
            let i = i as u32;
            prop_assert!(node.score <= s.arena[node.parent as usize].score, "child outscores parent");
            if kept.contains(&i) {
                prop_assert!(node.parent == 0 || kept.contains(&node.parent), "not prefix-closed");
            } else if let Some((ws, wi)) = worst_kept {
                prop_assert!(node.score < ws || (node.score == ws && i > wi), "dropped a better node");
            }
        }
    }
}

#[test]
fn same_output_on_one_or_two_threads() {
    let vocab = 50;
    let case = Case::random(3, 64, 8, 25, vocab, true);
    let m = model(3, vocab);
    let cfg = PruneConfig::default();
    let run = |threads| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| prune_batch(&cfg, Some(&m), &case.input(), Some(vocab)).unwrap())
    };
    let one = run(1);
    assert_eq!(one, run(2));
    check_invariants(&one, &case.roots);
}

#[test]
fn int32_and_int64_ids_agree() {
    let case = Case::random(11, 3, 4, 9, 30, false);
    let t32: Vec<i32> = case.tokens.iter().map(|&t| t as i32).collect();
    let cfg = PruneConfig {
        num_nodes: 30,
        ..PruneConfig::default()
    };
    let a = prune_batch::<DictNgramModel>(&cfg, None, &case.input(), None).unwrap();
    let input = BatchInput {
        token_ids: TokenIds::I32(&t32),
        ..case.input()
    };
    assert_eq!(
        a,
        prune_batch::<DictNgramModel>(&cfg, None, &input, None).unwrap()
    );
}

#[test]
fn errors_are_reported_not_panics() {
    let case = Case::random(5, 2, 3, 4, 20, false);
    let cfg = PruneConfig {
        num_nodes: 10,
        ..PruneConfig::default()
    };
    let err = |input: &BatchInput<'_>, cfg: &PruneConfig| {
        prune_batch::<DictNgramModel>(cfg, None, input, Some(20))
            .unwrap_err()
            .to_string()
    };
    let mut probs = case.probs.clone();
    probs[5] = f32::NAN;
    assert!(err(
        &BatchInput {
            probs: &probs,
            ..case.input()
        },
        &cfg
    )
    .contains("probs[0, 1, 1] = NaN"));
    let short = &case.probs[1..];
    assert!(err(
        &BatchInput {
            probs: short,
            ..case.input()
        },
        &cfg
    )
    .contains("probs has"));
    let mut toks = case.tokens.clone();
    toks[23] = 20;
    let e = err(
        &BatchInput {
            token_ids: TokenIds::I64(&toks),
            ..case.input()
        },
        &cfg,
    );
    assert!(e.contains("token_ids[1, 2, 3] = 20"), "{e}");
    let e = err(
        &case.input(),
        &PruneConfig {
            num_nodes: 1000,
            ..cfg.clone()
        },
    );
    assert!(e.contains("exceeds the"), "{e}");
    let e = err(
        &BatchInput {
            depth: 0,
            k: 4,
            ..case.input()
        },
        &cfg,
    );
    assert!(e.contains("D of token_ids/probs must be >= 1"), "{e}");
}

#[test]
fn empty_batch_gives_empty_arrays() {
    let input = BatchInput {
        batch_size: 0,
        depth: 8,
        k: 25,
        token_ids: TokenIds::I64(&[]),
        probs: &[],
        roots: &[],
        context: &[],
        eos_ids: &[],
    };
    let out = prune_batch::<DictNgramModel>(&PruneConfig::default(), None, &input, None).unwrap();
    assert_eq!((out.n, out.tokens.len(), out.tree_mask.len()), (61, 0, 0));
}
