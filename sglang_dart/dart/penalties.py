"""Exact sampling penalties at every tree node.

Plain decoding penalizes output token n by the n output tokens before it: frequency and presence
penalties subtract from their logits, the repetition penalty scales them, and while n < min_new_tokens the
stop tokens are banned (SGLang's penalizers, `sglang.srt.sampling.penaltylib`). SGLang's speculative
verify applies "a relaxed version": every node of a request's tree gets the same penalties, and its
penalizers count one output token per step however many were accepted. That changes outputs. Here a
node's logits are penalized by the request's output followed by the drafts on the path to the node,
which is what plain decoding would have penalized them by, with the same float operations as SGLang's
penalizers (frequency penalties summed one token at a time, additive penalties before the scaling one).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties


def _penalizes(params: Any) -> bool:
    return (
        params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or params.repetition_penalty != 1.0
        or params.min_new_tokens > 0
    )


def penalized(reqs: list[Any]) -> bool:
    """Whether any request of the batch has a penalty (SGLang's penalizers' own `_is_required` tests)."""
    return any(_penalizes(req.sampling_params) for req in reqs)


def _stop_tokens(req: Any) -> list[int]:
    """The tokens min_new_tokens holds back, as SGLang's min-new-tokens penalizer collects them."""
    tokenizer = getattr(req, "tokenizer", None)
    stops = set(req.sampling_params.stop_token_ids or ())
    if tokenizer is not None:
        stops |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
        if tokenizer.eos_token_id is not None:
            stops.add(tokenizer.eos_token_id)
    return sorted(stops)


def _frequency_sums(penalty: float, largest: int) -> torch.Tensor:
    """sums[c]: the penalty added c times in float32, one token at a time, as the penalizer cumulates it
    (numpy's accumulate adds in order, in the array's dtype)."""
    steps = np.full(largest, penalty, dtype=np.float32)
    return torch.from_numpy(np.concatenate([[np.float32(0.0)], np.add.accumulate(steps, dtype=np.float32)]))


def _additive(params: Any, counts: torch.Tensor, sums: torch.Tensor | None) -> torch.Tensor:
    """Frequency and presence penalties for tokens seen `counts` times, accumulated as SGLang does: from
    zero, each additive penalizer subtracting its own."""
    acc = torch.zeros(counts.shape, dtype=torch.float32, device=counts.device)
    if sums is not None:
        acc -= sums.to(counts.device)[counts]
    if params.presence_penalty != 0.0:
        acc -= torch.where(counts > 0, params.presence_penalty, 0.0).to(torch.float32)
    return acc


def _penalize(logits: torch.Tensor, params: Any, counts: torch.Tensor, sums: Any, banned: Any) -> None:
    """logits [rows, K] += the additive penalties of tokens seen counts [K] times (and -inf where banned
    [rows, K]), then the repetition scaling, in place."""
    acc = _additive(params, counts, sums)
    logits.add_(acc if banned is None else acc + torch.where(banned, float("-inf"), 0.0))
    if params.repetition_penalty != 1.0:
        scale = torch.where(counts > 0, params.repetition_penalty, 1.0).to(torch.float32)
        apply_scaling_penalties(logits, scale.expand_as(logits))


def apply_node_penalties(logits: torch.Tensor, reqs: list[Any], paths: list[list[list[int]]]) -> None:
    """Penalize logits [bs * nodes, V] in place, node by node (paths: `sampling.node_paths`)."""
    nodes, vocab = len(paths[0]), logits.shape[1]
    device = logits.device
    for b, req in enumerate(reqs):
        params = req.sampling_params
        if not _penalizes(params):
            continue
        rows = logits[b * nodes : (b + 1) * nodes]
        output = list(req.output_ids)
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=vocab)[:vocab].to(device)
        sums = None
        if params.frequency_penalty != 0.0:
            sums = _frequency_sums(params.frequency_penalty, int(counts.max()) + max(map(len, paths[b])))
        # A node's token has index len(output) + len(path): stop tokens stay banned below min_new_tokens.
        held_back = torch.tensor([len(output) + len(p) < params.min_new_tokens for p in paths[b]])
        is_stop = torch.zeros(vocab, dtype=torch.bool)
        is_stop[[t for t in _stop_tokens(req) if 0 <= t < vocab]] = True
        banned = (held_back.unsqueeze(1) & is_stop.unsqueeze(0)).to(device) if bool(held_back.any()) else None

        # Only the path tokens' counts differ between nodes: keep their raw logits, penalize every row by
        # the request's output, then recompute those few entries from their raw logits with their counts.
        pairs = [(i, t, path.count(t)) for i, path in enumerate(paths[b]) for t in sorted(set(path))]
        at_rows = torch.tensor([i for i, _, _ in pairs], dtype=torch.int64, device=device)
        at_tokens = torch.tensor([t for _, t, _ in pairs], dtype=torch.int64, device=device)
        raw = rows[at_rows, at_tokens].clone()
        _penalize(rows, params, counts, sums, banned)
        if pairs:
            extra = torch.tensor([n for _, _, n in pairs], dtype=torch.int64, device=device)
            fixed = raw.view(1, -1)
            pair_banned = None if banned is None else banned[at_rows, at_tokens].view(1, -1)
            _penalize(fixed, params, counts[at_tokens] + extra, sums, pair_banned)
            rows[at_rows, at_tokens] = fixed.view(-1)
