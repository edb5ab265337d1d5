"""Paired A/B of two checkouts of sglang_dart: plain and DART servers from this checkout and from another
(`git worktree add DIR REV`, with the built `sglang_dart/_core.abi3.so` copied into it), all up at once and
measured in turn, every other round in reverse order, so that the VM's drift weighs on both alike.

    git worktree add /tmp/old REV && cp sglang_dart/_core.abi3.so /tmp/old/sglang_dart/
    .venv/bin/python benchmarks/ab_checkout.py --other /tmp/old [--rounds 4] [--prompts 12] [--new-tokens 64]

The other checkout's servers run with PYTHONPATH=DIR, so SGLang's plugin entry point imports its
sglang_dart (its scheduler processes inherit the path). Greedy, ignore_eos, the `varied` benchmark prompts
one at a time, bf16, the shipped drafter and store. Prints tokens/s per round and the per-round ratios.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from sglang_dart.assets import shipped_smollm2_drafter, smollm2_dir
from sglang_dart.server_process import SglangServer, dart_flags, start_together

sys.path.insert(0, str(Path(__file__).parent))
from bench_prompts import VARIED, messages  # noqa: E402


def tokens_per_second(server: SglangServer, prompts: list[str], new_tokens: int) -> float:
    started, tokens = time.perf_counter(), 0
    for prompt in prompts:
        params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        answer = server.generate({"text": prompt, "sampling_params": params})
        tokens += answer["meta_info"]["completion_tokens"]
    return tokens / (time.perf_counter() - started)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--other", type=Path, required=True, help="the other checkout (a git worktree)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    if not (args.other / "sglang_dart" / "_core.abi3.so").exists():
        parser.error(f"{args.other}/sglang_dart/_core.abi3.so is missing: copy this checkout's build there")
    model = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [
        tokenizer.apply_chat_template(messages(c), tokenize=False, add_generation_prompt=True)
        for c in VARIED[: args.prompts]
    ]
    draft, store = shipped_smollm2_drafter()
    other = {"PYTHONPATH": str(args.other.resolve())}
    logs = Path(tempfile.mkdtemp(prefix="dart-ab-"))
    flags = {"plain": ["--dtype", "bfloat16"], "DART": [*dart_flags(draft, store), "--dtype", "bfloat16"]}
    servers = {
        f"{kind} {side}": SglangServer(model, kind_flags, logs / f"{kind}-{side}.log", env=env)
        for kind, kind_flags in flags.items()
        for side, env in (("this", None), ("other", other))
    }
    print(f"logs in {logs}", flush=True)
    start_together(servers.values())
    try:
        for server in servers.values():
            tokens_per_second(server, prompts[:1], 8)  # first-request set-up is not decoding speed
        rates: dict[str, list[float]] = {name: [] for name in servers}
        names = list(servers)
        for round_index in range(args.rounds):
            for name in names if round_index % 2 == 0 else names[::-1]:
                rates[name].append(tokens_per_second(servers[name], prompts, args.new_tokens))
            measured = ", ".join(f"{n} {r[-1]:.1f}" for n, r in rates.items())
            print(f"round {round_index}: {measured}", flush=True)
        for kind in flags:
            ratios = [a / b for a, b in zip(rates[f"{kind} this"], rates[f"{kind} other"], strict=True)]
            print(f"{kind} this/other by round: " + " ".join(f"{x:.3f}" for x in ratios))
        for side in ("this", "other"):
            ratios = [a / b for a, b in zip(rates[f"DART {side}"], rates[f"plain {side}"], strict=True)]
            print(f"DART/plain, {side}: " + " ".join(f"{x:.3f}" for x in ratios))
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
