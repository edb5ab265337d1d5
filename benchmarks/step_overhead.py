"""What DART's machinery costs per step, apart from the target: a tiny Qwen3 target (its forward is cheap)
with a random drafter (τ ≈ 1, so every step verifies a tree of 8 and keeps only the root), against plain
decoding of the same target, one request at a time. The difference per step is the host-side cost a
DART step adds (pruning, verify set-up, acceptance, the draft forward), the part that does not shrink on
a GPU. With --profile the DART server logs its per-phase times (`SGLANG_DART_PROFILE=1`).

    .venv/bin/python benchmarks/step_overhead.py [--requests 8] [--new-tokens 64] [--profile] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support: tiny model, drafter

from sglang_dart.server_process import SglangServer, stop_servers_on_sigterm  # noqa: E402
from tests.support.dart_assets import build_random_drafter, build_store_for  # noqa: E402
from tests.support.dart_serving import dart_server_args  # noqa: E402
from tests.support.tiny_models import build_tiny_model  # noqa: E402


def per_step(server: SglangServer, requests: int, new_tokens: int) -> tuple[float, float]:
    """Milliseconds per decode step and tokens per step over `requests` sequential requests."""
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    server.generate({"text": "warm up", "sampling_params": params})
    tokens = steps = 0
    start = time.perf_counter()
    for i in range(requests):
        out = server.generate({"text": f"prompt number {i} is here", "sampling_params": params})
        tokens += len(out["output_ids"])
        steps += out["meta_info"].get("spec_verify_ct") or len(out["output_ids"])
    return 1000 * (time.perf_counter() - start) / steps, tokens / steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--profile", action="store_true", help="per-phase times in the DART server's log")
    parser.add_argument("--out", type=Path, default=Path("step-overhead"))
    args = parser.parse_args()
    stop_servers_on_sigterm()
    model = build_tiny_model(args.out / "qwen3", arch="qwen3")
    draft = build_random_drafter(args.out / "draft", model)
    store = build_store_for(model, args.out / "stdlib.store")
    os.environ["SGLANG_DART_TREE_SIZES"] = "fixed"  # trees of 8 at every step, whatever they pay
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
        results = {name: per_step(s, args.requests, args.new_tokens) for name, s in servers.items()}
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
