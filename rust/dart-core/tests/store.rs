//! Integration tests of the n-gram store: build vs a naive counter, back-off semantics, overflow counts,
//! spills, import of reference `.trie` files, and rejection of bad files.
use std::collections::HashMap;
use std::path::PathBuf;

use dart_core::store::format::{Section, HEADER_LEN};
use dart_core::store::reftrie::{reference_trie, write_reference_trie};
use dart_core::store::{import_reference, BuildOptions, NgramStore, StoreBuilder, StoreError};
use dart_core::NextTokenModel;

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dart-store-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn rng(seed: &mut u64) -> u64 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *seed >> 33
}

fn corpus(seed: u64, docs: usize, vocab: u32, max_len: usize) -> Vec<Vec<u32>> {
    let mut s = seed;
    (0..docs)
        .map(|_| {
            let n = (rng(&mut s) as usize) % max_len;
            // Skewed draws so that many n-grams repeat.
            (0..n)
                .map(|_| {
                    ((rng(&mut s) % vocab as u64) * (rng(&mut s) % vocab as u64) / vocab as u64)
                        as u32
                })
                .collect()
        })
        .collect()
}

fn naive(docs: &[Vec<u32>]) -> HashMap<Vec<u32>, u64> {
    let mut m = HashMap::new();
    for d in docs {
        for s in 0..d.len() {
            for l in 1..=3usize.min(d.len() - s) {
                *m.entry(d[s..s + l].to_vec()).or_insert(0) += 1;
            }
        }
    }
    m
}

fn naive_prob(m: &HashMap<Vec<u32>, u64>, a: Option<u32>, b: u32, t: u32) -> f32 {
    if let Some(a) = a {
        if let Some(&ctx) = m.get(&vec![a, b]) {
            if let Some(&c) = m.get(&vec![a, b, t]) {
                return (c as f64 / ctx as f64) as f32;
            }
        }
    }
    match (m.get(&vec![b]), m.get(&vec![b, t])) {
        (Some(&ctx), Some(&c)) => (c as f64 / ctx as f64) as f32,
        _ => 0.0,
    }
}

fn build(docs: &[Vec<u32>], vocab: u64, budget: u64, min_count: u64, path: &PathBuf) -> NgramStore {
    let mut o = BuildOptions::new(vocab);
    o.memory_budget = budget;
    o.min_count = min_count;
    o.tokenizer_fingerprint = 0xABCD;
    o.tmp_dir = path.parent().unwrap().to_path_buf();
    let mut b = StoreBuilder::new(o).unwrap();
    for d in docs {
        b.add_document(d).unwrap();
    }
    b.finish(path).unwrap();
    NgramStore::open(path).unwrap()
}

#[test]
fn build_matches_naive_counter() {
    let dir = tmpdir("naive");
    let docs = corpus(7, 200, 50, 60);
    let m = naive(&docs);
    // Tiny budget forces spilled runs and the k-way merge.
    let st = build(&docs, 50, 0, 1, &dir.join("a.ngs"));
    st.verify().unwrap();
    let h = st.header();
    assert_eq!(
        h.total_tokens,
        docs.iter().map(|d| d.len() as u64).sum::<u64>()
    );
    assert_eq!(h.n2 as usize, m.keys().filter(|k| k.len() == 2).count());
    assert_eq!(h.n3 as usize, m.keys().filter(|k| k.len() == 3).count());
    assert_eq!(h.tokenizer_fingerprint, 0xABCD);
    for (k, &c) in &m {
        assert_eq!(st.count(k), c, "count of {k:?}");
    }
    let toks: Vec<u32> = (0..52).collect(); // 50, 51 are out of range → 0
    let mut out = vec![0f32; toks.len()];
    for a in 0..50u32 {
        for b in 0..50u32 {
            st.next_probs(Some(a), b, &toks, &mut out);
            for (i, &t) in toks.iter().enumerate() {
                assert_eq!(out[i], naive_prob(&m, Some(a), b, t), "P({t}|{a},{b})");
            }
        }
        st.next_probs(None, a, &toks, &mut out);
        for (i, &t) in toks.iter().enumerate() {
            assert_eq!(out[i], naive_prob(&m, None, a, t));
        }
        // top_next agrees with next_probs.
        let top = st.top_next(Some(a), a, 5);
        for w in top.windows(2) {
            assert!(w[0].1 >= w[1].1);
        }
        for (t, p) in top {
            assert_eq!(p, naive_prob(&m, Some(a), a, t));
        }
    }
    // In-memory budget gives the identical file.
    let st2 = build(&docs, 50, 1 << 30, 1, &dir.join("b.ngs"));
    assert_eq!(
        std::fs::read(dir.join("a.ngs")).unwrap(),
        std::fs::read(dir.join("b.ngs")).unwrap()
    );
    drop(st2);
}

#[test]
fn min_count_prunes_but_keeps_context_counts() {
    let dir = tmpdir("min");
    let docs = corpus(11, 100, 30, 50);
    let m = naive(&docs);
    let st = build(&docs, 30, 1 << 20, 3, &dir.join("m.ngs"));
    st.verify().unwrap();
    for (k, &c) in &m {
        let want = if k.len() == 1 || c >= 3 { c } else { 0 };
        assert_eq!(st.count(k), want, "{k:?}");
    }
    let toks: Vec<u32> = (0..30).collect();
    let mut out = vec![0f32; 30];
    for a in 0..30 {
        for b in 0..30 {
            st.next_probs(Some(a), b, &toks, &mut out);
            assert!(out.iter().all(|&p| (0.0..=1.0).contains(&p)));
        }
    }
}

#[test]
fn large_counts_use_overflow_table() {
    let dir = tmpdir("ovf");
    // Vocab 2^20 → 12 count bits → escape 4095; a repeated pattern exceeds it.
    let vocab = 1 << 20;
    let doc: Vec<u32> = (0..30_000)
        .map(|i| [7u32, 1_000_000, 7, 5][i % 4])
        .collect();
    let docs = vec![doc];
    let m = naive(&docs);
    let st = build(&docs, vocab, 1 << 24, 1, &dir.join("o.ngs"));
    st.verify().unwrap();
    assert!(st.header().sections[Section::Ovf2 as usize].len > 0);
    assert!(st.header().sections[Section::Ovf3 as usize].len > 0);
    for (k, &c) in &m {
        assert_eq!(st.count(k), c);
    }
}

#[test]
fn import_equals_direct_build() {
    let dir = tmpdir("import");
    let docs = corpus(3, 150, 40, 40);
    let direct = build(&docs, 40, 1 << 20, 1, &dir.join("direct.ngs"));
    let mut nodes = reference_trie(&docs);
    // Shuffle node indices (keep root at 0) and child order to exercise the general case: parents after
    // children, arbitrary sibling order.
    let n = nodes.len();
    let mut perm: Vec<usize> = (1..n).collect();
    let mut s = 99u64;
    for i in (1..perm.len()).rev() {
        let j = rng(&mut s) as usize % (i + 1);
        perm.swap(i, j);
    }
    let mut newidx = vec![0u64; n];
    for (pos, &old) in perm.iter().enumerate() {
        newidx[old] = pos as u64 + 1;
    }
    let mut shuffled = vec![Default::default(); n];
    for (old, nd) in nodes.drain(..).enumerate() {
        let mut nd: dart_core::store::reftrie::RefNode = nd;
        nd.parent = newidx[nd.parent as usize];
        for c in nd.children.iter_mut() {
            c.1 = newidx[c.1 as usize];
        }
        nd.children.reverse();
        shuffled[newidx[old] as usize] = nd;
    }
    let reft = dir.join("ref.trie");
    write_reference_trie(&reft, 3, &shuffled).unwrap();
    let mut o = BuildOptions::new(40);
    o.tokenizer_fingerprint = 0xABCD;
    o.memory_budget = 0;
    o.tmp_dir = dir.clone();
    let stats = import_reference(&reft, &dir.join("imported.ngs"), &o).unwrap();
    assert_eq!(stats.reference_nodes as usize, n);
    let imp = NgramStore::open(dir.join("imported.ngs")).unwrap();
    imp.verify().unwrap();
    let (a, b) = (
        std::fs::read(dir.join("direct.ngs")).unwrap(),
        std::fs::read(dir.join("imported.ngs")).unwrap(),
    );
    // Identical sections; only the header flags (imported) and checksum differ.
    assert_eq!(a[HEADER_LEN..], b[HEADER_LEN..]);
    assert_eq!(direct.header().n3, imp.header().n3);
}

#[test]
fn import_clamps_negative_and_inconsistent_counts() {
    let dir = tmpdir("clamp");
    use dart_core::store::reftrie::RefNode;
    let nodes = vec![
        RefNode {
            token: -1,
            parent: 0,
            count: -5,
            children: vec![(1, 1)],
        },
        RefNode {
            token: 1,
            parent: 0,
            count: 2,
            children: vec![(2, 2)],
        },
        RefNode {
            token: 2,
            parent: 1,
            count: -1,
            children: vec![(3, 3), (4, 4)],
        },
        RefNode {
            token: 3,
            parent: 2,
            count: 4,
            children: vec![],
        },
        RefNode {
            token: 4,
            parent: 2,
            count: -2,
            children: vec![],
        },
    ];
    let reft = dir.join("neg.trie");
    write_reference_trie(&reft, 3, &nodes).unwrap();
    let mut o = BuildOptions::new(8);
    o.tmp_dir = dir.clone();
    let st = import_reference(&reft, &dir.join("neg.ngs"), &o).unwrap();
    assert_eq!(st.clamped, 2);
    let s = NgramStore::open(dir.join("neg.ngs")).unwrap();
    s.verify().unwrap();
    assert_eq!(s.count(&[1, 2]), 4); // raised to its children's sum
    assert_eq!(s.count(&[1]), 4);
    assert_eq!(s.count(&[1, 2, 4]), 0);
    let mut out = [0f32; 2];
    s.next_probs(Some(1), 2, &[3, 4], &mut out);
    assert_eq!(out, [1.0, 0.0]);
}

#[test]
fn rejects_bad_files() {
    let dir = tmpdir("bad");
    let docs = corpus(5, 20, 20, 30);
    let p = dir.join("g.ngs");
    build(&docs, 20, 1 << 20, 1, &p);
    let good = std::fs::read(&p).unwrap();
    let check = |bytes: Vec<u8>| NgramStore::from_bytes(bytes).err().expect("must fail");
    assert!(matches!(
        check(b"PK\x03\x04 something else entirely".to_vec()),
        StoreError::BadMagic
    ));
    assert!(matches!(check(vec![]), StoreError::Corrupt(_)));
    assert!(matches!(
        check(good[..good.len() - 1].to_vec()),
        StoreError::Corrupt(_)
    ));
    assert!(matches!(
        check(good[..100].to_vec()),
        StoreError::Corrupt(_)
    ));
    let mut v = good.clone();
    v[8] = 9;
    assert!(matches!(check(v), StoreError::UnsupportedVersion(9)));
    let mut v = good.clone();
    v[30] ^= 1; // a header field: caught by the header checksum
    assert!(matches!(check(v), StoreError::Corrupt(_)));
    // Body corruption is not checked at open (O(1) open) but by verify().
    let mut v = good.clone();
    let last = v.len() - 5;
    v[last] ^= 0x40;
    let s = NgramStore::from_bytes(v).unwrap();
    assert!(s.verify().is_err());
    // A reference .trie is not a store.
    let reft = dir.join("r.trie");
    write_reference_trie(&reft, 3, &reference_trie(&docs)).unwrap();
    assert!(matches!(NgramStore::open(&reft), Err(StoreError::BadMagic)));
    assert!(matches!(
        NgramStore::open(dir.join("missing")),
        Err(StoreError::Io(_))
    ));
    // Truncated reference file → import error, no panic.
    let rb = std::fs::read(&reft).unwrap();
    std::fs::write(&reft, &rb[..rb.len() - 7]).unwrap();
    let o = BuildOptions {
        tmp_dir: dir.clone(),
        ..BuildOptions::new(20)
    };
    assert!(matches!(
        import_reference(&reft, &dir.join("x.ngs"), &o),
        Err(StoreError::Corrupt(_))
    ));
    // Token ids above the vocabulary: builder and import refuse.
    let mut b = StoreBuilder::new(BuildOptions::new(10)).unwrap();
    assert!(matches!(
        b.add_document(&[1, 2, 10]),
        Err(StoreError::Invalid(_))
    ));
    std::fs::write(&reft, &rb).unwrap();
    let o = BuildOptions {
        tmp_dir: dir.clone(),
        ..BuildOptions::new(5)
    };
    assert!(matches!(
        import_reference(&reft, &dir.join("x.ngs"), &o),
        Err(StoreError::Invalid(_))
    ));
}
