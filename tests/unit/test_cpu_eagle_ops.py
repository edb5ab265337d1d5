"""The CPU stand-ins for SGLang's EAGLE ops (sglang_dart/cpu/eagle_ops.py), checked against plain Python
loops that walk the tree one node at a time, on draft trees built the way SGLang's EAGLE worker builds
them (cumulative scores, the best D - 1 nodes) and on arbitrary selections (orphaned nodes)."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_dart.cpu.eagle_ops import (
    FULL_MASK,
    QLEN_ONLY,
    assign_draft_cache_locs_contiguous_cpu,
    build_tree_kernel_efficient_cpu,
)
from sglang_dart.cpu.ops import PROVIDED_OPS


def test_ops_are_served_by_the_stand_in():
    assert PROVIDED_OPS["build_tree_kernel_efficient_cpu"] is build_tree_kernel_efficient_cpu
    assert PROVIDED_OPS["assign_draft_cache_locs_contiguous_cpu"] is assign_draft_cache_locs_contiguous_cpu


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("topk,steps", [(1, 1), (1, 3), (2, 3), (4, 2)])
def test_assign_draft_cache_locs_matches_loop(seed, topk, steps):
    rng = random.Random(seed)
    bs, max_reqs, pool_len = rng.randint(1, 5), 8, 40
    table = torch.randint(0, 10_000, (max_reqs, pool_len), dtype=torch.int32)
    pool_idx = rng.sample(range(max_reqs), bs)
    n = topk * steps
    seq_lens = [rng.randint(0, pool_len - n) for _ in range(bs)]
    expected = []
    for row, start in zip(pool_idx, seq_lens, strict=True):
        expected += [int(table[row, start + j]) for j in range(n)]
    out = torch.full((bs * n + 2,), -7, dtype=torch.int64)  # the tail must stay untouched
    assign_draft_cache_locs_contiguous_cpu(
        torch.tensor(pool_idx), table, torch.tensor(seq_lens), out, pool_len, topk, steps
    )
    assert out[: bs * n].tolist() == expected
    assert out[bs * n :].tolist() == [-7, -7]


# ---------------------------------------------------------------------------------------------------------
# Tree building


def eagle_tree(rng: random.Random, topk: int, steps: int, num_draft: int, consistent: bool):
    """(parent_list, top_scores_index) of one request as SGLang's EAGLE draft loop lays them out: step 0
    scores the root's topk children (score indices 0..topk-1); step i >= 1 expands the topk nodes chosen
    at step i - 1 (recorded in parents_list[i - 1]), child c of slot s getting index
    topk + (i-1)*topk^2 + s*topk + c. `consistent`: scores are cumulative products, so every selected
    node's parent is selected too (what SGLang produces); otherwise any D - 1 nodes."""
    scores = [rng.random() for _ in range(topk)]
    parents = [list(range(-1, topk))]
    chosen = list(range(topk))
    for i in range(1, steps):
        base = topk + (i - 1) * topk * topk
        for s in range(topk):
            scores += [scores[chosen[s]] * rng.random() for _ in range(topk)]
        step_ids = list(range(base, base + topk * topk))
        chosen = sorted(step_ids, key=lambda x: -scores[x])[:topk]
        parents.append(chosen)
    parent_list = [x for p in parents[:-1] for x in p]
    if consistent:
        top = sorted(range(len(scores)), key=lambda x: -scores[x])[: num_draft - 1]
    else:
        top = rng.sample(range(len(scores)), num_draft - 1)
    return parent_list, sorted(top)


def reference_tree(parent_list, selected, seq_len, topk, depth, d):
    """Node by node: parents, links (children chained in increasing order), ancestor rows, positions."""

    def parent_of(node: int) -> int:  # tree position of the parent; 0 the root; -1 not selected
        score_parent = selected[node - 1] // topk
        if score_parent == 0:
            return 0
        wanted = parent_list[score_parent]
        for pp, sel in enumerate(selected):
            if sel == wanted:
                return pp + 1
        return -1

    first_child, sibling = [-1] * d, [-1] * d
    for node in range(d - 1, 0, -1):
        p = parent_of(node)
        if p >= 0:
            sibling[node] = first_child[p]
            first_child[p] = node
    mask = [[False] * d for _ in range(d)]
    positions = [seq_len] * d
    for node in range(d):
        mask[node][0] = True
        cur, depth_here = node, 0
        for _ in range(depth):
            if cur <= 0:
                break
            mask[node][cur] = True
            depth_here += 1
            cur = parent_of(cur)
        positions[node] = seq_len + depth_here
    return first_child, sibling, mask, positions


@pytest.mark.parametrize("mode", [QLEN_ONLY, FULL_MASK])
@pytest.mark.parametrize("consistent", [True, False])
@pytest.mark.parametrize("topk,steps,num_draft", [(1, 3, 4), (1, 1, 2), (2, 3, 6), (4, 3, 8), (3, 4, 10)])
@pytest.mark.parametrize("seed", range(4))
def test_build_tree_matches_loop(mode, consistent, topk, steps, num_draft, seed):
    rng = random.Random(hash((mode, consistent, topk, steps, num_draft, seed)) & 0xFFFF)
    bs = rng.randint(1, 4)
    trees = [eagle_tree(rng, topk, steps, num_draft, consistent or topk == 1) for _ in range(bs)]
    seq_lens = [rng.randint(1, 9) for _ in range(bs)]
    d = num_draft
    parent_list = torch.tensor([t[0] for t in trees], dtype=torch.int64).reshape(bs, -1)
    selected = torch.tensor([t[1] for t in trees], dtype=torch.int64).reshape(bs, d - 1)
    if mode == QLEN_ONLY:
        tree_mask = torch.full((bs * d * d,), True)
    else:
        tree_mask = torch.full((sum(seq_lens) * d + bs * d * d,), True)
        prefix_marker = torch.rand(tree_mask.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
        tree_mask = prefix_marker.clone()  # prefix columns must keep what the caller put there
    before = tree_mask.clone()
    positions = torch.empty(bs * d, dtype=torch.int64)
    retrieve = torch.full((3, bs, d), -1, dtype=torch.int64)
    build_tree_kernel_efficient_cpu(
        parent_list,
        selected,
        torch.tensor(seq_lens),
        tree_mask,
        positions,
        retrieve[0],
        retrieve[1],
        retrieve[2],
        topk,
        steps,
        d,
        mode,
    )
    offset = 0
    for b in range(bs):
        first_child, sibling, mask, pos = reference_tree(
            trees[b][0], trees[b][1], seq_lens[b], topk, steps, d
        )
        assert retrieve[0, b].tolist() == [b * d + i for i in range(d)]
        assert retrieve[1, b].tolist() == first_child
        assert retrieve[2, b].tolist() == sibling
        assert positions[b * d : (b + 1) * d].tolist() == pos
        for i in range(d):
            if mode == QLEN_ONLY:
                row = tree_mask[b * d * d + i * d : b * d * d + (i + 1) * d]
                assert row.tolist() == mask[i]
            else:
                width = seq_lens[b] + d
                start = offset + i * width
                assert (
                    tree_mask[start : start + seq_lens[b]].tolist()
                    == before[start : start + seq_lens[b]].tolist()
                )
                assert tree_mask[start + seq_lens[b] : start + width].tolist() == mask[i]
        offset += d * (seq_lens[b] + d)


def test_build_tree_chain_by_hand():
    """topk 1, 3 steps (SGLang's fixed chain buffers): parents [-1, 0, 1], scores [0, 1, 2]."""
    tree_mask = torch.full((16,), True)
    positions = torch.empty(4, dtype=torch.int64)
    retrieve = torch.full((3, 1, 4), -1, dtype=torch.int64)
    build_tree_kernel_efficient_cpu(
        torch.tensor([[-1, 0, 1]]),
        torch.tensor([[0, 1, 2]]),
        torch.tensor([5]),
        tree_mask,
        positions,
        *retrieve,
        1,
        3,
        4,
        QLEN_ONLY,
    )
    assert positions.tolist() == [5, 6, 7, 8]
    assert retrieve[1, 0].tolist() == [1, 2, 3, -1]
    assert retrieve[2, 0].tolist() == [-1, -1, -1, -1]
    assert tree_mask.view(4, 4).tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
        [True, True, True, True],
    ]


def test_build_tree_refuses_bit_packed_masks():
    with pytest.raises(NotImplementedError):
        build_tree_kernel_efficient_cpu(
            torch.tensor([[-1, 0]]),
            torch.tensor([[0]]),
            torch.tensor([3]),
            torch.zeros(2, dtype=torch.uint8),
            torch.empty(2, dtype=torch.int64),
            *torch.full((3, 1, 2), -1, dtype=torch.int64),
            1,
            1,
            2,
            2,
        )
