"""One layer's decode / tree-verify / prefill attention on the CPU, torch's SDPA against the Rust kernel, both
through `tree_attention.attend` (plan, Python call and output included), in one process: SmolLM2-135M's heads
(9 query heads over 3 KV heads of 64), keys in scattered pool slots, each tree a random one over the cached
tokens, each prefill causal after them.

    .venv/bin/python benchmarks/attention_layer.py [--dtype bfloat16] [--calls 300] [--prefill]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from sglang_dart.attention.tree_attention import AttentionPlan, attend, make_plan
from sglang_dart.cpu import rust_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support: random trees
from tests.support.tree_masks import random_tree_mask  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, SLOTS = 9, 3, 64, 65_536
# (requests, queries a request, cached tokens a request)
SHAPES = [(1, 1, 300), (1, 8, 300), (1, 16, 300), (1, 16, 1000), (1, 32, 300), (4, 8, 300), (16, 1, 300)]
# Prefill chunks: (requests, new tokens a request, cached tokens a request), causal among the new tokens.
PREFILL_SHAPES = [
    (1, 64, 0),
    (1, 256, 0),
    (1, 512, 0),
    (1, 2048, 0),
    (1, 128, 1000),
    (1, 512, 2000),
    (4, 256, 0),
]


def tree_layout(rng: random.Random, queries: int, cached: int) -> torch.Tensor:
    """[queries, cached + queries]: every query sees the cache, its ancestors in a random tree and itself."""
    return torch.cat([torch.ones(queries, cached, dtype=torch.bool), random_tree_mask(rng, queries)], dim=1)


def plan_for(requests: int, queries: int, cached: int, rng: random.Random, causal: bool) -> AttentionPlan:
    req_to_token = torch.randperm(SLOTS)[: requests * (cached + queries)].view(requests, -1).to(torch.int32)
    layout = None
    if queries > 1 and not causal:
        layout = torch.cat([tree_layout(rng, queries, cached).reshape(-1) for _ in range(requests)])
    return make_plan(
        req_to_token,
        torch.arange(requests),
        torch.full((requests,), cached),
        torch.full((requests,), queries),
        layout,
        req_to_token[:, cached:].reshape(-1).to(torch.int64),
    )


def microseconds(call: Callable[[], torch.Tensor], calls: int) -> float:
    for _ in range(min(20, calls)):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument(
        "--prefill", action="store_true", help="time prefill chunks instead of decode and trees"
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    rng = random.Random(0)
    k_cache = torch.randn(SLOTS, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.randn(SLOTS, KV_HEADS, HEAD_DIM, dtype=dtype)
    print(f"| one layer, {args.dtype} | torch SDPA us | Rust us | torch / Rust | max difference |")
    print("|---|---|---|---|---|")
    for requests, queries, cached in PREFILL_SHAPES if args.prefill else SHAPES:
        label = (
            f"{requests} request(s), {queries} {'new tokens' if args.prefill else 'queries'}, {cached} cached"
        )
        plan = plan_for(requests, queries, cached, rng, causal=args.prefill)
        q = torch.randn(requests * queries, HEADS, HEAD_DIM, dtype=dtype)
        call = partial(attend, plan, q, None, None, k_cache, v_cache, HEAD_DIM**-0.5)
        # A prefill chunk costs up to ~1,000 decode calls: calls in proportion to its (query, key) pairs.
        pairs = requests * queries * (cached + queries)
        calls = max(3, args.calls * 20_000 // pairs) if args.prefill else args.calls
        rust_attention.uninstall()
        reference, torch_us = call(), microseconds(call, calls)
        rust_attention.install()
        if not rust_attention.applies(plan, q, k_cache, v_cache, 0.0):
            raise SystemExit(f"the Rust kernel does not take this plan ({label})")
        got, rust_us = call(), microseconds(call, calls)
        error = (got.float() - reference.float()).abs().max().item()
        ratio = torch_us / rust_us
        print(f"| {label} | {torch_us:.0f} | {rust_us:.0f} | {ratio:.2f}x | {error:.1e} |", flush=True)


if __name__ == "__main__":
    main()
