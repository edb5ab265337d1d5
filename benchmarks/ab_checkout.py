"""Paired A/B of two checkouts of sglang_dart: plain and DART servers from this checkout and from another
(`git worktree add DIR REV`, with the built `sglang_dart/_core.abi3.so` copied into it), all up at once and
measured in turn, every other round in reverse order, so that the VM's drift weighs on both alike.

    git worktree add /tmp/old REV && cp sglang_dart/_core.abi3.so /tmp/old/sglang_dart/
    .venv/bin/python benchmarks/ab_checkout.py --other /tmp/old [--rounds 4] [--prompts 12] [--new-tokens 64]

The other checkout's servers run with PYTHONPATH=DIR, so SGLang's plugin entry point imports its
sglang_dart (its scheduler processes inherit the path). Greedy, ignore_eos, the `varied` benchmark prompts
one at a time after a warm-up (`throughput.py`'s measurement), bf16 unless `--dtype` says otherwise, the
shipped drafter and store. Prints
tokens/s and CPU time per round and the per-round ratios.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from sglang_dart.assets import shipped_smollm2_drafter, smollm2_dir
from sglang_dart.server_process import SglangServer, dart_flags, start_together

sys.path.insert(0, str(Path(__file__).parent))
from bench_prompts import VARIED  # noqa: E402
from throughput import Measurement, _measure, round_order, round_ratios  # noqa: E402


def _ratios(runs: list[Measurement], baseline: list[Measurement], field: str) -> str:
    return " ".join(f"{x:.3f}" for x in round_ratios(runs, baseline, field))


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--other", type=Path, required=True, help="the other checkout (a git worktree)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--dtype", default="bfloat16", help="the target's (float32 is where trees pay on a CPU without bf16)"
    )
    args = parser.parse_args()
    if not (args.other / "sglang_dart" / "_core.abi3.so").exists():
        parser.error(f"{args.other}/sglang_dart/_core.abi3.so is missing: copy this checkout's build there")
    model = smollm2_dir("float32" if args.dtype == "float32" else "bfloat16")
    tokenizer = AutoTokenizer.from_pretrained(model)
    draft, store = shipped_smollm2_drafter()
    other = {"PYTHONPATH": str(args.other.resolve())}
    logs = Path(tempfile.mkdtemp(prefix="dart-ab-"))
    flags = {"plain": ["--dtype", args.dtype], "DART": [*dart_flags(draft, store), "--dtype", args.dtype]}
    servers = {
        f"{kind} {side}": SglangServer(model, kind_flags, logs / f"{kind}-{side}.log", env=env)
        for kind, kind_flags in flags.items()
        for side, env in (("this", None), ("other", other))
    }
    print(f"logs in {logs}", flush=True)
    start_together(servers.values())
    try:
        runs: dict[str, list[Measurement]] = {name: [] for name in servers}
        for round_index in range(args.rounds):
            for name in round_order(list(servers), round_index):
                # One request at a time, after a warm-up on other prompts (throughput.py's measurement).
                measured = _measure(
                    servers[name], tokenizer, 1, args.new_tokens, args.prompts, prompts=VARIED
                )
                runs[name].append(measured)
            line = ", ".join(
                f"{n} {r[-1].tokens_per_second:.1f} tok/s {r[-1].cpu_ms_per_token:.1f} CPU ms/token"
                for n, r in runs.items()
            )
            print(f"round {round_index}: {line}", flush=True)
        for kind in flags:
            this, other_runs = runs[f"{kind} this"], runs[f"{kind} other"]
            print(f"{kind} this/other tokens/s by round: " + _ratios(this, other_runs, "tokens_per_second"))
            print(f"{kind} other/this CPU time by round: " + _ratios(other_runs, this, "cpu_ms_per_token"))
        for side in ("this", "other"):
            dart_runs, plain_runs = runs[f"DART {side}"], runs[f"plain {side}"]
            print(f"DART/plain tokens/s, {side}: " + _ratios(dart_runs, plain_runs, "tokens_per_second"))
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
