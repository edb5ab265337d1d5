//! Beam search over an arena of nodes (§4.3), with the deterministic order
//! (score desc, depth asc, creation asc) that keeps the selected set prefix-closed.
//!
//! Numerics (the Python reference in `tests/unit/reference_pruner.py` does exactly the same):
//! * `lp(x) = min(0, ln_f64(f32(x) +_f32 f32(eps)))`: the sum in float32 (as the reference C++), the log in
//!   float64, clamped at 0 so that no increment is positive whatever `eps` is.
//! * `inc = λ_l · (α_l · lp(p) + β · lp(q))` in float64 (`λ_l · (α_l · lp(p))` without the n-gram term),
//!   then rounded to float32; `score(child) = score(parent) +_f32 inc`. The root scores 0.
//!
//! Since λ, α, β ≥ 0, every increment is ≤ 0, so `score(child) ≤ score(parent)` (float rounding is
//! monotone). A parent has a smaller depth and a smaller arena index than its child, so it comes strictly
//! earlier in the total order (score desc, depth asc, creation asc); the top M of a total order form a
//! prefix of it, hence contain the parent of every node they contain: the selection is prefix-closed.
//! The arena is filled level by level, so "depth asc, creation asc" is simply "arena index asc", and the
//! order is the ascending order of the 64-bit key `(!sortable(score) << 32) | index`.
use std::collections::BinaryHeap;

use super::config::Resolved;
use crate::NextTokenModel;

/// Parent of the root.
pub const NO_PARENT: u32 = u32::MAX;

/// One arena entry: a node of the candidate tree. No token paths are stored; a path is a parent chain.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Node {
    pub parent: u32,
    pub token: u32,
    pub score: f32,
    pub depth: u8,
    pub eos: bool,
}

/// The tokens and context of one tree.
#[derive(Debug, Clone, Copy)]
pub struct TreeRequest<'a> {
    /// `[D, k]` row-major target token ids.
    pub tokens: &'a [u32],
    /// `[D, k]` row-major probabilities.
    pub probs: &'a [f32],
    /// Token before the root (`None`: unknown); the n-gram context of the root's children is `(prev1, root)`.
    pub prev1: Option<u32>,
    /// The root token (last accepted token).
    pub root: u32,
}

/// Reusable per-thread buffers; after warm-up a search allocates nothing.
#[derive(Debug, Default)]
pub struct SearchScratch {
    /// Arena; index 0 is the root, then the children level by level.
    pub arena: Vec<Node>,
    /// Selected arena indices (ascending) after [`search`].
    pub selected: Vec<u32>,
    beam: Vec<u32>,
    /// The M smallest keys of the pool so far.
    top: BinaryHeap<u64>,
    /// The W smallest non-EOS keys of the current level so far.
    level_top: BinaryHeap<u64>,
    /// Beam positions in expansion order (parent key high bits, position low bits).
    order: Vec<u64>,
    want: Vec<u32>,
    want_tokens: Vec<u32>,
    level_keys: Vec<u64>,
    eos_keys: Vec<u64>,
    draft: Vec<f64>,
    q: Vec<f32>,
    eos_flags: Vec<bool>,
}

/// `min(0, ln(f32(x) + f32(eps)))`, the sum in float32 and the logarithm in float64.
#[inline]
pub fn log_term(x: f32, eps: f32) -> f64 {
    ((x + eps) as f64).ln().min(0.0)
}

/// Ascending order of the key = (score descending, index ascending). Scores are finite.
#[inline]
pub fn order_key(score: f32, index: u32) -> u64 {
    let s = if score == 0.0 { 0.0f32 } else { score }; // -0.0 and 0.0 tie
    let b = s.to_bits();
    let ascending = if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    };
    (u64::from(!ascending) << 32) | u64::from(index)
}

#[inline]
fn key_index(key: u64) -> u32 {
    key as u32
}

/// Keeps the `n` smallest keys of `v` (in no particular order).
fn keep_smallest(v: &mut Vec<u64>, n: usize) {
    if v.len() > n {
        if n > 0 {
            v.select_nth_unstable(n - 1);
        }
        v.truncate(n);
    }
}

/// Keeps the `cap` smallest keys pushed so far (a max-heap: the root is the largest kept key).
fn heap_insert(h: &mut BinaryHeap<u64>, cap: usize, key: u64) {
    if h.len() < cap {
        h.push(key);
    } else if let Some(mut top) = h.peek_mut() {
        if key < *top {
            *top = key;
        }
    }
}

/// True if `key` would enter the `cap` smallest keys of `h`.
#[inline]
fn heap_admits(h: &BinaryHeap<u64>, cap: usize, key: u64) -> bool {
    h.len() < cap || h.peek().is_some_and(|&top| key < top)
}

/// Runs the search of one tree; the kept nodes are left in `s.selected` (arena indices, ascending,
/// i.e. depth-ascending) and the arena in `s.arena`.
///
/// Children get fixed arena slots (`level_start + beam position · topk + column`, the creation order),
/// but parents are expanded best-first, and a child is only scored exactly (n-gram look-up) if its
/// upper bound (the score with q = 1, which no exact score exceeds since lp(q) ≤ 0 and rounding is
/// monotone) could still enter the top M of the pool or the top W of its level; otherwise it is left
/// unscored (score −∞, never selected or extended). Skipping is exact: a skipped child already has M
/// (resp. W non-EOS) scored nodes strictly before it in the total order, so the unpruned algorithm
/// would not keep (resp. extend) it either. EOS children are never needed for the beam when the level
/// has ≥ W non-EOS children; otherwise nothing is skipped for the beam.
pub fn search<M: NextTokenModel + ?Sized>(
    cfg: &Resolved,
    model: Option<&M>,
    req: &TreeRequest<'_>,
    eos_ids: &[u32],
    s: &mut SearchScratch,
) {
    let (k, topk, eps, m_cap, w_cap) = (cfg.k, cfg.topk, cfg.eps, cfg.num_nodes, cfg.beam_width);
    debug_assert_eq!(req.tokens.len(), cfg.depth * k);
    debug_assert_eq!(req.probs.len(), cfg.depth * k);
    s.arena.clear();
    s.arena.push(Node {
        parent: NO_PARENT,
        token: req.root,
        score: 0.0,
        depth: 0,
        eos: false,
    });
    s.beam.clear();
    s.beam.push(0);
    s.top.clear();
    let ln_eps = log_term(0.0, eps);

    for level in 0..cfg.depth {
        let row_tokens = &req.tokens[level * k..level * k + topk];
        let row_probs = &req.probs[level * k..level * k + topk];
        let (lambda, alpha) = (cfg.lambda[level], cfg.alpha[level]);
        s.draft.clear();
        s.draft
            .extend(row_probs.iter().map(|&p| alpha * log_term(p, eps)));
        s.eos_flags.clear();
        s.eos_flags
            .extend(row_tokens.iter().map(|t| eos_ids.contains(t)));
        let ngram = model.filter(|_| level > 0 || cfg.ngram_at_level0);
        let level_start = s.arena.len();
        let child_depth = (level + 1) as u8;
        let last = level + 1 == cfg.depth;
        let non_eos = s.eos_flags.iter().filter(|&&e| !e).count() * s.beam.len();
        let beam_all = !last && non_eos < w_cap; // every child may be needed for the beam
        s.level_keys.clear();
        s.eos_keys.clear();
        s.level_top.clear();

        // Fixed slots in creation order; unscored children keep score −∞.
        for &b in &s.beam {
            let score = f32::NEG_INFINITY;
            s.arena.extend(
                row_tokens
                    .iter()
                    .zip(&s.eos_flags)
                    .map(|(&token, &eos)| Node {
                        parent: b,
                        token,
                        score,
                        depth: child_depth,
                        eos,
                    }),
            );
        }
        // Expand parents best-first so the thresholds tighten early.
        s.order.clear();
        s.order.extend(
            s.beam.iter().enumerate().map(|(bi, &b)| {
                (order_key(s.arena[b as usize].score, b) & !0xFFFF_FFFF) | bi as u64
            }),
        );
        s.order.sort_unstable();

        for oi in 0..s.order.len() {
            let bi = (s.order[oi] & 0xFFFF_FFFF) as usize;
            let b = s.beam[bi];
            let node = s.arena[b as usize];
            let slot0 = level_start + bi * topk;
            s.want.clear();
            s.want_tokens.clear();
            for (j, &token) in row_tokens.iter().enumerate() {
                let upper = node.score + (lambda * s.draft[j]) as f32;
                let key = order_key(upper, (slot0 + j) as u32);
                let needed = heap_admits(&s.top, m_cap, key)
                    || (!last
                        && (beam_all
                            || (!s.eos_flags[j] && heap_admits(&s.level_top, w_cap, key))));
                if needed {
                    s.want.push(j as u32);
                    s.want_tokens.push(token);
                }
            }
            if s.want.is_empty() {
                continue;
            }
            if let Some(m) = ngram {
                let (prev2, prev1) = if node.parent == NO_PARENT {
                    (req.prev1, node.token)
                } else {
                    (Some(s.arena[node.parent as usize].token), node.token)
                };
                s.q.clear();
                s.q.resize(s.want.len(), 0.0);
                m.next_probs(prev2, prev1, &s.want_tokens, &mut s.q);
            }
            for wi in 0..s.want.len() {
                let j = s.want[wi] as usize;
                let inc = if ngram.is_some() {
                    let q = s.q[wi];
                    let lq = if q == 0.0 { ln_eps } else { log_term(q, eps) };
                    lambda * (s.draft[j] + cfg.beta * lq)
                } else {
                    lambda * s.draft[j]
                };
                let score = node.score + inc as f32;
                let slot = slot0 + j;
                s.arena[slot].score = score;
                let key = order_key(score, slot as u32);
                heap_insert(&mut s.top, m_cap, key);
                if s.eos_flags[j] {
                    s.eos_keys.push(key);
                } else {
                    heap_insert(&mut s.level_top, w_cap, key);
                    s.level_keys.push(key);
                }
            }
        }

        if !last {
            select_beam(s, w_cap);
        }
    }

    s.selected.clear();
    s.selected.extend(s.top.iter().map(|&key| key_index(key)));
    s.selected.sort_unstable();
}

/// Picks the next beam among the scored children of the level: non-EOS first, then by the order key.
/// The beam is kept in arena order so that creation order stays depth-major and parent-major.
fn select_beam(s: &mut SearchScratch, width: usize) {
    keep_smallest(&mut s.level_keys, width);
    let missing = width - s.level_keys.len();
    keep_smallest(&mut s.eos_keys, missing);
    s.beam.clear();
    s.beam.extend(
        s.level_keys
            .iter()
            .chain(s.eos_keys.iter())
            .map(|&key| key_index(key)),
    );
    s.beam.sort_unstable();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_key_sorts_score_desc_then_index() {
        let mut v = [
            order_key(-1.0, 3),
            order_key(0.0, 7),
            order_key(-0.0, 2),
            order_key(-1.0, 1),
            order_key(-f32::MAX, 0),
            order_key(-1e-30, 9),
        ];
        v.sort_unstable();
        let idx: Vec<u32> = v.iter().map(|&k| key_index(k)).collect();
        assert_eq!(idx, vec![2, 7, 9, 1, 3, 0]);
    }

    #[test]
    fn log_term_is_non_positive() {
        assert_eq!(log_term(1.0, 1e-10), 0.0);
        assert_eq!(log_term(1.0, 0.5), 0.0);
        assert!(log_term(0.0, 1e-10) < -23.0);
        assert_eq!(log_term(0.5, 1e-10), (0.5f64).ln());
    }

    #[test]
    fn keep_smallest_keeps_the_smallest() {
        let mut v = vec![5, 1, 4, 2, 3];
        keep_smallest(&mut v, 2);
        v.sort_unstable();
        assert_eq!(v, vec![1, 2]);
        let mut v = vec![5, 1];
        keep_smallest(&mut v, 0);
        assert!(v.is_empty());
    }
}
