"""Batched masked attention over the paged KV pool (sglang_dart/attention/tree_attention.py), checked
request by request against an explicit float64 softmax(q·kᵀ·scale + mask)·v."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sglang_dart.attention import tree_attention
from sglang_dart.attention.tree_attention import attend, make_plan
from tests.support.tree_masks import random_tree_mask

ATOL = RTOL = 1e-5
MAX_REQS = 8


class Case:
    """A KV pool, a batch of requests (prefix in the pool, new tokens in q/k_new/v_new) and per-request
    [q_len, prefix_len + q_len] visibility masks for the reference."""

    def __init__(self, prefix_lens, query_lens, seed, heads=4, kv_heads=2, head_dim=8, v_dim=None):
        self.rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        self.prefix_lens = list(prefix_lens)
        self.query_lens = list(query_lens)
        bs = len(prefix_lens)
        v_dim = head_dim if v_dim is None else v_dim
        max_len = max(p + q for p, q in zip(prefix_lens, query_lens, strict=True)) + 3
        num_slots = MAX_REQS * max_len + 5
        self.k_cache = torch.randn((num_slots, kv_heads, head_dim), generator=g)
        self.v_cache = torch.randn((num_slots, kv_heads, v_dim), generator=g)
        # Every request row holds distinct slots (all rows are disjoint, in random order).
        slots = torch.randperm(num_slots, generator=g)[: MAX_REQS * max_len]
        self.req_to_token = slots.reshape(MAX_REQS, max_len).to(torch.int32)
        self.req_pool_indices = torch.tensor(self.rng.sample(range(MAX_REQS), bs), dtype=torch.int64)
        total = sum(query_lens)
        self.q = torch.randn((total, heads, head_dim), generator=g)
        self.k_new = torch.randn((total, kv_heads, head_dim), generator=g)
        self.v_new = torch.randn((total, kv_heads, v_dim), generator=g)
        self.scaling = 1.0 / math.sqrt(head_dim)
        self.masks = [self.causal_mask(p, q) for p, q in zip(prefix_lens, query_lens, strict=True)]

    @staticmethod
    def causal_mask(prefix_len, q_len):
        new = torch.ones((q_len, q_len), dtype=torch.bool).tril()
        return torch.cat([torch.ones((q_len, prefix_len), dtype=torch.bool), new], dim=1)

    def use_random_trees(self):
        """Replace the causal masks by random tree ancestor masks; returns (full layout, new-only layout)."""
        full_blocks, new_blocks = [], []
        self.masks = []
        for p, q in zip(self.prefix_lens, self.query_lens, strict=True):
            tree = random_tree_mask(self.rng, q)
            full = torch.cat([torch.ones((q, p), dtype=torch.bool), tree], dim=1)
            self.masks.append(full)
            full_blocks.append(full.reshape(-1))
            new_blocks.append(tree.reshape(-1))
        return torch.cat(full_blocks), torch.cat(new_blocks)

    def plan(self, tree_mask=None):
        return make_plan(
            self.req_to_token,
            self.req_pool_indices,
            torch.tensor(self.prefix_lens, dtype=torch.int64),
            torch.tensor(self.query_lens, dtype=torch.int32),
            tree_mask,
        )

    def run(self, tree_mask=None, dtype=None, **kwargs):
        cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
        return attend(
            self.plan(tree_mask),
            cast(self.q),
            cast(self.k_new),
            cast(self.v_new),
            cast(self.k_cache),
            cast(self.v_cache),
            self.scaling,
            **kwargs,
        )

    def run_from_pool(self, tree_mask=None, dtype=None, **kwargs):
        """As run, but with the new tokens' K/V first written to their pool slots (positions p.. of each
        request's row, as SGLang's out_cache_loc gives them) and attend reading every key from the pool."""
        cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
        rows = [
            self.req_to_token[self.req_pool_indices[r], p : p + n].to(torch.int64)
            for r, (p, n) in enumerate(zip(self.prefix_lens, self.query_lens, strict=True))
        ]
        new_loc = torch.cat(rows)
        k_cache, v_cache = cast(self.k_cache).clone(), cast(self.v_cache).clone()
        k_cache[new_loc], v_cache[new_loc] = cast(self.k_new), cast(self.v_new)
        plan = make_plan(
            self.req_to_token,
            self.req_pool_indices,
            torch.tensor(self.prefix_lens, dtype=torch.int64),
            torch.tensor(self.query_lens, dtype=torch.int32),
            tree_mask,
            new_loc.to(torch.int32),
        )
        return attend(plan, cast(self.q), None, None, k_cache, v_cache, self.scaling, **kwargs)

    def reference(self, logit_cap=0.0, sliding_window=-1, dtype=None):
        """Per request and query head: explicit float64 attention over [prefix from the pool | new tokens]."""
        cast = (lambda t: t.to(dtype).double()) if dtype is not None else (lambda t: t.double())
        q, k_new, v_new = cast(self.q), cast(self.k_new), cast(self.v_new)
        k_cache, v_cache = cast(self.k_cache), cast(self.v_cache)
        heads, kv_heads = q.shape[1], k_new.shape[1]
        group = heads // kv_heads
        out = torch.zeros((q.shape[0], heads, v_new.shape[-1]), dtype=torch.float64)
        start = 0
        for r, (p, n) in enumerate(zip(self.prefix_lens, self.query_lens, strict=True)):
            slots = self.req_to_token[self.req_pool_indices[r], :p].to(torch.int64)
            keys = torch.cat([k_cache[slots], k_new[start : start + n]])  # [p + n, Hkv, D]
            values = torch.cat([v_cache[slots], v_new[start : start + n]])
            mask = self.masks[r].clone()
            if sliding_window >= 0:
                query_pos = torch.arange(n).unsqueeze(1) + p
                key_pos = torch.arange(p + n).unsqueeze(0)
                mask &= key_pos >= query_pos - sliding_window
            for h in range(heads):
                kv = h // group
                scores = q[start : start + n, h] @ keys[:, kv].T * self.scaling
                if logit_cap > 0:
                    scores = logit_cap * torch.tanh(scores / logit_cap)
                scores = scores.masked_fill(~mask, float("-inf"))
                out[start : start + n, h] = torch.softmax(scores, dim=-1) @ values[:, kv]
            start += n
        return out


def assert_matches(out, expected, atol=ATOL, rtol=RTOL):
    assert out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------------------
# extend / decode (causal among the new tokens)

EXTEND_CASES = [
    ([0], [1]),
    ([0], [7]),
    ([5], [3]),
    ([0, 4, 9], [3, 1, 6]),
    ([12, 0, 3, 7, 1], [2, 5, 1, 4, 8]),
    ([0, 0], [4, 2]),
]


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize(("prefix_lens", "query_lens"), EXTEND_CASES)
def test_extend_causal(prefix_lens, query_lens, heads, kv_heads):
    case = Case(
        prefix_lens, query_lens, seed=sum(prefix_lens) * 31 + len(query_lens), heads=heads, kv_heads=kv_heads
    )
    out = case.run()
    assert out.dtype == torch.float32
    assert_matches(out, case.reference())


def test_extend_value_dim_differs_from_key_dim():
    case = Case([3, 0, 6], [2, 4, 1], seed=3, heads=4, kv_heads=2, head_dim=8, v_dim=5)
    out = case.run()
    assert out.shape == (7, 4, 5)
    assert_matches(out, case.reference())


@pytest.mark.parametrize("prefix_lens", [[0], [9], [1, 5, 17, 2], [30, 0, 4]])
def test_decode(prefix_lens):
    case = Case(prefix_lens, [1] * len(prefix_lens), seed=len(prefix_lens) + sum(prefix_lens))
    assert_matches(case.run(), case.reference())


def test_decode_matches_last_extend_row():
    # The last token of an extend, recomputed as a decode step once the earlier new tokens are in the pool.
    case = Case([4, 2], [5, 3], seed=21)
    extend_out = case.run()
    last_rows = [4, 7]
    decode = Case([4 + 5 - 1, 2 + 3 - 1], [1, 1], seed=22)
    decode.req_to_token, decode.req_pool_indices = case.req_to_token, case.req_pool_indices
    decode.k_cache, decode.v_cache = case.k_cache.clone(), case.v_cache.clone()
    decode.q, decode.k_new, decode.v_new = case.q[last_rows], case.k_new[last_rows], case.v_new[last_rows]
    start = 0
    for r, (p, n) in enumerate(zip(case.prefix_lens, case.query_lens, strict=True)):
        for j in range(n - 1):
            slot = int(case.req_to_token[case.req_pool_indices[r], p + j])
            decode.k_cache[slot], decode.v_cache[slot] = case.k_new[start + j], case.v_new[start + j]
        start += n
    out = decode.run()
    assert_matches(out, decode.reference())
    torch.testing.assert_close(out, extend_out[last_rows], atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------------------------------------------
# target verify with a tree mask

TREE_CASES = [
    ([6], [4]),
    ([0, 3], [4, 4]),
    ([0, 0], [3, 5]),  # no prefix at all: both layouts coincide
    ([5, 11, 2], [4, 4, 4]),
    ([7, 1, 3, 9], [1, 5, 3, 8]),  # ragged query lengths
    ([20, 4], [8, 6]),
]


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (2, 2)])
@pytest.mark.parametrize(("prefix_lens", "query_lens"), TREE_CASES)
def test_tree_verify_full_layout(prefix_lens, query_lens, heads, kv_heads):
    case = Case(
        prefix_lens, query_lens, seed=100 + sum(prefix_lens) + 7 * heads, heads=heads, kv_heads=kv_heads
    )
    full, _ = case.use_random_trees()
    assert full.numel() == sum(q * (p + q) for p, q in zip(prefix_lens, query_lens, strict=True))
    out = case.run(full)
    assert out.dtype == torch.float32
    assert_matches(out, case.reference())


@pytest.mark.parametrize(("prefix_lens", "query_lens"), [c for c in TREE_CASES if sum(c[0]) > 0])
def test_tree_verify_new_tokens_only_layout_equals_full(prefix_lens, query_lens):
    case = Case(prefix_lens, query_lens, seed=200 + sum(prefix_lens))
    full, new_only = case.use_random_trees()
    assert new_only.numel() == sum(q * q for q in query_lens)
    out_new = case.run(new_only)
    assert_matches(out_new, case.reference())
    torch.testing.assert_close(out_new, case.run(full), atol=ATOL, rtol=RTOL)


def test_tree_verify_chain_mask_equals_causal():
    # A chain tree is the causal mask: passing it explicitly must give the tree_mask=None result.
    case = Case([3, 8], [5, 5], seed=8)
    full = torch.cat([m.reshape(-1) for m in case.masks])
    torch.testing.assert_close(case.run(full), case.run(), atol=ATOL, rtol=RTOL)
    assert_matches(case.run(full), case.reference())


def test_tree_verify_accepts_int_mask():
    # The mask may arrive as a non-bool tensor (e.g. uint8); only its truth values count.
    case = Case([4, 6], [4, 4], seed=9)
    full, _ = case.use_random_trees()
    assert_matches(case.run(full.to(torch.uint8)), case.reference())


# ---------------------------------------------------------------------------------------------------------
# logit cap and sliding window


@pytest.mark.parametrize(
    ("logit_cap", "sliding_window"), [(1.0, -1), (0.0, 0), (0.0, 3), (0.5, 2), (2.0, 100)]
)
@pytest.mark.parametrize("mode", ["extend", "tree"])
def test_logit_cap_and_sliding_window(mode, logit_cap, sliding_window):
    case = Case([0, 6, 13], [5, 4, 7], seed=300 + int(10 * logit_cap) + sliding_window, heads=4, kv_heads=2)
    case.q *= 3.0  # larger scores, so that the cap bites
    tree_mask = case.use_random_trees()[0] if mode == "tree" else None
    out = case.run(tree_mask, logit_cap=logit_cap, sliding_window=sliding_window)
    assert_matches(out, case.reference(logit_cap=logit_cap, sliding_window=sliding_window))


def test_logit_cap_changes_the_result():
    case = Case([4], [3], seed=11)
    case.q *= 5.0
    assert not torch.allclose(case.run(logit_cap=0.5), case.run(), atol=1e-3)


def test_sliding_window_none_means_no_window():
    case = Case([9, 2], [3, 4], seed=12)
    torch.testing.assert_close(case.run(sliding_window=None), case.run(), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# new tokens' K/V already in the pool (the backend writes them before attending)


@pytest.mark.parametrize(("prefix_lens", "query_lens"), EXTEND_CASES + TREE_CASES)
def test_keys_read_from_the_pool_equal_the_concat(prefix_lens, query_lens):
    case = Case(prefix_lens, query_lens, seed=300 + sum(prefix_lens) + len(query_lens), heads=4, kv_heads=2)
    assert torch.equal(case.run_from_pool(), case.run())  # the same keys in the same order: bit for bit
    full, _ = case.use_random_trees()
    assert torch.equal(case.run_from_pool(full), case.run(full))
    assert_matches(case.run_from_pool(full), case.reference())


def test_keys_read_from_the_pool_in_bfloat16():
    case = Case([5, 0, 9], [3, 4, 2], seed=17)
    out = case.run_from_pool(dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, case.run(dtype=torch.bfloat16))


def test_pool_keys_need_a_plan_with_the_new_slots():
    case = Case([3], [2], seed=18)
    with pytest.raises(ValueError, match="new_token_loc"):
        attend(case.plan(), case.q, None, None, case.k_cache, case.v_cache, case.scaling)


# ---------------------------------------------------------------------------------------------------------
# dtypes


def test_bfloat16_inputs_close_to_float32():
    case = Case([5, 0, 9], [3, 4, 2], seed=13)
    out = case.run(dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert out.shape == case.q.shape
    # Same bf16-rounded inputs in float64: only the final rounding to bf16 differs.
    assert_matches(out, case.reference(dtype=torch.bfloat16), atol=1e-2, rtol=1e-2)
    # And close to the float32 computation on the unrounded inputs.
    torch.testing.assert_close(out.float(), case.run(), atol=5e-2, rtol=5e-2)


def test_bfloat16_tree_verify():
    case = Case([3, 7], [4, 4], seed=14)
    full, _ = case.use_random_trees()
    out = case.run(full, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert_matches(out, case.reference(dtype=torch.bfloat16), atol=1e-2, rtol=1e-2)


def test_float64_inputs_keep_dtype():
    case = Case([2, 5], [3, 1], seed=15)
    out = case.run(dtype=torch.float64)
    assert out.dtype == torch.float64
    assert_matches(out, case.reference())


# ---------------------------------------------------------------------------------------------------------
# plan


def test_plan_shapes_and_rows():
    case = Case([2, 0, 5], [3, 1, 2], seed=16)
    plan = case.plan()
    assert plan.num_rows == 6
    assert plan.query_valid.tolist() == [[True] * 3, [True, False, False], [True, True, False]]
    assert plan.query_row[plan.query_valid].tolist() == list(range(6))
    assert plan.mask.shape == (3, 3, 5 + 3)
    assert plan.query_pos[2].tolist()[:2] == [5, 6]
    for r, p in enumerate(case.prefix_lens):
        expected = case.req_to_token[case.req_pool_indices[r], :p].to(torch.int64)
        assert plan.prefix_loc[r, :p].tolist() == expected.tolist()


def test_long_chunks_attend_in_blocks_with_the_same_result(monkeypatch):
    """A prefill chunk of Q queries over P + Q keys would need a [bs, H, Q, P + Q] float32 score tensor;
    queries are taken in blocks so that no score block exceeds SCORE_BLOCK_BYTES, with the same output."""
    from torch.utils._python_dispatch import TorchDispatchMode

    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, prefix, q_len = 4, 2, 8, 40, 96
    k_cache = torch.randn(prefix + q_len + 1, kv_heads, dim, generator=gen)
    v_cache = torch.randn(prefix + q_len + 1, kv_heads, dim, generator=gen)
    req_to_token = torch.arange(1, prefix + q_len + 1, dtype=torch.int32).view(1, -1)
    q = torch.randn(q_len, heads, dim, generator=gen)
    k_new, v_new = (
        torch.randn(q_len, kv_heads, dim, generator=gen),
        torch.randn(q_len, kv_heads, dim, generator=gen),
    )
    plan = make_plan(req_to_token, torch.tensor([0]), torch.tensor([prefix]), torch.tensor([q_len]))
    whole = attend(plan, q, k_new, v_new, k_cache, v_cache, scaling=0.3, logit_cap=30.0)

    class LargestFloat(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    LargestFloat.largest = max(LargestFloat.largest, t.numel() * 4)
            return out

    scores = heads * q_len * (prefix + q_len) * 4  # the whole score tensor, in bytes
    budget = scores // 8
    monkeypatch.setattr(tree_attention, "SCORE_BLOCK_BYTES", budget)
    with LargestFloat():
        blocked = attend(plan, q, k_new, v_new, k_cache, v_cache, scaling=0.3, logit_cap=30.0)
    assert LargestFloat.largest <= budget
    torch.testing.assert_close(blocked, whole)


# ---------------------------------------------------------------------------------------------------------
# the query heads of a KV head folded into its query rows (on a CPU, from FOLD_HEADS_MIN_REQUESTS requests;
# in bf16 at any batch size while requests have at most FOLD_HEADS_MAX_BF16_QUERIES queries)

FOLD_CASES = [
    ([5, 11, 2, 8], [4, 4, 4, 4]),  # dense: verify trees of 4
    ([7, 1, 3, 9, 0], [1, 5, 3, 8, 2]),  # ragged
    ([30, 4, 6, 12, 9, 1], [1, 1, 1, 1, 1, 1]),  # decode
]


def _counting_folds(monkeypatch) -> list[int]:
    calls: list[int] = []
    fold = tree_attention._fold_heads

    def counted(*args, **kwargs):
        calls.append(1)
        return fold(*args, **kwargs)

    monkeypatch.setattr(tree_attention, "_fold_heads", counted)
    return calls


@pytest.mark.parametrize("mode", ["causal", "tree", "tree_new_only", "window", "pool"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (6, 1), (4, 4)])
@pytest.mark.parametrize(("prefix_lens", "query_lens"), FOLD_CASES)
def test_folded_heads_equal_the_reference_and_the_unfolded_call(
    monkeypatch, prefix_lens, query_lens, heads, kv_heads, mode
):
    assert len(prefix_lens) >= tree_attention.FOLD_HEADS_MIN_REQUESTS
    case = Case(prefix_lens, query_lens, seed=500 + sum(prefix_lens) + heads, heads=heads, kv_heads=kv_heads)
    full, new_only = case.use_random_trees() if mode.startswith("tree") else (None, None)
    window = 3 if mode == "window" else -1

    def run():
        if mode == "pool":
            return case.run_from_pool()
        return case.run(new_only if mode == "tree_new_only" else full, sliding_window=window)

    calls = _counting_folds(monkeypatch)
    folded = run()
    assert len(calls) == (1 if kv_heads < heads else 0)  # no GQA: nothing to fold
    assert_matches(folded, case.reference(sliding_window=window))
    monkeypatch.setattr(tree_attention, "FOLD_HEADS_MIN_REQUESTS", 10**9)
    torch.testing.assert_close(folded, run(), atol=1e-6, rtol=1e-6)
    assert len(calls) <= 1


def test_heads_are_not_folded_in_float32_for_few_requests_or_a_logit_cap(monkeypatch):
    calls = _counting_folds(monkeypatch)
    few = tree_attention.FOLD_HEADS_MIN_REQUESTS - 1
    Case([3] * few, [2] * few, seed=7, heads=9, kv_heads=3).run()
    capped = Case([3, 5, 1, 4], [2, 2, 2, 2], seed=8, heads=9, kv_heads=3)
    assert_matches(capped.run(logit_cap=1.0), capped.reference(logit_cap=1.0))
    assert calls == []


def _never_fold(monkeypatch) -> None:
    monkeypatch.setattr(tree_attention, "FOLD_HEADS_MIN_REQUESTS", 10**9)
    monkeypatch.setattr(tree_attention, "FOLD_HEADS_MAX_BF16_QUERIES", 0)


def test_folded_heads_in_bfloat16_match_the_unfolded_call(monkeypatch):
    case = Case([40, 12, 33, 7], [4, 4, 4, 4], seed=9, heads=9, kv_heads=3, head_dim=64)
    full, _ = case.use_random_trees()
    folded = case.run(full, dtype=torch.bfloat16)
    _never_fold(monkeypatch)
    assert torch.equal(folded, case.run(full, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("prefix_lens", "query_lens"),
    [([37], [1]), ([300], [1]), ([52, 9], [1, 1]), ([64], [4]), ([20, 41, 3], [3, 2, 4])],
)
def test_few_bfloat16_queries_fold_from_one_request_on(monkeypatch, prefix_lens, query_lens):
    """Decode and small trees in bf16 fold at any batch size (FOLD_HEADS_MAX_BF16_QUERIES), and give what
    the unfolded call gives."""
    case = Case(prefix_lens, query_lens, seed=11 + sum(prefix_lens), heads=9, kv_heads=3, head_dim=64)
    full, _ = case.use_random_trees() if max(query_lens) > 1 else (None, None)
    calls = _counting_folds(monkeypatch)
    folded = case.run(full, dtype=torch.bfloat16)
    assert calls == [1]
    assert_matches(folded, case.reference(dtype=torch.bfloat16), atol=1e-2, rtol=1e-2)
    _never_fold(monkeypatch)
    torch.testing.assert_close(folded, case.run(full, dtype=torch.bfloat16))
    assert calls == [1]


def test_a_bfloat16_request_with_more_queries_is_not_folded(monkeypatch):
    calls = _counting_folds(monkeypatch)
    over = tree_attention.FOLD_HEADS_MAX_BF16_QUERIES + 1
    Case([12], [over], seed=13, heads=9, kv_heads=3, head_dim=64).run(dtype=torch.bfloat16)
    assert calls == []
