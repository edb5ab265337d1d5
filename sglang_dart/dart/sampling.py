"""Lossless sampling for tree verification with deterministic drafts.

At every tree node the target's next-token distribution (penalties, bias, temperature, top-k, top-p,
min-p applied as SGLang does for one token) is sampled once. Walking down the tree while a child's token
equals the sample at its parent emits exactly the tokens plain sampling would draw, one conditional at a
time: each emitted token is a fresh draw from the target at the true prefix. SGLang's CPU verify walks the
tree greedily (argmax), so the samples are handed to it as one-hot logits.

Under `--enable-deterministic-inference` SGLang draws each token with a seeded Gumbel sampler keyed by
(request seed, position). Every node is drawn with that same key, its request's seed and the position its
logits are read at (root position + depth), through the branch SGLang's sampler takes for the batch: so
the walk emits, token for token, what plain seeded sampling emits.

Custom logit processors (`--enable-custom-logit-processor`), which SGLang's tree verify does not run, run
here on every node's row, after penalties and bias as in plain sampling, each row with its request's
parameters. A processor that reads the request's history (`custom_params["__req__"]`, as SGLang's
thinking-budget and no-repeat processors do) sees at a node the request's output followed by the drafts on
the path to that node: what it would see had those tokens been generated one at a time.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import torch
from sglang.srt.layers.sampler import (
    multinomial_with_seed,
    sampling_from_probs_torch,
    top_k_top_p_min_p_sampling_from_probs_torch,
)
from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

from sglang_dart.cpu.greedy_walk import first_argmax


def _per_node(x: torch.Tensor | None, nodes: int) -> torch.Tensor | None:
    return None if x is None else torch.repeat_interleave(x, nodes, dim=0)


def needs_pinning(sampling_info: Any) -> bool:
    """Whether the verify logits must be replaced by per-node samples: for sampled requests, and for custom
    logit processors (which SGLang's verify does not run)."""
    return not sampling_info.is_all_greedy or sampling_info.has_custom_logit_processor


def node_paths(tree_masks: np.ndarray, tokens: np.ndarray) -> list[list[list[int]]]:
    """paths[b][i]: the tokens on the path from request b's root (excluded) to node i (included).
    tree_masks [bs, n, n] (node i sees node j: j is i or an ancestor, ancestors first), tokens [bs, n]."""
    bs, n, _ = tree_masks.shape
    return [
        [[int(tokens[b, j]) for j in range(1, i + 1) if tree_masks[b, i, j]] for i in range(n)]
        for b in range(bs)
    ]


class _RequestAtNode:
    """A request as a tree node's logits see it: the drafts on the node's path appended to its output.
    Anything else is read from the request itself."""

    def __init__(self, req: Any, path: list[int]) -> None:
        self._req = req
        output = req.output_ids  # SGLang keeps token ids in an array("q"); keep the type processors see
        self.output_ids = output + (array(output.typecode, path) if isinstance(output, array) else list(path))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._req, name)


def _params_at_node(params: dict | None, path: list[int]) -> dict | None:
    if not params or not path or params.get("__req__") is None:
        return params
    return {**params, "__req__": _RequestAtNode(params["__req__"], path)}


def apply_custom_processors(sampling_info: Any, logits: torch.Tensor, paths: list[list[list[int]]]) -> None:
    """Run each request's custom logit processor on its node rows of logits [bs * nodes, V], in place.
    Every row is passed as a request of its own (its request's parameters, history up to the node), so a
    processor that pairs its parameter list with its rows sees them paired correctly."""
    if not sampling_info.has_custom_logit_processor:
        return
    nodes = len(paths[0]) if paths else 0
    for processor, request_mask in sampling_info.custom_logit_processor.values():
        chosen = request_mask.nonzero(as_tuple=True)[0].tolist()
        rows = torch.tensor([b * nodes + i for b in chosen for i in range(nodes)], device=logits.device)
        params = [
            _params_at_node(sampling_info.custom_params[b], paths[b][i]) for b in chosen for i in range(nodes)
        ]
        if rows.numel():
            logits[rows] = processor(logits[rows], params)


def _without_min_p_tail(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """probs with every token below min_p × its row's top probability zeroed. SGLang's seeded sampler
    refuses min-p (it filters after sorting, and its seeded draw needs the filter first); zeroing the same
    tokens beforehand leaves the top-k/top-p cut unchanged: they are the row's smallest entries."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_ps.view(-1, 1)
    return probs.masked_fill(probs < threshold, 0.0)


# Largest [rows, V] block one draw works on. The torch sampler sorts whole rows (values and int64 indices),
# takes their cumulative sums and, seeded, their float64 logs: about DRAW_BYTES_PER_ENTRY bytes per
# vocabulary entry. A verify samples bs x N rows at once (512 rows of a 152k vocabulary: ~3.7 GB), so rows
# are drawn in blocks; every draw is row-wise, and a seeded one keyed by (seed, position), so a blocked
# draw is the same draw.
DRAW_BLOCK_BYTES = 256 << 20
DRAW_BYTES_PER_ENTRY = 48


def draw_block_rows(vocab: int) -> int:
    """How many rows of a `vocab`-wide distribution one draw takes at a time."""
    return max(1, DRAW_BLOCK_BYTES // (max(vocab, 1) * DRAW_BYTES_PER_ENTRY))


def _draw(
    sampling_info: Any,
    logits: torch.Tensor,
    nodes: int,
    positions: torch.Tensor | None,
    rl_on_policy: bool,
) -> torch.Tensor:
    """One draw per row of logits [bs * nodes, V] with temperature, top-k, top-p and min-p, seeded as plain
    decoding seeds it when the batch carries seeds (deterministic inference); in blocks of rows."""
    per_row = {
        "temperatures": _per_node(sampling_info.temperatures, nodes).view(-1, 1),
        "top_ks": _per_node(sampling_info.top_ks, nodes),
        "top_ps": _per_node(sampling_info.top_ps, nodes),
        "min_ps": _per_node(sampling_info.min_ps, nodes),
        "seeds": _per_node(sampling_info.sampling_seed, nodes),
    }
    if per_row["seeds"] is not None:
        if positions is None:
            raise ValueError("seeded sampling needs every node's position")
        per_row["positions"] = positions.view(-1)
    else:
        per_row["positions"] = None
    rows, step = logits.shape[0], draw_block_rows(logits.shape[-1])
    blocks = []
    for start in range(0, rows, step):
        block = slice(start, start + step)
        sliced = {name: None if x is None else x[block] for name, x in per_row.items()}
        blocks.append(
            _draw_rows(sampling_info, logits[block], rl_on_policy, **sliced).to(torch.int64).view(-1)
        )
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def _draw_rows(
    sampling_info: Any,
    logits: torch.Tensor,
    rl_on_policy: bool,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    seeds: torch.Tensor | None,
    positions: torch.Tensor | None,
) -> torch.Tensor:
    if seeds is None:
        probs = torch.softmax(logits / temperatures, dim=-1)
        return top_k_top_p_min_p_sampling_from_probs_torch(
            probs, top_ks, top_ps, min_ps, sampling_info.need_min_p_sampling, None, None
        )
    # The branch SGLang's sampler takes for the whole batch: its seeded paths draw differently.
    simple = not (
        sampling_info.need_top_p_sampling
        or sampling_info.need_top_k_sampling
        or sampling_info.need_min_p_sampling
    )
    if simple and rl_on_policy:  # `--rl-on-policy-target`: the trainer's bf16 log-softmax
        logprobs = torch.log_softmax(logits.bfloat16().div(temperatures).bfloat16(), dim=-1)
        return multinomial_with_seed(logprobs, seeds, positions).view(-1)
    probs = torch.softmax(logits / temperatures, dim=-1)
    if simple:
        return sampling_from_probs_torch(probs, seeds, positions)
    if sampling_info.need_min_p_sampling:
        probs = _without_min_p_tail(probs, min_ps)
    return top_k_top_p_min_p_sampling_from_probs_torch(probs, top_ks, top_ps, min_ps, False, seeds, positions)


def sample_tree_nodes(
    sampling_info: Any,
    logits: torch.Tensor,
    nodes: int,
    paths: list[list[list[int]]] | None = None,
    positions: torch.Tensor | None = None,
    rl_on_policy: bool = False,
) -> torch.Tensor:
    """One token per row of logits [bs * nodes, V]: argmax for greedy requests, a draw otherwise.
    paths (`node_paths`) is needed when the batch has custom logit processors; positions [bs * nodes]
    (the position each row's logits are read at) when it carries sampling seeds; rl_on_policy says the
    server runs with `--rl-on-policy-target`, which changes how SGLang draws seeded requests."""
    logits = logits.float().clone()
    additive = _per_node(sampling_info.acc_additive_penalties, nodes)
    if additive is not None:
        logits += additive
    scaling = _per_node(sampling_info.acc_scaling_penalties, nodes)
    if scaling is not None:
        apply_scaling_penalties(logits, scaling)
    bias = _per_node(sampling_info.logit_bias, nodes)
    if bias is not None:
        logits += bias
    if sampling_info.has_custom_logit_processor:
        if paths is None:
            raise ValueError("custom logit processors need the tree's node paths")
        apply_custom_processors(sampling_info, logits, paths)
    # A node a grammar rules out entirely (under a disallowed ancestor) is never reached; give it finite
    # logits so that its (unused) draw cannot fail on an all -inf row.
    logits[~torch.isfinite(logits).any(dim=-1)] = 0.0
    greedy = _per_node(sampling_info.top_ks, nodes).view(-1) <= 1
    drawn = _draw(sampling_info, logits, nodes, positions, rl_on_policy)
    # On a CPU max(dim).indices is argmax's index, several times faster (`greedy_walk.first_argmax`).
    best = first_argmax(logits) if logits.is_cpu else logits.argmax(dim=-1)
    return torch.where(greedy, best, drawn)


def pin_logits_to_samples(
    sampling_info: Any,
    logits: torch.Tensor,
    nodes: int,
    paths: list[list[list[int]]] | None = None,
    positions: torch.Tensor | None = None,
    rl_on_policy: bool = False,
) -> None:
    """Replace logits [bs * nodes, V] in place by one-hot rows at each node's sample, so that an argmax
    tree walk accepts exactly the sampled path. A no-op where `needs_pinning` says so."""
    if not needs_pinning(sampling_info):
        return
    samples = sample_tree_nodes(sampling_info, logits, nodes, paths, positions, rl_on_policy)
    logits.fill_(float("-inf"))
    logits.scatter_(1, samples.view(-1, 1), 0.0)
