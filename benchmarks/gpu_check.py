"""The checks a machine with one GPU runs in one go (`bash scripts/gpu_check.sh`), each against a plain SGLang
server started in the same run:

1. greedy parity: DART (FlashInfer tree verify, CUDA graphs, SGLang's defaults otherwise) against plain
   decoding on the same prompts; counts identical outputs and the first differing position of the others
   (in bf16 a verify step computes several rows per request and may round a near-tie differently, so the
   float32 CPU tests are where token-for-token equality is proven; here the figure is reported);
2. seeded sampling under --enable-deterministic-inference: a request's `sampling_seed` draws the same
   tokens under DART as under plain decoding (same caveat);
3. timings: tokens/s of plain, DART and, with --eagle3-draft, EAGLE3, at batch sizes 1-64, as ratios to
   plain in the same run.

Without --draft/--store the DART drafter has random weights (lossless all the same; its timings then
measure the machinery, not a drafter) and the 3-gram store is built from the standard library's sources.
Every server's log and a JSON of all figures land in --out.

    python benchmarks/gpu_check.py [--model DIR] [--draft DIR --store FILE] [--eagle3-draft DIR]
        [--dtype bfloat16] [--batch-sizes 1 4 16 64] [--new-tokens 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support: random drafter, store

from sglang_dart.server_process import SglangServer  # noqa: E402

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain the difference between a process and a thread.",
    "Write a haiku about the sea.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Write a SQL query that returns the ten most recent orders per customer.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Write a bash one-liner that counts lines in every .py file under a directory.",
    "Give three tips for writing readable code.",
]


def _chat_ids(model: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from tests.support.prompts import chat_ids

    tok = AutoTokenizer.from_pretrained(model)
    prompts = (PROMPTS * (n // len(PROMPTS) + 1))[:n]
    return [chat_ids(tok, f"{p} ({i})") for i, p in enumerate(prompts)]


def _assets(args: argparse.Namespace) -> tuple[Path, Path]:
    if args.draft and args.store:
        return Path(args.draft), Path(args.store)
    from tests.support.dart_assets import build_random_drafter, build_store_for

    draft = build_random_drafter(args.out / "random-draft", args.model, draft_length=7)
    return draft, build_store_for(args.model, args.out / "stdlib.store")


def _run(
    server: SglangServer, prompts: list[list[int]], params: dict, concurrency: int
) -> tuple[list, float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outs = list(pool.map(lambda p: server.generate({"input_ids": p, "sampling_params": params}), prompts))
    return outs, time.perf_counter() - start


def _parity(plain: list[dict], dart: list[dict]) -> dict:
    same, first_diffs = 0, []
    for a, b in zip(plain, dart, strict=True):
        x, y = a["output_ids"], b["output_ids"]
        if x == y:
            same += 1
        else:
            first_diffs.append(
                next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
            )
    return {"identical": same, "of": len(plain), "first_difference_at": first_diffs}


def _tau(outs: list[dict]) -> float:
    values = [o["meta_info"].get("spec_accept_length") for o in outs]
    values = [v for v in values if v]
    return sum(values) / len(values) if values else 1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path)
    parser.add_argument("--draft")
    parser.add_argument("--store")
    parser.add_argument("--eagle3-draft")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from sglang_dart.assets import smollm2_dir

        args.model = smollm2_dir()
    draft, store = _assets(args)
    common = [
        "--dtype",
        args.dtype,
        "--random-seed",
        "0",
        "--max-running-requests",
        str(max(args.batch_sizes)),
    ]
    dart_args = [
        "--speculative-algorithm", "DART",
        "--speculative-draft-model-path", str(draft),
        "--speculative-ngram-external-corpus-path", str(store),
        "--speculative-num-draft-tokens", str(args.num_draft_tokens),
    ]  # fmt: skip
    report: dict = {"model": str(args.model), "dtype": args.dtype, "draft": str(draft), "store": str(store)}
    greedy = {"max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
    prompts = _chat_ids(args.model, max(32, max(args.batch_sizes)))

    # 1 + 3: greedy parity and timings, servers side by side (a GPU holds all of them).
    servers = {"plain": SglangServer(args.model, common, args.out / "plain.log")}
    servers["dart"] = SglangServer(args.model, common + dart_args, args.out / "dart.log")
    if args.eagle3_draft:
        eagle = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", args.eagle3_draft]
        servers["eagle3"] = SglangServer(args.model, common + eagle, args.out / "eagle3.log")
    try:
        for server in servers.values():
            server.start()
        outs = {name: _run(s, prompts[:32], greedy, 8)[0] for name, s in servers.items()}
        report["greedy_parity"] = _parity(outs["plain"], outs["dart"])
        report["tau"] = _tau(outs["dart"])
        timings: dict = {}
        for bs in args.batch_sizes:
            batch = prompts[: max(bs, 8)]
            row = {}
            for name, server in servers.items():
                _run(server, batch[:bs], greedy, bs)  # warm-up at this batch size (graphs, caches)
                done, seconds = _run(server, batch, greedy, bs)
                row[name] = sum(len(o["output_ids"]) for o in done) / seconds
            timings[bs] = {name: {"tok_s": v, "vs_plain": v / row["plain"]} for name, v in row.items()}
            print(f"batch {bs}: " + ", ".join(f"{n} {v['tok_s']:.1f} tok/s ({v['vs_plain']:.2f}x)"
                                              for n, v in timings[bs].items()), flush=True)  # fmt: skip
        report["timings"] = timings
    finally:
        for server in servers.values():
            server.stop()

    # 2: seeded sampling under deterministic inference (a GPU option: SGLang refuses it on CPU backends).
    import torch

    if not torch.cuda.is_available():
        report["seeded_sampling_parity"] = "skipped: no CUDA device"
        return _finish(args, report)
    seeded = ["--enable-deterministic-inference", "--attention-backend", "flashinfer"]
    plain = SglangServer(args.model, common + seeded, args.out / "plain-seeded.log")
    dart = SglangServer(args.model, common + seeded + dart_args, args.out / "dart-seeded.log")
    try:
        sampled = [
            {
                "max_new_tokens": 32,
                "temperature": 0.8,
                "top_p": 0.95,
                "sampling_seed": seed,
                "ignore_eos": True,
            }
            for seed in range(16)
        ]
        runs = {}
        for name, server in (("plain", plain), ("dart", dart)):
            server.start()
            runs[name] = [
                server.generate({"input_ids": p, "sampling_params": s})
                for p, s in zip(prompts[:16], sampled, strict=True)
            ]
            server.stop()
        report["seeded_sampling_parity"] = _parity(runs["plain"], runs["dart"])
    finally:
        plain.stop()
        dart.stop()

    return _finish(args, report)


def _finish(args: argparse.Namespace, report: dict) -> int:
    """Write the report; fail when fewer than 80% of greedy outputs equal plain's (bf16 rounding aside,
    a broken verify path departs in nearly every output)."""
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("greedy_parity", "tau", "seeded_sampling_parity")}, indent=2))
    parity = report["greedy_parity"]
    return 0 if parity["identical"] >= 0.8 * parity["of"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
