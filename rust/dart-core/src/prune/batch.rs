//! The batched entry point: validates the whole batch, then searches and encodes every request in
//! parallel (rayon, one request per task) into its slice of preallocated output buffers.
use std::cell::RefCell;

use rayon::prelude::*;

use super::config::{PruneConfig, Resolved};
use super::encode::{encode, TreeOut};
use super::error::{bail, Result};
use super::graft::{graft_chain, GraftScratch};
use super::search::{search, SearchScratch, TreeRequest};
use crate::NextTokenModel;

/// Target token ids `[bs, D, k]`, row-major, as int32 or int64.
#[derive(Debug, Clone, Copy)]
pub enum TokenIds<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
}

impl TokenIds<'_> {
    fn len(&self) -> usize {
        match self {
            TokenIds::I32(v) => v.len(),
            TokenIds::I64(v) => v.len(),
        }
    }

    /// Position and value of the first id outside `[0, limit)`.
    fn first_invalid(&self, limit: u64) -> Option<(usize, i64)> {
        let bad = |t: i64| t < 0 || t as u64 >= limit;
        match self {
            TokenIds::I32(v) => v
                .iter()
                .position(|&t| bad(t.into()))
                .map(|i| (i, i64::from(v[i]))),
            TokenIds::I64(v) => v.iter().position(|&t| bad(t)).map(|i| (i, v[i])),
        }
    }

    /// Copies `range` as u32 (the ids were validated to be in `[0, 2^32)`).
    fn copy_to(&self, range: std::ops::Range<usize>, out: &mut Vec<u32>) {
        out.clear();
        match self {
            TokenIds::I32(v) => out.extend(v[range].iter().map(|&t| t as u32)),
            TokenIds::I64(v) => out.extend(v[range].iter().map(|&t| t as u32)),
        }
    }
}

/// One batch of pruner inputs.
#[derive(Debug, Clone, Copy)]
pub struct BatchInput<'a> {
    pub batch_size: usize,
    /// D, the number of draft levels.
    pub depth: usize,
    /// Columns per level.
    pub k: usize,
    /// `[bs, D, k]` target token ids.
    pub token_ids: TokenIds<'a>,
    /// `[bs, D, k]` probabilities (softmax over the top-k), each finite and in [0, 1].
    pub probs: &'a [f32],
    /// `[bs]` root tokens (the last accepted token of each request).
    pub roots: &'a [i64],
    /// `[bs, 2]` the two tokens before the root, `(prev2, prev1)`; -1 = unknown. With the order-3 model
    /// only `prev1` is used (context `(prev1, root)` of the root's children, when the n-gram is on at level 0).
    pub context: &'a [i64],
    /// Stop token ids: children with these tokens are extended only if the beam cannot be filled otherwise.
    pub eos_ids: &'a [i64],
}

/// Context chains to graft onto the trees (`graft`): `[bs, width]` row-major, each row a chain of token
/// ids ended by the first -1 (or the row's end); at most `max_new` new nodes per tree.
#[derive(Debug, Clone, Copy)]
pub struct ContextChains<'a> {
    pub tokens: &'a [i64],
    pub width: usize,
    pub max_new: usize,
}

/// The pruned trees of a batch, every array row-major and owned (handed to numpy without copies).
#[derive(Debug, Clone, PartialEq)]
pub struct TreeBatch {
    pub batch_size: usize,
    /// Nodes per tree, root included (N = M + 1).
    pub n: usize,
    /// `[bs, N]`, root first, nodes in depth-ascending order.
    pub tokens: Vec<i64>,
    /// `[bs, N]`, the root's parent is -1; a parent always has a smaller index.
    pub parents: Vec<i32>,
    /// `[bs, N]`, root 0.
    pub depth: Vec<i32>,
    /// `[bs, N, N]`, row i true at i and its ancestors (root included).
    pub tree_mask: Vec<bool>,
}

type TreeSlices<'a> = (
    ((&'a mut [i64], &'a mut [i32]), &'a mut [i32]),
    &'a mut [bool],
);

#[derive(Default)]
struct Scratch {
    search: SearchScratch,
    graft: GraftScratch,
    chain: Vec<u32>,
    tokens: Vec<u32>,
    out_index: Vec<u32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Every token id must be below this: the vocabulary size when known, and ids are u32 inside.
fn id_limit(vocab_size: Option<u64>) -> u64 {
    vocab_size.unwrap_or(1 << 32).min(1 << 32)
}

/// Position of the first value that is neither -1 (unknown / none) nor a token id below `limit`.
fn first_neither_unknown_nor_id(values: &[i64], limit: u64) -> Option<usize> {
    values
        .iter()
        .position(|&t| t != -1 && (t < 0 || t as u64 >= limit))
}

fn validate(input: &BatchInput<'_>, vocab_size: Option<u64>) -> Result<()> {
    let (bs, d, k) = (input.batch_size, input.depth, input.k);
    let cells = bs.checked_mul(d).and_then(|x| x.checked_mul(k));
    let Some(cells) = cells else {
        bail!("batch shape [{bs}, {d}, {k}] is too large")
    };
    if input.token_ids.len() != cells {
        bail!(
            "token_ids has {} elements, expected bs*D*k = {bs}*{d}*{k}",
            input.token_ids.len()
        );
    }
    if input.probs.len() != cells {
        bail!(
            "probs has {} elements, expected bs*D*k = {bs}*{d}*{k}",
            input.probs.len()
        );
    }
    if input.roots.len() != bs {
        bail!(
            "roots has {} elements, expected bs = {bs}",
            input.roots.len()
        );
    }
    if input.context.len() != 2 * bs {
        bail!(
            "context has {} elements, expected [bs, 2] = {}",
            input.context.len(),
            2 * bs
        );
    }
    let limit = id_limit(vocab_size);
    let at = |i: usize| (i / (d * k), (i / k) % d, i % k);
    if let Some((i, t)) = input.token_ids.first_invalid(limit) {
        let (r, l, j) = at(i);
        bail!("token_ids[{r}, {l}, {j}] = {t} is outside [0, {limit})");
    }
    if let Some(i) = input
        .probs
        .iter()
        .position(|p| !(p.is_finite() && (0.0..=1.0).contains(p)))
    {
        let (r, l, j) = at(i);
        bail!(
            "probs[{r}, {l}, {j}] = {} is not a probability (finite, in [0, 1])",
            input.probs[i]
        );
    }
    if let Some(i) = input.roots.iter().position(|&t| t < 0 || t as u64 >= limit) {
        bail!("roots[{i}] = {} is outside [0, {limit})", input.roots[i]);
    }
    if let Some(i) = first_neither_unknown_nor_id(input.context, limit) {
        bail!(
            "context[{}, {}] = {} is neither -1 nor in [0, {limit})",
            i / 2,
            i % 2,
            input.context[i]
        );
    }
    if let Some(t) = input.eos_ids.iter().find(|&&t| !(0..1 << 32).contains(&t)) {
        bail!("eos id {t} is outside [0, 2^32)");
    }
    Ok(())
}

fn validate_chains(chains: &ContextChains<'_>, bs: usize, vocab_size: Option<u64>) -> Result<()> {
    let width = chains.width;
    if chains.tokens.len() != bs * width {
        bail!(
            "chains has {} elements, expected [bs, width] = [{bs}, {width}]",
            chains.tokens.len()
        );
    }
    let limit = id_limit(vocab_size);
    if let Some(i) = first_neither_unknown_nor_id(chains.tokens, limit) {
        bail!(
            "chains[{}, {}] = {} is neither -1 nor in [0, {limit})",
            i / width,
            i % width,
            chains.tokens[i]
        );
    }
    Ok(())
}

/// Prunes every request of the batch. `model = None` drops the n-gram term (the "no n-gram" mode).
/// `vocab_size`, when known, bounds every token id.
pub fn prune_batch<M: NextTokenModel + ?Sized>(
    cfg: &PruneConfig,
    model: Option<&M>,
    input: &BatchInput<'_>,
    vocab_size: Option<u64>,
) -> Result<TreeBatch> {
    prune_batch_with_chains(cfg, model, input, None, vocab_size)
}

/// [`prune_batch`], then each request's context chain grafted onto its tree (`graft`).
pub fn prune_batch_with_chains<M: NextTokenModel + ?Sized>(
    cfg: &PruneConfig,
    model: Option<&M>,
    input: &BatchInput<'_>,
    chains: Option<&ContextChains<'_>>,
    vocab_size: Option<u64>,
) -> Result<TreeBatch> {
    let resolved = cfg.resolve(input.depth, input.k)?;
    validate(input, vocab_size)?;
    if let Some(chains) = chains {
        validate_chains(chains, input.batch_size, vocab_size)?;
    }
    let eos: Vec<u32> = input.eos_ids.iter().map(|&t| t as u32).collect();
    let (bs, n) = (input.batch_size, resolved.n());
    let mut out = TreeBatch {
        batch_size: bs,
        n,
        tokens: vec![0; bs * n],
        parents: vec![0; bs * n],
        depth: vec![0; bs * n],
        tree_mask: vec![false; bs * n * n],
    };
    let work = |(r, (((tokens, parents), depth), tree_mask)): (usize, TreeSlices<'_>)| {
        let tree = TreeOut {
            tokens,
            parents,
            depth,
            tree_mask,
        };
        let job = Job {
            input,
            chains,
            eos: &eos,
        };
        with_scratch(|s| prune_one(&resolved, model, &job, r, s, tree));
    };
    if bs <= 1 {
        // One tree: stay on the calling thread (no hand-off to the pool).
        out.tokens
            .chunks_mut(n)
            .zip(out.parents.chunks_mut(n))
            .zip(out.depth.chunks_mut(n))
            .zip(out.tree_mask.chunks_mut(n * n))
            .enumerate()
            .for_each(work);
    } else {
        out.tokens
            .par_chunks_mut(n)
            .zip(out.parents.par_chunks_mut(n))
            .zip(out.depth.par_chunks_mut(n))
            .zip(out.tree_mask.par_chunks_mut(n * n))
            .enumerate()
            .for_each(work);
    }
    Ok(out)
}

fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        Err(_) => f(&mut Scratch::default()), // re-entered on this thread (a model running rayon): no reuse
    })
}

/// What every request of a batch shares.
struct Job<'a> {
    input: &'a BatchInput<'a>,
    chains: Option<&'a ContextChains<'a>>,
    eos: &'a [u32],
}

fn prune_one<M: NextTokenModel + ?Sized>(
    cfg: &Resolved,
    model: Option<&M>,
    job: &Job<'_>,
    r: usize,
    s: &mut Scratch,
    out: TreeOut<'_>,
) {
    let (input, chains, eos) = (job.input, job.chains, job.eos);
    let cells = cfg.depth * cfg.k;
    let range = r * cells..(r + 1) * cfg.depth * cfg.k;
    input.token_ids.copy_to(range.clone(), &mut s.tokens);
    let prev1 = input.context[2 * r + 1];
    let req = TreeRequest {
        tokens: &s.tokens,
        probs: &input.probs[range],
        prev1: (prev1 >= 0).then_some(prev1 as u32),
        root: input.roots[r] as u32,
    };
    search(cfg, model, &req, eos, &mut s.search);
    if let Some(chains) = chains.filter(|c| c.max_new > 0 && c.width > 0) {
        let row = &chains.tokens[r * chains.width..(r + 1) * chains.width];
        s.chain.clear();
        s.chain
            .extend(row.iter().take_while(|&&t| t >= 0).map(|&t| t as u32));
        graft_chain(&mut s.search, &s.chain, chains.max_new, &mut s.graft);
    }
    encode(&s.search.arena, &s.search.selected, &mut s.out_index, out);
}

/// Prunes one tree on the calling thread with caller-owned scratch (single-tree benchmarks and tests).
pub fn prune_single<M: NextTokenModel + ?Sized>(
    cfg: &Resolved,
    model: Option<&M>,
    req: &TreeRequest<'_>,
    eos: &[u32],
    scratch: &mut SearchScratch,
    out_index: &mut Vec<u32>,
    out: TreeOut<'_>,
) {
    search(cfg, model, req, eos, scratch);
    encode(&scratch.arena, &scratch.selected, out_index, out);
}
