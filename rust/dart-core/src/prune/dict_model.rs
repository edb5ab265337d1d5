//! An in-memory n-gram model with the reference semantics (§5.2: maximum-likelihood trigram, per-token
//! back-off to the bigram, no smoothing), built from explicit counts or from token documents. It serves
//! the pruner's tests and benchmarks and the Python-side tests (`sglang_dart._core.DictNgramModel`);
//! production uses the memory-mapped store.
//!
//! `P(t | a, b) = f32(C(a b t) / C(a b))` (division in float64) if the context `a b` has a count and `a b t`
//! has a count; otherwise `f32(C(b t) / C(b))` if `b` and `b t` have counts; otherwise 0.
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::error::{bail, Result};
use crate::NextTokenModel;

/// A small multiplicative hasher for integer keys (no DoS concern: keys are token ids).
#[derive(Default, Clone, Copy)]
pub struct IntHasher(u64);

const MUL: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for IntHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u32(&mut self, i: u32) {
        self.write_u64(u64::from(i));
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(23) ^ i).wrapping_mul(MUL);
    }
    fn finish(&self) -> u64 {
        let x = self.0 ^ (self.0 >> 31);
        x.wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ (x >> 29)
    }
}

type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;

/// A context (an existing 1- or 2-gram) and the range of its continuations in `children`.
#[derive(Debug, Clone, Copy)]
struct Context {
    count: u64,
    start: u32,
    len: u32,
}

/// Hash-map n-gram model of order 3 (see the module docs).
#[derive(Debug, Default)]
pub struct DictNgramModel {
    unigram: IntMap<u32, Context>,
    bigram: IntMap<u64, Context>,
    /// Continuations `(token, count)`, sorted by token within each context's range.
    children: Vec<(u32, u64)>,
    entries: usize,
    vocab_size: Option<u64>,
}

fn pair(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

impl DictNgramModel {
    /// Builds the model from `(ngram, count)` entries, ngrams of 1 to 3 tokens, counts ≥ 1, every proper
    /// prefix of an n-gram having a count too (as a counting trie guarantees). Duplicates are summed.
    pub fn from_counts<'a>(
        entries: impl IntoIterator<Item = (&'a [u32], u64)>,
        vocab_size: Option<u64>,
    ) -> Result<DictNgramModel> {
        let mut counts: [IntMap<u128, u64>; 3] = Default::default();
        for (ngram, count) in entries {
            if ngram.is_empty() || ngram.len() > 3 {
                bail!("n-gram {ngram:?} must have 1 to 3 tokens");
            }
            if count == 0 {
                bail!("n-gram {ngram:?} has count 0 (counts must be >= 1)");
            }
            if let Some(v) = vocab_size {
                if let Some(t) = ngram.iter().find(|&&t| u64::from(t) >= v) {
                    bail!("token {t} of n-gram {ngram:?} is outside [0, {v})");
                }
            }
            *counts[ngram.len() - 1].entry(key(ngram)).or_insert(0) += count;
        }
        for order in 1..3 {
            for &k in counts[order].keys() {
                if !counts[order - 1].contains_key(&(k >> 32)) {
                    let ngram = unkey(k, order + 1);
                    bail!(
                        "n-gram {ngram:?} has a count but its prefix {:?} has none",
                        &ngram[..order]
                    );
                }
            }
        }
        Ok(Self::build(counts, vocab_size))
    }

    /// Counts every 1-, 2- and 3-gram of every document as the reference builder does (a window at every
    /// start position, shorter at the end of a document).
    pub fn from_documents<'a>(
        docs: impl IntoIterator<Item = &'a [u32]>,
        vocab_size: Option<u64>,
    ) -> Result<DictNgramModel> {
        let mut counts: [IntMap<u128, u64>; 3] = Default::default();
        for doc in docs {
            if let (Some(v), Some(t)) = (vocab_size, doc.iter().max()) {
                if u64::from(*t) >= v {
                    bail!("token {t} is outside [0, {v})");
                }
            }
            for s in 0..doc.len() {
                for len in 1..=3.min(doc.len() - s) {
                    *counts[len - 1].entry(key(&doc[s..s + len])).or_insert(0) += 1;
                }
            }
        }
        Ok(Self::build(counts, vocab_size))
    }

    fn build(counts: [IntMap<u128, u64>; 3], vocab_size: Option<u64>) -> DictNgramModel {
        let mut m = DictNgramModel {
            entries: counts.iter().map(|c| c.len()).sum(),
            vocab_size,
            ..Default::default()
        };
        m.unigram.reserve(counts[0].len());
        m.bigram.reserve(counts[1].len());
        for (&k, &c) in &counts[0] {
            m.unigram.insert(
                k as u32,
                Context {
                    count: c,
                    start: 0,
                    len: 0,
                },
            );
        }
        for (&k, &c) in &counts[1] {
            m.bigram.insert(
                k as u64,
                Context {
                    count: c,
                    start: 0,
                    len: 0,
                },
            );
        }
        m.children.reserve(counts[1].len() + counts[2].len());
        for (order, map) in counts.iter().enumerate().skip(1) {
            let mut sorted: Vec<(u128, u64)> = map.iter().map(|(&k, &c)| (k, c)).collect();
            sorted.sort_unstable();
            for &(k, c) in &sorted {
                let ctx = k >> 32;
                let slot = if order == 1 {
                    m.unigram.get_mut(&(ctx as u32))
                } else {
                    m.bigram.get_mut(&(ctx as u64))
                };
                if let Some(slot) = slot {
                    if slot.len == 0 {
                        slot.start = m.children.len() as u32;
                    }
                    slot.len += 1;
                    m.children.push((k as u32, c));
                }
            }
        }
        m
    }

    /// Number of distinct n-grams (all orders).
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// The vocabulary size given at construction, if any.
    pub fn vocab_size(&self) -> Option<u64> {
        self.vocab_size
    }

    #[inline]
    fn child(&self, ctx: &Context, token: u32) -> Option<f32> {
        let kids = &self.children[ctx.start as usize..(ctx.start + ctx.len) as usize];
        kids.binary_search_by_key(&token, |&(t, _)| t)
            .ok()
            .map(|i| (kids[i].1 as f64 / ctx.count as f64) as f32)
    }
}

/// Packs up to 3 tokens, the last one in the low 32 bits (so `key >> 32` is the context's key).
fn key(ngram: &[u32]) -> u128 {
    ngram
        .iter()
        .fold(0u128, |acc, &t| (acc << 32) | u128::from(t))
}

fn unkey(k: u128, len: usize) -> Vec<u32> {
    (0..len).rev().map(|i| (k >> (32 * i)) as u32).collect()
}

impl NextTokenModel for DictNgramModel {
    fn next_probs(&self, prev2: Option<u32>, prev1: u32, tokens: &[u32], out: &mut [f32]) {
        let tri = prev2.and_then(|a| self.bigram.get(&pair(a, prev1)));
        let bi = self.unigram.get(&prev1);
        for (o, &t) in out.iter_mut().zip(tokens) {
            *o = tri
                .and_then(|c| self.child(c, t))
                .or_else(|| bi.and_then(|c| self.child(c, t)))
                .unwrap_or(0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_semantics() {
        // Document "1 2 3 1 2 4": C(1 2)=2, C(1 2 3)=1, C(1 2 4)=1, C(2)=2, C(2 3)=1, C(2 4)=1.
        let doc = [1u32, 2, 3, 1, 2, 4];
        let m = DictNgramModel::from_documents([&doc[..]], None).unwrap();
        let mut out = [0.0f32; 4];
        m.next_probs(Some(1), 2, &[3, 4, 5, 1], &mut out);
        assert_eq!(out, [0.5, 0.5, 0.0, 0.0]);
        // Unknown trigram context (9, 2): back off to the bigram of 2.
        m.next_probs(Some(9), 2, &[3, 4, 5, 1], &mut out);
        assert_eq!(out, [0.5, 0.5, 0.0, 0.0]);
        // Context (2, 3): trigram 2 3 1 exists; C(2 3) = 1.
        m.next_probs(Some(2), 3, &[1, 2, 4, 3], &mut out);
        assert_eq!(out, [1.0, 0.0, 0.0, 0.0]);
        // Last token of the document: C(4) = 1 and no continuation.
        m.next_probs(None, 4, &[1, 2, 4, 3], &mut out);
        assert_eq!(out, [0.0; 4]);
        assert_eq!(m.len(), 4 + 4 + 4);
    }

    #[test]
    fn from_counts_checks_prefixes() {
        let e = DictNgramModel::from_counts([(&[1u32, 2][..], 1)], None).unwrap_err();
        assert!(e.0.contains("prefix"), "{e}");
        let e = DictNgramModel::from_counts([(&[1u32][..], 0)], None).unwrap_err();
        assert!(e.0.contains("count 0"), "{e}");
        let m = DictNgramModel::from_counts(
            [(&[1u32][..], 4), (&[1, 2][..], 1), (&[1, 2][..], 1)],
            None,
        )
        .unwrap();
        let mut out = [0.0f32; 1];
        m.next_probs(None, 1, &[2], &mut out);
        assert_eq!(out, [0.5]);
    }
}
