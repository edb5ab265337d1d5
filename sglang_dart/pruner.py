"""Typed wrapper over the Rust batched DART tree pruner (``sglang_dart._core.prune_batch``).

One call prunes the draft trees of a whole batch. Per request the inputs are the ``[D, k]`` target token
ids and probabilities of the draft's top-k per depth (softmax over the top-k), the two tokens before the
root and the root token. The output is exactly ``N = num_nodes + 1`` nodes per request, root first, in
depth-ascending order (parents always earlier), which is what SGLang's tree verify needs:

* ``tokens    [bs, N]    int64``  node tokens, ``tokens[:, 0]`` is the root;
* ``parents   [bs, N]    int32``  parent index, ``-1`` for the root;
* ``depth     [bs, N]    int32``  depth, ``0`` for the root;
* ``tree_mask [bs, N, N] bool``   row ``i`` is true at ``i`` and at every ancestor of ``i`` (root included).

Semantics (the DART reference, §4.3 of the method spec): beam search over the levels; a child's score is
``score(parent) + λ_l · (α_l · ln(p + eps) + β · ln(q + eps))`` where ``q`` is the n-gram probability of the
child given the last two tokens of (preceding tokens ⧺ path), λ_l = (l+1)^-0.7, α_l = 0.9^l, β = 0.5, no
n-gram term at level 0; the beam keeps the best ``beam_width`` children per level (EOS children last); the
tree keeps the best ``num_nodes`` nodes overall. Ties are broken by (score desc, depth asc, creation order
asc), which keeps the kept set prefix-closed. Numerics: ``p + eps`` is summed in float32, the logarithm is
taken in float64 and clamped at 0, the increment is computed in float64 and rounded to float32, and scores
accumulate in float32. Nodes of one depth come in creation order (parent's order, then the column order).

Context chains (optional, ``chains``/``chain_nodes``): each request's chain of tokens from its own context
(``ContextIndex``) is grafted onto its tree after the search: walked from the root through the kept nodes,
its first token not in the tree and those after it (at most ``chain_nodes``) become new nodes, each
displacing the lowest-ranked kept node off the chain's path. The tree keeps its N nodes and its
depth-ascending order.

If ``num_nodes`` exceeds the number of candidates the shape allows (``candidate_count``), the call raises
``ValueError`` instead of padding. All input errors raise ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from sglang_dart import _core

DictNgramModel = _core.DictNgramModel
ContextIndex = _core.ContextIndex

# The defaults live in Rust (`PruneConfig::default()`, the DART reference's values); read, not restated.
_DEFAULTS = _core.default_prune_config()


@dataclass(frozen=True)
class PrunerConfig:
    """Knobs of the tree search; defaults are the DART reference's, from the Rust core."""

    #: Candidates per depth: the first ``topk`` columns of the inputs; ``None`` = all ``k`` (reference: 25).
    topk: int | None = _DEFAULTS["topk"]
    #: Beam survivors per depth (W).
    beam_width: int = _DEFAULTS["beam_width"]
    #: Node budget M (nodes besides the root); every tree has ``N = num_nodes + 1`` nodes.
    num_nodes: int = _DEFAULTS["num_nodes"]
    #: β, weight of the n-gram log-probability.
    ngram_weight: float = _DEFAULTS["ngram_weight"]
    #: λ_l = (l + 1) ** -level_weight_exponent (unless ``level_weights`` is given).
    level_weight_exponent: float = _DEFAULTS["level_weight_exponent"]
    #: α_l = logit_weight_base ** l (unless ``logit_weights`` is given).
    logit_weight_base: float = _DEFAULTS["logit_weight_base"]
    #: Floor added to p and q (in float32) before the logarithm; must be > 0.
    eps: float = _DEFAULTS["eps"]
    #: Use the n-gram term for the root's children too (the reference does not).
    ngram_at_level0: bool = _DEFAULTS["ngram_at_level0"]
    #: Explicit λ_l per level (length ≥ D).
    level_weights: tuple[float, ...] | None = None
    #: Explicit α_l per level (length ≥ D).
    logit_weights: tuple[float, ...] | None = None

    @property
    def num_draft_tokens(self) -> int:
        """N, the tokens per request handed to the verify step (root included)."""
        return self.num_nodes + 1

    def candidate_count(self, depth: int, k: int) -> int:
        """Number of candidates a ``[depth, k]`` input yields; ``num_nodes`` must not exceed it."""
        return int(_core.candidate_count(depth, k, topk=self.topk, beam_width=self.beam_width))

    def kwargs(self) -> dict[str, Any]:
        return {
            "topk": self.topk,
            "beam_width": self.beam_width,
            "num_nodes": self.num_nodes,
            "ngram_weight": self.ngram_weight,
            "level_weight_exponent": self.level_weight_exponent,
            "logit_weight_base": self.logit_weight_base,
            "eps": self.eps,
            "ngram_at_level0": self.ngram_at_level0,
            "level_weights": None if self.level_weights is None else list(self.level_weights),
            "logit_weights": None if self.logit_weights is None else list(self.logit_weights),
        }


class PrunedTrees(NamedTuple):
    """The pruned trees of a batch (numpy arrays owning the Rust buffers)."""

    tokens: np.ndarray  # [bs, N] int64
    parents: np.ndarray  # [bs, N] int32
    depth: np.ndarray  # [bs, N] int32
    tree_mask: np.ndarray  # [bs, N, N] bool


def _as_array(x: Any, dtype: np.dtype | type, name: str) -> np.ndarray:
    try:
        return np.ascontiguousarray(np.asarray(x), dtype=dtype)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: cannot convert to {np.dtype(dtype)}: {e}") from e


def prune_batch(
    token_ids: Any,
    probs: Any,
    roots: Any,
    context: Any | None = None,
    eos_ids: Sequence[int] = (),
    *,
    config: PrunerConfig | None = None,
    store: Any | None = None,
    vocab_size: int | None = None,
    chains: Any | None = None,
    chain_nodes: int = 0,
) -> PrunedTrees:
    """Prunes the draft trees of a batch.

    Args:
        token_ids: ``[bs, D, k]`` target token ids (int32 or int64; other integer types are converted).
        probs: ``[bs, D, k]`` probabilities (converted to float32), finite and in [0, 1].
        roots: ``[bs]`` root tokens (the last accepted token of each request).
        context: ``[bs, 2]`` the two tokens before the root ``(prev2, prev1)``, -1 when unknown;
            ``None`` = all unknown. With the order-3 model only ``prev1`` matters.
        eos_ids: stop token ids (all of them; children with these tokens are extended last).
        config: the knobs (``PrunerConfig()`` = reference defaults).
        store: the n-gram model (``DictNgramModel`` or ``NgramStore``), or ``None`` for no n-gram term.
        vocab_size: bound for every token id (defaults to the store's vocabulary size when it has one).
        chains: ``[bs, width]`` int64 context chains, each ended by the first -1 (``None``: no chains).
        chain_nodes: at most this many new nodes per tree from its chain (0: no grafting).
    """
    cfg = config or PrunerConfig()
    tok = np.asarray(token_ids)
    if tok.dtype not in (np.int32, np.int64):
        if not np.issubdtype(tok.dtype, np.integer):
            raise ValueError(f"token_ids must be integers, got dtype {tok.dtype}")
        tok = tok.astype(np.int64)
    tok = np.ascontiguousarray(tok)
    p = _as_array(probs, np.float32, "probs")
    if tok.ndim != 3 or p.ndim != 3:
        raise ValueError(f"token_ids and probs must be 3-D [bs, D, k], got {tok.shape} and {p.shape}")
    r = _as_array(roots, np.int64, "roots")
    ctx = (
        np.full((tok.shape[0], 2), -1, dtype=np.int64)
        if context is None
        else _as_array(context, np.int64, "context")
    )
    eos = [int(e) for e in eos_ids]
    if chain_nodes < 0:
        raise ValueError(f"chain_nodes must be >= 0, got {chain_nodes}")
    chain_arr = None if chains is None else _as_array(chains, np.int64, "chains")
    if chain_arr is not None and chain_arr.ndim != 2:
        raise ValueError(f"chains must be 2-D [bs, width], got shape {chain_arr.shape}")
    tokens, parents, depth, mask = _core.prune_batch(
        tok,
        p,
        r,
        ctx,
        eos,
        store=store,
        vocab_size=vocab_size,
        chains=chain_arr,
        chain_nodes=chain_nodes,
        **cfg.kwargs(),
    )
    return PrunedTrees(tokens, parents, depth, mask)


__all__ = ["ContextIndex", "DictNgramModel", "PrunedTrees", "PrunerConfig", "prune_batch"]
