"""Lossless sampling for tree verification with deterministic drafts.

At every tree node the target's next-token distribution (penalties, bias, temperature, top-k, top-p,
min-p applied as SGLang does for one token) is sampled once. Walking down the tree while a child's token
equals the sample at its parent emits exactly the tokens plain sampling would draw, one conditional at a
time: each emitted token is a fresh draw from the target at the true prefix. SGLang's CPU verify walks the
tree greedily (argmax), so the samples are handed to it as one-hot logits.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch
from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties


def _per_node(x: torch.Tensor | None, nodes: int) -> torch.Tensor | None:
    return None if x is None else torch.repeat_interleave(x, nodes, dim=0)


def sample_tree_nodes(sampling_info: Any, logits: torch.Tensor, nodes: int) -> torch.Tensor:
    """One token per row of logits [bs * nodes, V]: argmax for greedy requests, a draw otherwise."""
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
    # A node a grammar rules out entirely (under a disallowed ancestor) is never reached; give it finite
    # logits so that its (unused) draw cannot fail on an all -inf row.
    logits[~torch.isfinite(logits).any(dim=-1)] = 0.0
    greedy = _per_node(sampling_info.top_ks, nodes).view(-1) <= 1
    probs = torch.softmax(logits / _per_node(sampling_info.temperatures, nodes).view(-1, 1), dim=-1)
    drawn = top_k_top_p_min_p_sampling_from_probs_torch(
        probs,
        _per_node(sampling_info.top_ks, nodes),
        _per_node(sampling_info.top_ps, nodes),
        _per_node(sampling_info.min_ps, nodes),
        sampling_info.need_min_p_sampling,
        None,
        None,
    ).to(torch.int64)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


def pin_logits_to_samples(sampling_info: Any, logits: torch.Tensor, nodes: int) -> None:
    """Replace logits [bs * nodes, V] in place by one-hot rows at each node's sample, so that an argmax
    tree walk accepts exactly the sampled path. A no-op for all-greedy batches."""
    if sampling_info.is_all_greedy:
        return
    samples = sample_tree_nodes(sampling_info, logits, nodes)
    logits.fill_(float("-inf"))
    logits.scatter_(1, samples.view(-1, 1), 0.0)
