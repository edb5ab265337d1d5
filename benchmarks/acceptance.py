"""Tokens per verify step (τ) of DART under several pruner settings, through the real SGLang server.

    .venv/bin/python benchmarks/acceptance.py --draft DRAFT_DIR --store STORE [--model DIR]
        [--new-tokens 64] [--dtype float32] [--prompts varied[,code]] SETTING [SETTING ...]

A SETTING is a comma-separated list of VAR=VALUE environment variables for one DART server, e.g.
`SGLANG_DART_TREE_SIZES=1:8` or `SGLANG_DART_TREE_SIZES=1:16,SGLANG_DART_NGRAM_WEIGHT=0` (see the
README for the variables). Every server gets `SGLANG_DART_TREE_SIZES=1:8` unless the setting names it,
so the tree size does not shrink with the batch.

`--prompts` names the held-out prompt sets, comma-separated (`benchmarks/bench_prompts.py`: `varied`, the
default, `code`, `unfamiliar`, `long`); each setting's server answers every named set, and the table gives τ
per set.

Greedy decoding is deterministic, so τ (emitted tokens / verify steps, summed over a set's held-out
prompts) does not depend on the machine's load the way tokens per second do: settings can
be compared on a noisy VM. The speed a setting gives is τ over its step cost, which `throughput.py`
measures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from throughput import SETS, _chat_ids, dart_parser  # noqa: E402

CONCURRENCY = 4  # requests in flight; τ does not depend on it under greedy decoding


def _setting(text: str) -> dict[str, str]:
    env = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"{item!r} is not VAR=VALUE")
        env[name.strip()] = value.strip()
    return env


def _prompt_sets(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in SETS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown prompt set(s) {unknown}; known: {sorted(SETS)}")
    return names


def main() -> None:
    from transformers import AutoTokenizer

    from sglang_dart.assets import smollm2_dir
    from sglang_dart.server_process import SglangServer, dart_flags, stop_servers_on_sigterm

    parser = dart_parser(__doc__)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-draft-tokens", type=int, default=16, help="the largest tree")
    parser.add_argument("--prompts", type=_prompt_sets, default=["varied"], help="varied, code or both")
    parser.add_argument("settings", nargs="+", type=_setting, metavar="SETTING")
    args = parser.parse_args()
    stop_servers_on_sigterm()

    model = args.model or smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_sets = {name: _chat_ids(tokenizer, SETS[name], len(SETS[name])) for name in args.prompts}
    params = {"max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
    server_args = [
        "--dtype", args.dtype, *dart_flags(args.draft, args.store),
        "--speculative-num-draft-tokens", str(args.num_draft_tokens),
    ]  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="dart-acceptance-"))
    counts = ", ".join(f"{len(ids)} {name}" for name, ids in prompt_sets.items())
    print(f"model {model.name} (--dtype {args.dtype}), prompts: {counts}; {args.new_tokens} tokens each, "
          f"greedy; logs in {logs}\n")  # fmt: skip
    print("| setting | prompts | tokens | verify steps | tokens/step |\n|---|---|---|---|---|")
    for number, setting in enumerate(args.settings):
        env = {"SGLANG_DART_TREE_SIZES": "1:8", **setting}
        server = SglangServer(model, server_args, logs / f"setting-{number}.log", env=env).start()
        label = ",".join(f"{k}={v}" for k, v in env.items())
        try:
            for name, prompts in prompt_sets.items():
                outputs = server.generate_many(prompts, params, CONCURRENCY)
                tokens = sum(len(out["output_ids"]) for out in outputs)
                steps = sum(out["meta_info"]["spec_verify_ct"] for out in outputs)
                print(f"| {label} | {name} | {tokens} | {steps} | {tokens / steps:.3f} |", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
