"""Tree-node sampling helpers: node paths and custom logit processors run per node."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import numpy as np
import torch

from sglang_dart.dart.sampling import apply_custom_processors, needs_pinning, node_paths, sample_tree_nodes

# One request's tree: root 0; nodes 1 and 2 children of the root; node 3 a child of 1 (ancestors first).
TREE = np.array(
    [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ],
    dtype=bool,
)
VOCAB = 16


class BanHistory:
    """Bans every token the request has produced so far, as a history-reading processor would."""

    def __call__(self, logits: torch.Tensor, params: list[dict]) -> torch.Tensor:
        assert len(params) == logits.shape[0]  # one parameter set per row it is given
        for row, p in enumerate(params):
            req = p["__req__"]
            history = req.origin_input_ids + req.output_ids  # as SGLang's no-repeat processor reads it
            logits[row, list(history)] = float("-inf")
        return logits


def _batch(reqs: list, chosen: list[bool], greedy: bool = True) -> SimpleNamespace:
    bs = len(reqs)
    return SimpleNamespace(
        is_all_greedy=greedy,
        has_custom_logit_processor=True,
        custom_logit_processor={"ban": (BanHistory(), torch.tensor(chosen))},
        custom_params=[{"__req__": r} for r in reqs],
        acc_additive_penalties=None,
        acc_scaling_penalties=None,
        logit_bias=None,
        top_ks=torch.ones(bs, dtype=torch.int32),
        top_ps=torch.ones(bs),
        min_ps=torch.zeros(bs),
        need_min_p_sampling=False,
        temperatures=torch.ones(bs, 1),
    )


def test_node_paths_follow_the_ancestors():
    tokens = np.array([[10, 11, 12, 13]])
    assert node_paths(TREE[None], tokens) == [[[], [11], [12], [11, 13]]]


def test_each_node_row_sees_its_own_path_as_history():
    # SGLang keeps output ids in an array("q"), which processors concatenate with the prompt's
    reqs = [
        SimpleNamespace(origin_input_ids=array("q", [15]), output_ids=array("q", [5]), rid="a"),
        SimpleNamespace(origin_input_ids=[15], output_ids=[6], rid="b"),
    ]
    tokens = np.array([[5, 1, 2, 3], [6, 7, 8, 9]])
    paths = node_paths(np.stack([TREE, TREE]), tokens)
    logits = torch.zeros(8, VOCAB)
    apply_custom_processors(_batch(reqs, [True, False]), logits, paths)
    banned = [set(torch.nonzero(torch.isinf(row)).flatten().tolist()) for row in logits]
    assert banned[:4] == [{15, 5}, {15, 5, 1}, {15, 5, 2}, {15, 5, 1, 3}]
    assert banned[4:] == [set()] * 4  # the request without the processor is untouched
    assert list(reqs[0].output_ids) == [5] and reqs[0].rid == "a"  # the request itself is not changed


def test_greedy_samples_respect_the_processor_at_every_node():
    reqs = [SimpleNamespace(origin_input_ids=[], output_ids=[0])]
    tokens = np.array([[0, 1, 2, 3]])
    logits = torch.zeros(4, VOCAB)
    logits[:, 1] = 3.0  # the unprocessed argmax everywhere
    logits[:, 2] = 2.0
    batch = _batch(reqs, [True])
    assert needs_pinning(batch)
    samples = sample_tree_nodes(batch, logits, 4, node_paths(TREE[None], tokens))
    # Node 1's and node 3's paths contain token 1, so their best allowed token is 2.
    assert samples.tolist() == [1, 2, 1, 2]
