"""The Rust CPU attention (sglang_dart/cpu/rust_attention.py, rust/dart-core/src/attention.rs): the same
results as torch's path and the float64 definition on decode, extend and tree-verify plans; a row's result
bit-identical decoded alone, verified in a tree and prefilled; the forwards it does not take left to torch;
bad settings and inputs refused."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from sglang_dart import _core
from sglang_dart.attention.tree_attention import attend, make_plan
from sglang_dart.cpu import rust_attention
from tests.support.tree_masks import random_tree_mask
from tests.unit.test_tree_attention import Case, assert_matches

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


@pytest.fixture
def rust_on(monkeypatch):
    monkeypatch.delenv(rust_attention.ENV, raising=False)
    rust_attention.install()
    yield
    rust_attention.uninstall()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "prefix_lens, query_lens, tree",
    [
        ([5, 0, 37], [1, 1, 1], False),  # decode, one request with nothing cached
        ([12, 3, 40, 7], [8, 3, 5, 1], True),  # verify of uneven trees: padded query slots
        ([20, 9], [4, 6], False),  # a small extend
        ([64], [8], True),  # a batch-1 tree of 8
    ],
)
def test_matches_torch_and_the_definition(rust_on, dtype, prefix_lens, query_lens, tree):
    case = Case(
        prefix_lens, query_lens, seed=sum(prefix_lens) + len(query_lens), heads=9, kv_heads=3, head_dim=64
    )
    full = case.use_random_trees()[0] if tree else None
    plan = make_plan(
        case.req_to_token,
        case.req_pool_indices,
        torch.tensor(prefix_lens),
        torch.tensor(query_lens),
        full,
        torch.zeros(sum(query_lens), dtype=torch.int64),
    )
    assert rust_attention.applies(plan, case.q.to(dtype), case.k_cache.to(dtype), case.v_cache.to(dtype), 0.0)
    got = case.run_from_pool(full, dtype)
    rust_attention.uninstall()
    torch_out = case.run_from_pool(full, dtype)
    tol = TOLERANCE[dtype]
    assert_matches(got, case.reference(dtype=dtype), atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), torch_out.float(), atol=tol, rtol=tol)


def test_sliding_window(rust_on):
    case = Case([30, 11], [4, 2], seed=3, heads=4, kv_heads=2, head_dim=16)
    got = case.run_from_pool(sliding_window=6)
    assert_matches(got, case.reference(sliding_window=6))


FP8 = [torch.float8_e5m2, torch.float8_e4m3fn]


def _one_request(
    seed: int, cached: int, new: int, slots: int, dtype: torch.dtype, pool_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SmolLM2's heads (9 query over 3 KV, of 64): a random KV pool of `slots` rows in `pool_dtype` (default
    `dtype`), the `new` tokens' queries, and one request's `cached + new` tokens in scattered slots."""
    heads, kv_heads, dim = 9, 3, 64
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn((slots, kv_heads, dim), generator=g).to(pool_dtype or dtype)
    v_cache = torch.randn((slots, kv_heads, dim), generator=g).to(pool_dtype or dtype)
    q = torch.randn((new, heads, dim), generator=g).to(dtype)
    req_to_token = torch.randperm(slots, generator=g)[: cached + new].view(1, -1).to(torch.int32)
    return k_cache, v_cache, q, req_to_token


@pytest.mark.parametrize(
    "dtype, pool_dtype",
    [
        (torch.float32, None),
        (torch.bfloat16, None),
        *((torch.bfloat16, f) for f in FP8),
        (torch.float32, FP8[0]),
        (torch.float16, None),
        (torch.float16, FP8[1]),
    ],
)
def test_a_tree_row_equals_the_same_token_decoded_alone(rust_on, dtype, pool_dtype):
    """Each node of a verified tree gets the bits it gets when decoded alone after its ancestors: the
    keys it sees sit at other columns there, and nothing else is in the batch. Also with an fp8 KV pool
    (`--kv-cache-dtype fp8_*`) or in float16 (a float32 checkpoint under SGLang's `--dtype auto` on a
    CPU), where torch's SDPA gave the two other results."""
    prefix, n = 50, 8
    k_cache, v_cache, q, req_to_token = _one_request(7, prefix, n, 4 * (prefix + n), dtype, pool_dtype)
    tree = random_tree_mask(random.Random(7), n)
    tree_layout = torch.cat([torch.ones((n, prefix), dtype=torch.bool), tree], dim=1).reshape(-1)
    verify_plan = make_plan(
        req_to_token,
        torch.tensor([0]),
        torch.tensor([prefix]),
        torch.tensor([n]),
        tree_layout,
        req_to_token[0, prefix:],
    )
    verified = attend(verify_plan, q, None, None, k_cache, v_cache, 0.125)
    for node in range(n):
        path = tree[node].nonzero().squeeze(1)  # its ancestors and itself, in tree order
        row = torch.cat([req_to_token[0, :prefix], req_to_token[0, prefix + path]]).view(1, -1)
        seen = prefix + len(path) - 1
        decode_plan = make_plan(
            row, torch.tensor([0]), torch.tensor([seen]), torch.tensor([1]), None, row[0, -1:]
        )
        alone = attend(decode_plan, q[node : node + 1], None, None, k_cache, v_cache, 0.125)
        assert torch.equal(alone[0], verified[node]), f"node {node}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pool_dtype", FP8)
def test_an_fp8_pool_reads_as_its_values_widened(rust_on, dtype, pool_dtype):
    """An fp8 pool gives the bits the same values give in a pool of the queries' dtype (every fp8 value
    is one), through the Rust kernel, and matches the definition."""
    case = Case([12, 3, 40, 7], [8, 3, 5, 1], seed=11, heads=9, kv_heads=3, head_dim=64)
    full = case.use_random_trees()[0]
    plan = make_plan(
        case.req_to_token,
        case.req_pool_indices,
        torch.tensor([12, 3, 40, 7]),
        torch.tensor([8, 3, 5, 1]),
        full,
        torch.zeros(17, dtype=torch.int64),
    )
    q = case.q.to(dtype)
    k8, v8 = case.k_cache.to(pool_dtype), case.v_cache.to(pool_dtype)
    assert rust_attention.applies(plan, q, k8, v8, 0.0)
    got = attend(plan, q, None, None, k8, v8, 0.125)
    widened = attend(plan, q, None, None, k8.to(dtype), v8.to(dtype), 0.125)
    assert torch.equal(got, widened)
    rust_attention.uninstall()
    by_torch = attend(plan, q, None, None, k8, v8, 0.125)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), by_torch.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_prefilled_token_equals_the_same_token_decoded(rust_on, dtype):
    """A prompt's tokens prefilled in one chunk (more queries than any tree, so the kernel's long tasks)
    get the bits each gets decoded after the ones before it: with the radix cache a prompt's K/V may come
    from either forward, and the server's answer must not depend on which."""
    cached, new = 40, 300
    k_cache, v_cache, q, req_to_token = _one_request(11, cached, new, 2 * (cached + new), dtype)
    prefill_plan = make_plan(
        req_to_token,
        torch.tensor([0]),
        torch.tensor([cached]),
        torch.tensor([new]),
        None,
        req_to_token[0, cached:],
    )
    assert rust_attention.applies(prefill_plan, q, k_cache, v_cache, 0.0)
    prefilled = attend(prefill_plan, q, None, None, k_cache, v_cache, 0.125)
    for i in [*range(0, new, 23), new - 1]:
        decode_plan = make_plan(
            req_to_token,
            torch.tensor([0]),
            torch.tensor([cached + i]),
            torch.tensor([1]),
            None,
            req_to_token[0, cached + i : cached + i + 1],
        )
        alone = attend(decode_plan, q[i : i + 1], None, None, k_cache, v_cache, 0.125)
        assert torch.equal(alone[0], prefilled[i]), f"token {i}"
    rust_attention.uninstall()
    by_torch = attend(prefill_plan, q, None, None, k_cache, v_cache, 0.125)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(prefilled.float(), by_torch.float(), atol=tol, rtol=tol)


def test_forwards_it_does_not_take_stay_with_torch(rust_on):
    short = Case([10], [2], seed=1)
    loc = torch.zeros(2, dtype=torch.int64)
    plan = make_plan(
        short.req_to_token, short.req_pool_indices, torch.tensor([10]), torch.tensor([2]), None, loc
    )
    assert rust_attention.applies(plan, short.q, short.k_cache, short.v_cache, 0.0)
    assert not rust_attention.applies(plan, short.q, short.k_cache, short.v_cache, 30.0)  # logit cap
    assert not rust_attention.applies(
        plan, short.q.double(), short.k_cache.double(), short.v_cache.double(), 0.0
    )
    assert not rust_attention.applies(
        plan, short.q.half(), short.k_cache.bfloat16(), short.v_cache.bfloat16(), 0.0
    )
    no_loc = make_plan(short.req_to_token, short.req_pool_indices, torch.tensor([10]), torch.tensor([2]))
    assert not rust_attention.applies(no_loc, short.q, short.k_cache, short.v_cache, 0.0)
    rust_attention.uninstall()
    assert not rust_attention.applies(plan, short.q, short.k_cache, short.v_cache, 0.0)


def test_the_torch_setting_keeps_torch(monkeypatch):
    monkeypatch.setenv(rust_attention.ENV, "torch")
    rust_attention.install()
    assert not rust_attention.active()


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv(rust_attention.ENV, "fastest")
    with pytest.raises(ValueError, match="SGLANG_DART_CPU_ATTENTION='fastest'"):
        rust_attention.install()


def _kernel_args(slots=20):
    q = np.zeros((2, 4, 8), dtype=np.float32)
    k = np.zeros((slots, 2, 8), dtype=np.float32)
    key_loc = np.array([[0, 1, 2]], dtype=np.int64)
    mask = np.ones((1, 2, 3), dtype=bool)
    query_row = np.array([[0, 1]], dtype=np.int64)
    valid = np.ones((1, 2), dtype=bool)
    out = np.zeros((2, 4, 8), dtype=np.float32)
    return [q, k, k.copy(), key_loc, mask, query_row, valid, 0.5, out]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a[3].__setitem__((0, 1), 20), "outside the pool"),
        (lambda a: a[3].__setitem__((0, 1), -1), "outside the pool"),
        (lambda a: a[5].__setitem__((0, 1), 0), "two query slots"),
        (lambda a: a[5].__setitem__((0, 1), 2), "outside the 2 rows"),
        (lambda a: a.__setitem__(4, np.ones((1, 2, 4), dtype=bool)), "key_loc is"),
        (lambda a: a.__setitem__(8, np.zeros((2, 4, 7), dtype=np.float32)), "do not fit"),
        (
            lambda a: a.__setitem__(0, np.zeros((2, 8, 4), dtype=np.float32).transpose(0, 2, 1)),
            "C-contiguous",
        ),
        (lambda a: a.__setitem__(1, np.zeros((20, 3, 8), dtype=np.float32)), "do not fit"),
    ],
)
def test_bad_kernel_inputs_are_errors_not_crashes(change, message):
    args = _kernel_args()
    _core.attend_f32(*args)  # the unchanged arguments are fine
    change(args)
    with pytest.raises(ValueError, match=message):
        _core.attend_f32(*args)
