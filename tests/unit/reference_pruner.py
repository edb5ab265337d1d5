"""Plain-Python reference of the DART tree pruner, written from the method spec (§4.3/§4.4), not from the
Rust code. Straightforward and slow: every candidate carries its full token path, the beam and the pool
are fully sorted, and the n-gram model is a dict of counts.

Numerics (the documented contract of ``sglang_dart.pruner``):
    lp(x)  = min(0, ln(float32(x) + float32(eps)))   # sum in float32, log in float64
    inc    = lam * (alpha * lp(p) + beta * lp(q))    # float64; without the n-gram term: lam * (alpha * lp(p))
    score  = float32(score(parent) + float32(inc))   # float32 accumulation; root = 0
Orders: beam = first W children by (is_eos, -score, creation); kept = first M of the pool by
(-score, depth, creation); output = root, then kept by (depth, creation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


class RefNgram:
    """MLE trigram with per-token back-off to the bigram, from a dict of n-gram counts (§5.2)."""

    def __init__(self, counts: dict[tuple[int, ...], int]) -> None:
        self.counts = counts

    @staticmethod
    def count_documents(docs: list[list[int]]) -> dict[tuple[int, ...], int]:
        counts: dict[tuple[int, ...], int] = {}
        for doc in docs:
            for s in range(len(doc)):
                for n in range(1, 4):
                    if s + n <= len(doc):
                        g = tuple(doc[s : s + n])
                        counts[g] = counts.get(g, 0) + 1
        return counts

    def prob(self, context: list[int], token: int) -> float:
        for n in (2, 1):
            if len(context) < n:
                continue
            ctx = tuple(context[-n:])
            if ctx in self.counts and ctx + (token,) in self.counts:
                return float(np.float32(self.counts[ctx + (token,)] / self.counts[ctx]))
        return 0.0


@dataclass
class RefConfig:
    topk: int | None = None
    beam_width: int = 20
    num_nodes: int = 60
    ngram_weight: float = 0.5
    level_weight_exponent: float = 0.7
    logit_weight_base: float = 0.9
    eps: float = 1e-10
    ngram_at_level0: bool = False
    level_weights: list[float] | None = None
    logit_weights: list[float] | None = None


@dataclass
class Cand:
    path: tuple[int, ...]
    score: float
    order: int
    eos: bool
    parent: Cand | None = field(default=None, repr=False)


def _lp(x: float, eps: float) -> float:
    s = np.float32(x) + np.float32(eps)
    return min(0.0, math.log(float(s)))


def reference_prune_one(
    tokens: list[list[int]],
    probs: list[list[float]],
    root: int,
    prev1: int,
    eos_ids: list[int],
    cfg: RefConfig,
    model: RefNgram | None,
) -> tuple[list[int], list[int], list[int], list[list[bool]]]:
    depth_count = len(tokens)
    topk = cfg.topk if cfg.topk is not None else len(tokens[0])
    preceding = ([prev1] if prev1 >= 0 else []) + [root]
    beam: list[Cand] = [Cand(path=(), score=0.0, order=0, eos=False)]
    pool: list[Cand] = []
    created = 0
    for level in range(depth_count):
        lam = (
            cfg.level_weights[level] if cfg.level_weights else float(level + 1) ** -cfg.level_weight_exponent
        )
        alpha = cfg.logit_weights[level] if cfg.logit_weights else cfg.logit_weight_base ** float(level)
        use_ngram = model is not None and (level > 0 or cfg.ngram_at_level0)
        children: list[Cand] = []
        for b in beam:
            ctx = (preceding + list(b.path))[-2:]
            for j in range(topk):
                tok, p = tokens[level][j], probs[level][j]
                if use_ngram:
                    assert model is not None
                    q = model.prob(ctx, tok)
                    inc = lam * (alpha * _lp(p, cfg.eps) + cfg.ngram_weight * _lp(q, cfg.eps))
                else:
                    inc = lam * (alpha * _lp(p, cfg.eps))
                score = float(np.float32(np.float32(b.score) + np.float32(inc)))
                created += 1
                children.append(Cand(b.path + (tok,), score, created, tok in eos_ids, b))
        pool.extend(children)
        if level + 1 < depth_count:
            ranked = sorted(children, key=lambda c: (c.eos, -c.score, c.order))
            beam = sorted(ranked[: cfg.beam_width], key=lambda c: c.order)
    if cfg.num_nodes > len(pool):
        raise ValueError("num_nodes exceeds the candidates")
    kept = sorted(pool, key=lambda c: (-c.score, len(c.path), c.order))[: cfg.num_nodes]
    kept.sort(key=lambda c: (len(c.path), c.order))
    index = {id(c): i + 1 for i, c in enumerate(kept)}
    out_tokens = [root] + [c.path[-1] for c in kept]
    out_parents = [-1] + [0 if c.parent is None or not c.parent.path else index[id(c.parent)] for c in kept]
    out_depth = [0] + [len(c.path) for c in kept]
    n = len(out_tokens)
    mask = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j != -1:
            mask[i][j] = True
            j = out_parents[j]
    return out_tokens, out_parents, out_depth, mask


def reference_prune_batch(
    token_ids: np.ndarray,
    probs: np.ndarray,
    roots: np.ndarray,
    context: np.ndarray,
    eos_ids: list[int],
    cfg: RefConfig,
    model: RefNgram | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    bs = token_ids.shape[0]
    n = cfg.num_nodes + 1
    out = (
        np.zeros((bs, n), np.int64),
        np.zeros((bs, n), np.int32),
        np.zeros((bs, n), np.int32),
        np.zeros((bs, n, n), bool),
    )
    for r in range(bs):
        t, pa, d, m = reference_prune_one(
            token_ids[r].tolist(),
            probs[r].tolist(),
            int(roots[r]),
            int(context[r][1]),
            eos_ids,
            cfg,
            model,
        )
        out[0][r], out[1][r], out[2][r], out[3][r] = t, pa, d, m
    return out
