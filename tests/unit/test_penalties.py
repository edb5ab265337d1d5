"""Per-node penalties against SGLang's own penalizers run token by token, as plain decoding runs them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sglang.srt.sampling import penaltylib
from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_dart.dart.penalties import apply_node_penalties, penalized
from sglang_dart.dart.sampling import node_paths

VOCAB = 32
EOS = 3
# Root 0; nodes 1 and 2 children of the root; node 3 a child of 1; node 4 a child of 3.
TREE = np.array(
    [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ],
    dtype=bool,
)


class _Batch:  # what the orchestrator reads of a ScheduleBatch (weak-referenceable)
    def __init__(self, reqs: list) -> None:
        self.reqs = reqs
        self.device = "cpu"


def _req(output: list[int], **params: object) -> SimpleNamespace:
    tokenizer = SimpleNamespace(eos_token_id=EOS, additional_stop_token_ids=None)
    return SimpleNamespace(output_ids=output, sampling_params=SamplingParams(**params), tokenizer=tokenizer)


def _plain(logits: torch.Tensor, req: SimpleNamespace, history: list[int]) -> torch.Tensor:
    """SGLang's penalizers fed one output token per step, then applied as its sampler applies them."""
    batch = _Batch([req])
    orchestrator = penaltylib.BatchedPenalizerOrchestrator(
        VOCAB,
        batch,
        {
            penaltylib.BatchedFrequencyPenalizer,
            penaltylib.BatchedMinNewTokensPenalizer,
            penaltylib.BatchedPresencePenalizer,
            penaltylib.BatchedRepetitionPenalizer,
        },
    )
    for token in history:
        orchestrator.cumulate_output_tokens(torch.tensor([token]))
    out = logits.clone().view(1, -1)
    additive = torch.zeros(1, VOCAB)
    orchestrator.accumulate_additive_penalties(additive)
    out.add_(additive)
    scaling = orchestrator.accumulate_scaling_penalties()
    if scaling is not None:
        apply_scaling_penalties(out, scaling)
    return out.view(-1)


CASES = [
    {"frequency_penalty": 0.7},
    {"presence_penalty": 1.1},
    {"repetition_penalty": 1.3},
    {"min_new_tokens": 6, "stop_token_ids": [5]},
    {"frequency_penalty": 0.3, "repetition_penalty": 1.2, "min_new_tokens": 5},
]


@pytest.mark.parametrize("params", CASES)
def test_every_node_is_penalized_as_plain_decoding_would_penalize_it(params):
    gen = torch.Generator().manual_seed(0)
    output = [7, 8, 7, 9]  # 4 tokens out: the root is 9
    tokens = np.array([[9, 7, 5, 7, EOS]])  # paths: [], [7], [5], [7, 7], [7, 7, EOS]
    paths = node_paths(TREE[None], tokens)
    req = _req(output, **params)
    logits = torch.randn(5, VOCAB, generator=gen) * 3
    got = logits.clone()
    apply_node_penalties(got, [req], paths)
    for i, path in enumerate(paths[0]):
        assert torch.equal(got[i], _plain(logits[i], req, output + path)), (i, path)


def test_requests_without_penalties_are_untouched():
    tokens = np.array([[9, 7, 5, 7, EOS]] * 2)
    paths = node_paths(np.stack([TREE, TREE]), tokens)
    reqs = [_req([1, 2]), _req([7, 9], frequency_penalty=0.5)]
    assert penalized(reqs) and not penalized(reqs[:1])
    logits = torch.randn(10, VOCAB)
    got = logits.clone()
    apply_node_penalties(got, reqs, paths)
    assert torch.equal(got[:5], logits[:5])
    assert not torch.equal(got[5:], logits[5:])
