"""The CPU stand-ins for the `sgl_kernel` ops (sglang_dart/cpu/ops.py), checked against naive Python loops."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang_dart.cpu.greedy_walk import first_argmax, greedy_walk, walks_on_host
from sglang_dart.cpu.ops import (
    PROVIDED_OPS,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    reconstruct_indices_from_tree_mask,
    verify_tree_greedy_cpu,
)
from sglang_dart.dart.trees import tree_links
from tests.support.tree_masks import ancestor_mask

# ---------------------------------------------------------------------------------------------------------
# req_to_token ranges


def _random_ranges(rng: random.Random, bs: int, max_reqs: int, pool_len: int, allow_empty: bool = True):
    req_pool_indices = rng.sample(range(max_reqs), bs)
    starts, ends = [], []
    for _ in range(bs):
        start = rng.randint(0, pool_len - 1)
        length = rng.randint(0 if allow_empty else 1, pool_len - start)
        if allow_empty and rng.random() < 0.25:
            length = 0
        starts.append(start)
        ends.append(start + length)
    return req_pool_indices, starts, ends


@pytest.mark.parametrize("offset_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("bs", [1, 2, 5, 8])
@pytest.mark.parametrize("seed", range(4))
def test_assign_req_to_token_pool_matches_loop(bs, seed, offset_dtype):
    rng = random.Random(1000 * bs + seed)
    max_reqs, pool_len = 8, 24
    req_pool_indices, starts, ends = _random_ranges(rng, bs, max_reqs, pool_len)
    total = sum(e - s for s, e in zip(starts, ends, strict=True))
    out_cache_loc = [rng.randint(0, 10_000) for _ in range(total + 3)]  # extra tail must be ignored
    table = torch.randint(-50, -1, (max_reqs, pool_len), dtype=torch.int32)

    expected = table.clone()
    k = 0
    for row, start, end in zip(req_pool_indices, starts, ends, strict=True):
        for col in range(start, end):
            expected[row, col] = out_cache_loc[k]
            k += 1

    assign_req_to_token_pool_cpu(
        torch.tensor(req_pool_indices, dtype=torch.int64),
        table,
        torch.tensor(starts, dtype=offset_dtype),
        torch.tensor(ends, dtype=offset_dtype),
        torch.tensor(out_cache_loc, dtype=torch.int64),
        pool_len,
    )
    assert table.dtype == torch.int32
    assert torch.equal(table, expected)


@pytest.mark.parametrize("offset_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("bs", [1, 2, 5, 8])
@pytest.mark.parametrize("seed", range(4))
def test_assign_extend_cache_locs_matches_loop(bs, seed, offset_dtype):
    rng = random.Random(2000 * bs + seed)
    max_reqs, pool_len = 8, 24
    req_pool_indices, starts, ends = _random_ranges(rng, bs, max_reqs, pool_len)
    table = torch.randint(0, 10_000, (max_reqs, pool_len), dtype=torch.int32)
    total = sum(e - s for s, e in zip(starts, ends, strict=True))
    sentinel = -7
    out = torch.full((total + 4,), sentinel, dtype=torch.int64)

    expected = [
        int(table[row, col])
        for row, start, end in zip(req_pool_indices, starts, ends, strict=True)
        for col in range(start, end)
    ] + [sentinel] * 4

    assign_extend_cache_locs_cpu(
        torch.tensor(req_pool_indices, dtype=torch.int64),
        table,
        torch.tensor(starts, dtype=offset_dtype),
        torch.tensor(ends, dtype=offset_dtype),
        out,
        pool_len,
    )
    assert out.tolist() == expected


def test_assign_ops_all_empty_ranges_are_noops():
    table = torch.arange(40, dtype=torch.int32).reshape(4, 10)
    before = table.clone()
    idx = torch.tensor([2, 0], dtype=torch.int64)
    start = torch.tensor([3, 7], dtype=torch.int64)
    out = torch.full((3,), -1, dtype=torch.int64)
    assign_req_to_token_pool_cpu(idx, table, start, start.clone(), torch.tensor([99, 98, 97]), 10)
    assert torch.equal(table, before)
    assign_extend_cache_locs_cpu(idx, table, start, start.clone(), out, 10)
    assert out.tolist() == [-1, -1, -1]


def test_assign_roundtrip():
    rng = random.Random(7)
    max_reqs, pool_len = 6, 16
    req_pool_indices, starts, ends = _random_ranges(rng, 6, max_reqs, pool_len, allow_empty=False)
    total = sum(e - s for s, e in zip(starts, ends, strict=True))
    locs = torch.randperm(1000, generator=torch.Generator().manual_seed(7))[:total].to(torch.int64)
    table = torch.zeros((max_reqs, pool_len), dtype=torch.int32)
    args = (
        torch.tensor(req_pool_indices),
        table,
        torch.tensor(starts),
        torch.tensor(ends),
    )
    assign_req_to_token_pool_cpu(*args, locs, pool_len)
    back = torch.zeros_like(locs)
    assign_extend_cache_locs_cpu(*args, back, pool_len)
    assert torch.equal(back, locs)


# ---------------------------------------------------------------------------------------------------------
# copy_all_layer_kv_cache_cpu


def _kv_buffers(num_slots: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn((num_slots, 2, 8), generator=g, dtype=torch.float32),
        torch.randn((num_slots, 3, 4), generator=g, dtype=torch.float32).to(torch.bfloat16),
        torch.randn((num_slots, 1, 5), generator=g, dtype=torch.float32).to(torch.float16),
        torch.randint(-100, 100, (num_slots, 2, 3), generator=g, dtype=torch.int64),
    ]


def _ptrs_and_strides(bufs):
    data_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64)
    return data_ptrs, strides


def _copy_and_check(bufs, tgt, src, loc_dtype=torch.int64):
    expected = [b.clone() for b in bufs]
    for e in expected:
        e[torch.tensor(tgt, dtype=torch.int64)] = e[torch.tensor(src, dtype=torch.int64)].clone()
    data_ptrs, strides = _ptrs_and_strides(bufs)
    copy_all_layer_kv_cache_cpu(
        data_ptrs, strides, torch.tensor(tgt, dtype=loc_dtype), torch.tensor(src, dtype=loc_dtype)
    )
    for b, e in zip(bufs, expected, strict=True):
        assert torch.equal(b, e)


@pytest.mark.parametrize("seed", range(6))
def test_copy_all_layer_kv_cache_random(seed):
    rng = random.Random(seed)
    num_slots = 32
    bufs = _kv_buffers(num_slots, seed)
    n = rng.randint(1, 12)
    tgt = rng.sample(range(num_slots), n)  # distinct targets
    src = [rng.randrange(num_slots) for _ in range(n)]  # sources may repeat and overlap targets
    _copy_and_check(bufs, tgt, src, loc_dtype=torch.int64 if seed % 2 else torch.int32)


@pytest.mark.parametrize(
    ("tgt", "src"),
    [
        ([2, 3, 4], [1, 2, 3]),  # shift right: a naive in-order copy would smear row 1
        ([1, 2, 3], [2, 3, 4]),  # shift left
        ([0, 5], [5, 0]),  # swap
        ([7], [7]),  # self copy
        ([3, 4], [3, 4]),  # every row already in place (a verify that accepted its first nodes)
        ([2, 3, 5], [2, 4, 5]),  # in place but one
        ([9, 8, 7, 6], [6, 7, 8, 9]),  # reversal
    ],
)
def test_copy_all_layer_kv_cache_overlapping(tgt, src):
    _copy_and_check(_kv_buffers(10, 123), tgt, src)


def test_copy_all_layer_kv_cache_leaves_other_rows_and_last_slot():
    bufs = _kv_buffers(6, 5)
    _copy_and_check(bufs, [5], [0])  # writes the very last row of each buffer
    _copy_and_check(bufs, [0], [5])


def test_copy_all_layer_kv_cache_empty_is_noop():
    bufs = _kv_buffers(4, 9)
    before = [b.clone() for b in bufs]
    data_ptrs, strides = _ptrs_and_strides(bufs)
    empty = torch.zeros((0,), dtype=torch.int64)
    copy_all_layer_kv_cache_cpu(data_ptrs, strides, empty, empty.clone())
    for b, e in zip(bufs, before, strict=True):
        assert torch.equal(b, e)


@pytest.mark.parametrize(("tgt", "src"), [([1, -1], [0, 2]), ([1, 2], [-3, 0])])
def test_copy_all_layer_kv_cache_negative_location_raises(tgt, src):
    bufs = _kv_buffers(4, 11)
    before = [b.clone() for b in bufs]
    data_ptrs, strides = _ptrs_and_strides(bufs)
    with pytest.raises(ValueError):
        copy_all_layer_kv_cache_cpu(data_ptrs, strides, torch.tensor(tgt), torch.tensor(src))
    for b, e in zip(bufs, before, strict=True):
        assert torch.equal(b, e)


# ---------------------------------------------------------------------------------------------------------
# Trees: reconstruct_indices_from_tree_mask and verify_tree_greedy_cpu


def _random_parents(rng: random.Random, d: int, shape: str = "random") -> list[int]:
    """parents[0] = -1 (root); every other node's parent has a smaller index."""
    if shape == "chain":
        return [-1] + list(range(d - 1))
    if shape == "star":
        return [-1] + [0] * (d - 1)
    return [-1] + [rng.randrange(i) for i in range(1, d)]


def _depth(parents: list[int], i: int) -> int:
    depth = 0
    while parents[i] != -1:
        i = parents[i]
        depth += 1
    return depth


def _children(parents: list[int], i: int) -> list[int]:
    return [k for k in range(len(parents)) if parents[k] == i]  # increasing index order


def _reconstruct(all_parents: list[list[int]], seq_lens: list[int]):
    bs, d = len(all_parents), len(all_parents[0])
    tree_mask = torch.cat([ancestor_mask(p).reshape(-1) for p in all_parents])
    positions = torch.full((bs * d,), -99, dtype=torch.int64)
    retrive_index = torch.full((bs, d), -99, dtype=torch.int64)
    retrive_next_token = torch.full((bs, d), -99, dtype=torch.int64)
    retrive_next_sibling = torch.full((bs, d), -99, dtype=torch.int64)
    reconstruct_indices_from_tree_mask(
        tree_mask,
        torch.tensor(seq_lens, dtype=torch.int64),
        positions,
        retrive_index,
        retrive_next_token,
        retrive_next_sibling,
        bs,
        d,
    )
    return positions, retrive_index, retrive_next_token, retrive_next_sibling


TREE_CASES = [
    (bs, d, shape, seed)
    for bs, d in [(1, 1), (1, 2), (1, 6), (3, 4), (4, 8), (2, 16)]
    for shape in ("random", "chain", "star")
    for seed in range(2)
]


@pytest.mark.parametrize(("bs", "d", "shape", "seed"), TREE_CASES)
def test_reconstruct_indices_from_tree_mask(bs, d, shape, seed):
    rng = random.Random(f"reconstruct-{bs}-{d}-{shape}-{seed}")
    all_parents = [_random_parents(rng, d, shape) for _ in range(bs)]
    seq_lens = [rng.randint(0, 50) for _ in range(bs)]
    positions, retrive_index, next_token, next_sibling = _reconstruct(all_parents, seq_lens)

    for t in (positions, retrive_index, next_token, next_sibling):
        assert t.dtype == torch.int64
    assert positions.shape == (bs * d,)
    assert retrive_index.shape == next_token.shape == next_sibling.shape == (bs, d)

    for b, parents in enumerate(all_parents):
        for i in range(d):
            assert positions[b * d + i] == seq_lens[b] + _depth(parents, i)
            assert retrive_index[b, i] == b * d + i
            kids = _children(parents, i)
            assert next_token[b, i] == (kids[0] if kids else -1)
            later_siblings = [k for k in range(i + 1, d) if i > 0 and parents[k] == parents[i]]
            assert next_sibling[b, i] == (later_siblings[0] if later_siblings else -1)


@pytest.mark.parametrize(("bs", "d", "shape", "seed"), TREE_CASES)
def test_tree_links_from_parents_are_the_ones_rebuilt_from_masks(bs, d, shape, seed):
    """DART's verify takes each node's first child and next sibling from the pruner's parents
    (`trees.tree_links`) instead of rebuilding them from the ancestor masks: the same links."""
    rng = random.Random(f"links-{bs}-{d}-{shape}-{seed}")
    all_parents = [_random_parents(rng, d, shape) for _ in range(bs)]
    _, _, next_token, next_sibling = _reconstruct(all_parents, [0] * bs)
    first_child, sibling = tree_links(np.asarray(all_parents, dtype=np.int32))
    assert torch.equal(torch.from_numpy(first_child), next_token)
    assert torch.equal(torch.from_numpy(sibling), next_sibling)


def test_reconstruct_indices_hand_written():
    # 0 -> {1, 2}, 1 -> {3, 4}, 2 -> {5}
    parents = [-1, 0, 0, 1, 1, 2]
    positions, retrive_index, next_token, next_sibling = _reconstruct([parents, parents], [10, 0])
    assert positions.tolist() == [10, 11, 11, 12, 12, 12, 0, 1, 1, 2, 2, 2]
    assert retrive_index.tolist() == [list(range(6)), list(range(6, 12))]
    assert next_token.tolist() == [[1, 3, 5, -1, -1, -1]] * 2
    assert next_sibling.tolist() == [[-1, 2, -1, 4, -1, -1]] * 2


def _reference_greedy(all_parents, candidates, target_predict, max_path):
    bs, d = candidates.shape
    accept_index = [[-1] * max_path for _ in range(bs)]
    accept_num = [0] * bs
    predicts = [0] * (bs * d)
    for b, parents in enumerate(all_parents):
        path = [0]
        while len(path) - 1 < max_path - 1:
            current = path[-1]
            want = int(target_predict[b, current])
            match = next((k for k in _children(parents, current) if int(candidates[b, k]) == want), None)
            if match is None:
                break
            path.append(match)
        for j, node in enumerate(path):
            accept_index[b][j] = b * d + node
            predicts[b * d + node] = int(target_predict[b, node])
        accept_num[b] = len(path) - 1
    return predicts, accept_index, accept_num


def _run_greedy(all_parents, candidates, target_predict, max_path):
    bs, d = candidates.shape
    _, retrive_index, next_token, next_sibling = _reconstruct(all_parents, [5] * bs)
    predicts = torch.zeros((bs * d,), dtype=torch.int32)
    accept_index = torch.full((bs, max_path), -1, dtype=torch.int32)
    accept_token_num = torch.zeros((bs,), dtype=torch.int32)
    verify_tree_greedy_cpu(
        predicts,
        accept_index,
        accept_token_num,
        candidates,
        retrive_index,
        next_token,
        next_sibling,
        target_predict,
    )
    assert predicts.dtype == accept_index.dtype == accept_token_num.dtype == torch.int32
    return predicts.tolist(), accept_index.tolist(), accept_token_num.tolist()


@pytest.mark.parametrize("steered", [False, True])
@pytest.mark.parametrize("max_path", [1, 2, 4, 17])
@pytest.mark.parametrize(("bs", "d", "shape", "seed"), TREE_CASES)
def test_verify_tree_greedy_matches_reference(bs, d, shape, seed, max_path, steered):
    rng = random.Random(f"greedy-{bs}-{d}-{shape}-{seed}-{max_path}-{steered}")
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    all_parents = [_random_parents(rng, d, shape) for _ in range(bs)]
    vocab = 3 if steered else 4  # small vocabularies: matches, and equal tokens among siblings, are common
    candidates = torch.randint(0, vocab, (bs, d), generator=g, dtype=torch.int64)
    target_predict = torch.randint(0, vocab, (bs, d), generator=g, dtype=torch.int64)
    if steered:  # mostly make the target agree with some child, so that long paths get accepted
        for b, parents in enumerate(all_parents):
            for i in range(d):
                kids = _children(parents, i)
                if kids and rng.random() < 0.8:
                    target_predict[b, i] = candidates[b, rng.choice(kids)]
    got = _run_greedy(all_parents, candidates, target_predict, max_path)
    assert got == _reference_greedy(all_parents, candidates, target_predict, max_path)


@pytest.mark.parametrize("max_path", [1, 2, 4, 17])
@pytest.mark.parametrize(("bs", "d", "shape", "seed"), TREE_CASES)
def test_the_host_walk_equals_argmax_then_the_greedy_op(bs, d, shape, seed, max_path):
    """DART's CPU verify (`greedy_walk`) takes the argmax only of the rows it visits: its paths, bonus
    tokens and predictions equal a full `torch.argmax` followed by the greedy op. Logits drawn from
    three values, so rows tie at their maximum and the first index must win, as in torch.argmax."""
    rng = random.Random(f"walk-{bs}-{d}-{shape}-{seed}-{max_path}")
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    all_parents = [_random_parents(rng, d, shape) for _ in range(bs)]
    vocab = 5
    candidates = torch.randint(0, vocab, (bs, d), generator=g, dtype=torch.int64)
    logits = torch.randint(0, 3, (bs * d, vocab), generator=g).float()
    for b, parents in enumerate(all_parents):  # mostly steer the target to some child: long paths
        for i in range(d):
            kids = _children(parents, i)
            if kids and rng.random() < 0.8:
                logits[b * d + i, int(candidates[b, rng.choice(kids)])] = 3.0
    expected = _run_greedy(all_parents, candidates, torch.argmax(logits, -1).view(bs, d), max_path)
    _, retrive_index, next_token, next_sibling = _reconstruct(all_parents, [5] * bs)
    predict, accept_lens, accept_index = greedy_walk(
        logits, candidates, retrive_index, next_token, next_sibling, max_path
    )
    assert predict.dtype == accept_lens.dtype == accept_index.dtype == torch.int32
    assert (predict.tolist(), accept_index.tolist(), (accept_lens - 1).tolist()) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 64, 65, 1000, 49152])
@pytest.mark.parametrize("threads", [1, 2])
def test_first_argmax_is_torch_argmax(dtype, width, threads):
    """The walk's argmax is torch.argmax's index on rows with many ties at the maximum (the first must
    win, wherever the vector lanes split the row), infinities, NaNs (which count as the maximum) and
    signed zeros."""
    g = torch.Generator().manual_seed(width * 7 + threads)
    rows = [
        torch.randint(0, 3, (12, width), generator=g).to(dtype),  # ties
        torch.randn(12, width, generator=g).to(dtype),
    ]
    inf = rows[0].clone()
    inf[torch.rand(inf.shape, generator=g) < 0.05] = float("inf")
    nan = rows[1].clone()
    nan[torch.rand(nan.shape, generator=g) < 0.01] = float("nan")
    nan[3, width // 2] = float("nan")  # at least one
    zeros = torch.where(torch.rand(12, width, generator=g) < 0.5, 0.0, -0.0).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for x in (*rows, inf, nan, zeros, -torch.full((3, width), float("inf"), dtype=dtype)):
            assert torch.equal(first_argmax(x), torch.argmax(x, dim=-1))
    finally:
        torch.set_num_threads(previous)


def test_the_host_walk_of_no_requests_is_empty():
    none = torch.zeros((0, 4), dtype=torch.int64)
    predict, accept_lens, accept_index = greedy_walk(torch.zeros(0, 10), none, none, none, none, 3)
    assert predict.shape == accept_lens.shape == (0,) and accept_index.shape == (0, 3)


def test_the_host_walk_runs_on_the_cpu_where_eagle_sample_would_add_nothing():
    plain = SimpleNamespace(acc_additive_penalties=None, acc_scaling_penalties=None, logit_bias=None)
    assert walks_on_host("cpu", plain)
    assert not walks_on_host("cuda", plain)  # there the argmax is cheap and the walk would sync
    for field in ("acc_additive_penalties", "acc_scaling_penalties", "logit_bias"):
        assert not walks_on_host("cpu", SimpleNamespace(**{**vars(plain), field: torch.zeros(1, 4)}))


def test_verify_tree_greedy_accepts_long_paths():
    # Candidates chosen so that the whole chain matches: the walk must stop only on the depth budget.
    d = 6
    parents = [-1, 0, 1, 2, 3, 4]
    target = torch.tensor([[11, 12, 13, 14, 15, 16]])
    candidates = torch.tensor([[0, 11, 12, 13, 14, 15]])
    predicts, accept_index, accept_num = _run_greedy([parents], candidates, target, max_path=4)
    assert accept_index == [[0, 1, 2, 3]]
    assert accept_num == [3]
    assert predicts == [11, 12, 13, 14, 0, 0]
    predicts, accept_index, accept_num = _run_greedy([parents], candidates, target, max_path=d + 1)
    assert accept_index == [[0, 1, 2, 3, 4, 5, -1]]
    assert accept_num == [5]
    assert predicts == [11, 12, 13, 14, 15, 16]


def test_verify_tree_greedy_hand_written():
    # Tree (both requests): 0 -> {1, 2}, 1 -> {3}.
    parents = [-1, 0, 0, 1]
    candidates = torch.tensor([[9, 5, 7, 6], [0, 5, 1, 6]])
    target = torch.tensor([[7, 2, 3, 8], [5, 6, 0, 4]])
    # Request 0: root wants 7 -> node 2 (node 1 has 5); node 2 has no children -> stop; bonus = 3.
    # Request 1: root wants 5 -> node 1; node 1 wants 6 -> node 3; node 3 is a leaf; bonus = 4.
    predicts, accept_index, accept_num = _run_greedy([parents, parents], candidates, target, max_path=4)
    assert accept_index == [[0, 2, -1, -1], [4, 5, 7, -1]]
    assert accept_num == [1, 2]
    assert predicts == [7, 0, 3, 0, 5, 6, 0, 4]

    # Depth budget of one draft: request 1 stops at node 1 and its bonus is node 1's target.
    predicts, accept_index, accept_num = _run_greedy([parents, parents], candidates, target, max_path=2)
    assert accept_index == [[0, 2], [4, 5]]
    assert accept_num == [1, 1]
    assert predicts == [7, 0, 3, 0, 5, 6, 0, 0]

    # Nothing matches at all: only the root, and its target is the bonus token.
    none_match = torch.tensor([[1, 2, 2, 2]])
    predicts, accept_index, accept_num = _run_greedy([parents], none_match, torch.tensor([[3, 3, 3, 3]]), 3)
    assert accept_index == [[0, -1, -1]]
    assert accept_num == [0]
    assert predicts == [3, 0, 0, 0]


# ---------------------------------------------------------------------------------------------------------
# fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu


def test_fill_accept_out_cache_loc():
    accept_index = torch.tensor([[0, 2, -1], [3, 4, 5], [6, -1, -1]], dtype=torch.int32)
    out_cache_loc = torch.arange(9, dtype=torch.int64) * 10 + 100
    accept_out = torch.full((9,), -5, dtype=torch.int64)
    fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out)
    assert accept_out.tolist() == [100, 120, 130, 140, 150, 160, -5, -5, -5]


def test_fill_accept_out_cache_loc_all_rejected_and_dtype():
    accept_index = torch.tensor([[-1, -1], [-1, -1]], dtype=torch.int32)
    accept_out = torch.zeros((4,), dtype=torch.int64)
    fill_accept_out_cache_loc_cpu(accept_index, torch.arange(4, dtype=torch.int64) + 1, accept_out)
    assert accept_out.tolist() == [0, 0, 0, 0]

    accept_index = torch.tensor([[1, 0, -1]], dtype=torch.int64)
    accept_out = torch.zeros((3,), dtype=torch.int32)
    fill_accept_out_cache_loc_cpu(accept_index, torch.tensor([7, 8], dtype=torch.int64), accept_out)
    assert accept_out.dtype == torch.int32
    assert accept_out.tolist() == [8, 7, 0]


def test_fill_bonus_tokens():
    accept_stride = 4
    accept_tokens = torch.tensor(
        [[11, 12, 13, 14], [21, 0, 0, 0], [31, 32, 0, 0]], dtype=torch.int64
    ).reshape(-1)
    accept_lens = torch.tensor([4, 1, 2], dtype=torch.int32)
    bonus_tokens = torch.empty_like(accept_lens, dtype=torch.int32)
    fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride)
    assert bonus_tokens.dtype == torch.int32
    assert bonus_tokens.tolist() == [14, 21, 32]


def test_fill_bonus_tokens_2d_input():
    accept_tokens = torch.tensor([[5, 6, 7], [8, 9, 10]], dtype=torch.int32)
    bonus_tokens = torch.zeros((2,), dtype=torch.int64)
    fill_bonus_tokens_cpu(accept_tokens, torch.tensor([2, 3]), bonus_tokens, 3)
    assert bonus_tokens.tolist() == [6, 10]


def test_provided_ops_lists_every_op():
    expected = {
        "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
        "assign_extend_cache_locs_cpu": assign_extend_cache_locs_cpu,
        "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
        "reconstruct_indices_from_tree_mask": reconstruct_indices_from_tree_mask,
        "verify_tree_greedy_cpu": verify_tree_greedy_cpu,
        "fill_accept_out_cache_loc_cpu": fill_accept_out_cache_loc_cpu,
        "fill_bonus_tokens_cpu": fill_bonus_tokens_cpu,
    }
    for name, fn in expected.items():
        assert PROVIDED_OPS[name] is fn
