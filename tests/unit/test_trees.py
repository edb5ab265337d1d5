"""`Trees.size_for_step`: when a step verifies trees and when the root alone."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from sglang_dart.dart.phase_timer import PhaseTimer
from sglang_dart.dart.progress import RequestProgress
from sglang_dart.dart.trees import DraftCandidates, Trees

CONTEXT = 2048


def _trees_with_requests(committed: list[int], context_len: int | None = CONTEXT) -> tuple[Trees, object]:
    """Trees whose requests all have current candidates, each at the given committed length; the drafter,
    store and pruner are not read by `size_for_step`."""
    progress = RequestProgress()
    trees = Trees(None, None, None, [], 64, 4, "cpu", progress, PhaseTimer(enabled=False), 0, context_len)
    reqs = []
    for i, length in enumerate(committed):
        req = SimpleNamespace(rid=f"r{i}", origin_input_ids=[5] * length, output_ids=[7])
        progress.start(req, length, [5] * length + [7])
        tokens = np.zeros((7, 4), dtype=np.int64)
        trees.candidates[req.rid] = DraftCandidates(tokens, tokens.astype(np.float32), progress.of(req))
        reqs.append(req)
    return trees, SimpleNamespace(reqs=reqs)


def test_a_tree_that_could_reach_past_the_context_gives_way_to_the_root_alone():
    """A tree of N nodes reaches at most N - 1 positions past its root; where that could pass the target's
    context (its RoPE table's end) the whole batch verifies its roots alone, and only there."""
    trees, batch = _trees_with_requests([100, CONTEXT - 16])
    assert trees.size_for_step(batch, 16) == 16  # the deepest node lands on the context's last position
    assert trees.size_for_step(batch, 8) == 8
    trees, batch = _trees_with_requests([100, CONTEXT - 15])
    assert trees.size_for_step(batch, 16) == 1
    assert trees.size_for_step(batch, 8) == 8  # a smaller tree still fits
    trees, batch = _trees_with_requests([CONTEXT - 2])
    assert trees.size_for_step(batch, 2) == 2
    assert trees.size_for_step(batch, 3) == 1
    trees, batch = _trees_with_requests([CONTEXT - 2], context_len=None)  # no limit known: as planned
    assert trees.size_for_step(batch, 16) == 16


def test_a_request_without_current_candidates_gives_the_root_alone():
    trees, batch = _trees_with_requests([100, 200])
    assert trees.size_for_step(batch, 8) == 8
    del trees.candidates["r1"]
    assert trees.size_for_step(batch, 8) == 1
    assert trees.size_for_step(batch, 1) == 1
