//! Fuzzing the reader with proptest: random byte flips, truncations and extensions of valid stores must
//! give an error or a store whose queries, `top_next` and `verify` run without panicking.
use dart_core::store::{BuildOptions, NgramStore, StoreBuilder};
use dart_core::NextTokenModel;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::Mutex;

fn valid_store(vocab: u64, seed: u64) -> Vec<u8> {
    static CACHE: Mutex<BTreeMap<(u64, u64), Vec<u8>>> = Mutex::new(BTreeMap::new());
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    cache
        .entry((vocab, seed))
        .or_insert_with(|| make_store(vocab, seed))
        .clone()
}

fn make_store(vocab: u64, seed: u64) -> Vec<u8> {
    let dir = std::env::temp_dir().join(format!("dart-store-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!("s{vocab}-{seed}.ngs"));
    let mut o = BuildOptions::new(vocab);
    o.tmp_dir = dir.clone();
    let mut b = StoreBuilder::new(o).unwrap();
    let mut s = seed;
    for _ in 0..30 {
        let doc: Vec<u32> = (0..40)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) % vocab.min(12)) as u32
            })
            .collect();
        b.add_document(&doc).unwrap();
    }
    b.finish(&p).unwrap();
    std::fs::read(&p).unwrap()
}

fn exercise(bytes: Vec<u8>) {
    if let Ok(s) = NgramStore::from_bytes(bytes) {
        let v = s.vocab_size() as u32;
        let toks: Vec<u32> = (0..v.saturating_add(3).min(40)).chain([u32::MAX]).collect();
        let mut out = vec![0f32; toks.len()];
        for a in 0..v.min(14) {
            for b in 0..v.min(14) {
                s.next_probs(Some(a), b, &toks, &mut out);
                assert!(out.iter().all(|p| p.is_finite() && *p >= 0.0));
            }
            s.next_probs(None, a, &toks, &mut out);
            let _ = s.top_next(Some(a), a, 10);
        }
        s.next_probs(Some(u32::MAX), u32::MAX, &toks, &mut out);
        let _ = s.verify();
        let _ = s.count(&[0, 1, 2]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn byte_flips(seed in 0u64..4, flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let mut b = valid_store(13 + seed, seed);
        for (i, x) in flips {
            let at = i.index(b.len());
            b[at] ^= x | 1;
        }
        exercise(b);
    }

    #[test]
    fn body_flips_keep_header(seed in 0u64..4, flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..16)) {
        // Header intact, so the store opens and queries run over garbage sections.
        let mut b = valid_store(13 + seed, seed);
        let h = dart_core::store::format::HEADER_LEN;
        for (i, x) in flips {
            let at = h + i.index(b.len() - h);
            b[at] ^= x | 1;
        }
        exercise(b);
    }

    #[test]
    fn truncation_and_extension(seed in 0u64..4, cut in any::<prop::sample::Index>(), extra in prop::collection::vec(any::<u8>(), 0..64)) {
        let b = valid_store(13 + seed, seed);
        let n = cut.index(b.len());
        exercise(b[..n].to_vec());
        let mut e = b.clone();
        e.extend_from_slice(&extra);
        exercise(e);
    }

    #[test]
    fn random_bytes_with_magic(body in prop::collection::vec(any::<u8>(), 0..600)) {
        let mut b = b"DARTNGRM\x01\0\0\0".to_vec();
        b.extend_from_slice(&body);
        exercise(b);
    }
}
