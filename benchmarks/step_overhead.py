"""What DART's machinery costs per step, apart from the target: a tiny Qwen3 target (its forward is cheap)
with a random drafter (τ ≈ 1, so every step verifies a tree of 8 and keeps only the root), against plain
decoding of the same target, one request at a time. The difference per step is the host-side cost a
DART step adds (pruning, verify set-up, acceptance, the draft forward), the part that does not shrink on
a GPU. With --profile the DART server logs its per-phase times (`SGLANG_DART_PROFILE=1`).

    .venv/bin/python benchmarks/step_overhead.py [--requests 8] [--new-tokens 64] [--batch 1]
        [--tree-sizes fixed] [--profile] [--out DIR]

--batch N keeps N requests in flight (the scheduler's per-step work grows with the batch); --tree-sizes
sets the DART server's schedule (SGLANG_DART_TREE_SIZES): `1:1` makes every step root-only, the steps a
guard chooses when trees do not pay, which run as plain decode forwards.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support: tiny model, drafter

from sglang_dart.server_process import SglangServer, stop_servers_on_sigterm  # noqa: E402
from tests.support.dart_assets import build_random_drafter, build_store_for  # noqa: E402
from tests.support.dart_serving import dart_server_args  # noqa: E402
from tests.support.tiny_models import build_tiny_model  # noqa: E402


def per_step(server: SglangServer, requests: int, new_tokens: int, batch: int) -> tuple[float, float]:
    """Milliseconds per decode step (of the whole batch) and tokens per step of a request, over
    `requests` requests with `batch` of them in flight."""
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    generate = lambda i: server.generate(  # noqa: E731
        {"text": f"prompt number {i} is here", "sampling_params": params}
    )
    with ThreadPoolExecutor(max_workers=batch) as pool:
        list(pool.map(generate, range(-batch, 0)))  # warm up at this batch size
        start = time.perf_counter()
        outs = list(pool.map(generate, range(requests)))
    elapsed = time.perf_counter() - start
    tokens = sum(len(out["output_ids"]) for out in outs)
    steps = sum(out["meta_info"].get("spec_verify_ct") or len(out["output_ids"]) for out in outs)
    return 1000 * elapsed * batch / steps, tokens / steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="requests in flight")
    parser.add_argument("--tree-sizes", default="fixed", help="the DART server's SGLANG_DART_TREE_SIZES")
    parser.add_argument("--profile", action="store_true", help="per-phase times in the DART server's log")
    parser.add_argument("--out", type=Path, default=Path("step-overhead"))
    args = parser.parse_args()
    stop_servers_on_sigterm()
    model = build_tiny_model(args.out / "qwen3", arch="qwen3")
    draft = build_random_drafter(args.out / "draft", model)
    store = build_store_for(model, args.out / "stdlib.store")
    # By default trees of 8 at every step, whatever they pay.
    os.environ["SGLANG_DART_TREE_SIZES"] = args.tree_sizes
    if args.profile:
        os.environ["SGLANG_DART_PROFILE"] = "1"
    f32 = ["--dtype", "float32"]
    servers = {
        "plain": SglangServer(model, f32, args.out / "plain.log"),
        "dart": SglangServer(model, [*f32, *dart_server_args(draft, store)], args.out / "dart.log"),
    }
    try:
        for server in servers.values():
            server.start()
        results = {
            name: per_step(s, args.requests, args.new_tokens, args.batch) for name, s in servers.items()
        }
    finally:
        for server in servers.values():
            server.stop()
    for name, (ms, tau) in results.items():
        print(f"{name}: {ms:.2f} ms per step, {tau:.2f} tokens per step")
    print(f"DART machinery: {results['dart'][0] - results['plain'][0]:+.2f} ms per step")
    if args.profile:
        print(f"phases: grep 'DART step profile' {args.out / 'dart.log'}")


if __name__ == "__main__":
    main()
