"""Greedy tree acceptance on the CPU, taking the target's argmax only at the nodes the walk visits.

SGLang's `eagle_sample` takes `torch.argmax` over every verified node's logits before it walks the tree.
On a CPU that reduction does not vectorise: 16 rows of SmolLM2's 49,152 logits cost about 0.9 ms of a
50 ms batch-1 DART step, 64 rows (batch 16, trees of 4) several ms, while the walk reads the argmax of
only the accepted path and the node after it (about 2-3 rows a request). Here the walk goes depth by
depth: one argmax over the rows the still-walking requests stand on (`first_argmax`, the same index as
`torch.argmax`, faster), then each request steps to the child whose draft token is that argmax. Each
row's argmax is torch's own, so the accepted paths, the predicted tokens and the bonus tokens are
exactly `eagle_sample`'s (greedy branch, which a CPU takes for sampled requests too, their nodes pinned
to the drawn tokens beforehand).

It reads host lists at every depth, which a CPU pays nothing for and a GPU would pay a sync for: the
worker uses it only on the CPU (hence its place among the CPU engine's stand-ins, whose reads DART's
host-read budget does not count, as it does not count SGLang's own CPU tree walk), and only where
`eagle_sample` would change nothing else (no relaxed penalties or logit bias to add, no simulated
acceptance)."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.speculative.spec_utils import SIMULATE_ACC_LEN

from sglang_dart.cpu.ops import walk_trees


def first_argmax(rows: torch.Tensor) -> torch.Tensor:
    """torch.argmax(rows, dim=-1), computed as `torch.max(rows, dim=-1).indices`: the same index (torch
    returns the first maximal value's for both, NaN counting as the maximum), and on a CPU 4-5x faster,
    because argmax's reduction does not vectorise there (16 bf16 rows of 49,152 logits: 1.24 against
    0.27 ms; 64 rows: 5.0 against 1.1 ms, 2 threads on the AMX Xeon)."""
    return torch.max(rows, dim=-1).indices


def walks_on_host(device: str | torch.device, sampling_info: Any) -> bool:
    """Whether `greedy_walk` replaces `eagle_sample` for a verify: on the CPU (where eagle_sample walks
    greedily anyway), when eagle_sample would add nothing to the logits first (relaxed penalties, logit
    bias) and simulates nothing."""
    return (
        torch.device(device).type == "cpu"
        and sampling_info.acc_additive_penalties is None
        and sampling_info.acc_scaling_penalties is None
        and sampling_info.logit_bias is None
        and SIMULATE_ACC_LEN <= 0
    )


def greedy_walk(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(predict [bs * size] int32, accept_lens [bs] int32 counting the bonus token, accept_index
    [bs, max_depth] int32, -1 past each path) as `eagle_sample` returns them. logits: [bs * size, V], row
    `retrieve_index[b, node]` is node `node` of request b; candidates [bs, size]: each node's draft token;
    retrieve_next_token / _sibling [bs, size]: first child and next sibling (-1: none). The walk is the
    greedy op's own (`walk_trees`), with the argmax taken of the rows it reads only."""
    bs, size = candidates.shape
    device = logits.device

    def argmax_of(rows: list[int]) -> list[int]:
        return first_argmax(logits[torch.tensor(rows, device=device)]).tolist()

    paths, accepted, rows, tokens = walk_trees(
        candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, bs, max_depth, argmax_of
    )
    predict = torch.zeros(bs * size, dtype=torch.int32, device=device)
    predict[torch.tensor(rows, dtype=torch.int64, device=device)] = torch.tensor(
        tokens, dtype=torch.int32, device=device
    )
    accept_index = torch.tensor(paths, dtype=torch.int32, device=device).view(bs, max_depth)
    accept_lens = torch.tensor(accepted, dtype=torch.int32, device=device) + 1
    return predict, accept_lens, accept_index
