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
--random-target-like DIR gives the target DIR's config and tokenizer with random weights, for a host the
real weights cannot reach. Each check runs on its own: a failure is recorded (with its traceback) in the
report and the next check runs. Every server's log and a JSON of all figures land in --out.

    python benchmarks/gpu_check.py [--model DIR | --random-target-like DIR] [--draft DIR --store FILE]
        [--eagle3-draft DIR] [--dtype bfloat16] [--attention-backend triton] [--server-args "..."]
        [--checks greedy seeded float32] [--batch-sizes 1 4 16 64] [--new-tokens 64] [--out DIR]

On a host without network or SGLang, scripts/offline_gpu_check.sh runs it from a carried bundle
(scripts/offline_bundle.py).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support: random drafter, store

from sglang_dart.server_process import SglangServer, dart_flags, stop_servers_on_sigterm  # noqa: E402

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


# Servers whose failure is recorded and does not stop the check: the peer timed beside DART, and DART with
# its draft step eager (no CUDA graphs: the A/B of `sglang_dart/dart/device_graphs.py`).
OPTIONAL = ("eagle3", "dart-eager")
# The environment of each server that needs one.
SERVER_ENV = {"dart-eager": {"SGLANG_DART_DRAFT_GRAPHS": "0"}}


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


def _random_target_like(source: Path, out: Path, seed: int = 0) -> Path:
    """A model with `source`'s config and tokenizer and random weights, for a GPU host the real weights
    cannot reach. Embeddings are scaled up so greedy decoding is sharp, not a near-tie every step."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.suffix in (".json", ".txt", ".model", ".jinja") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 1.0 if "embed" in name else 0.05)
    model.save_pretrained(out, safe_serialization=True)
    return out


def _run(
    server: SglangServer, prompts: list[list[int]], params: dict, concurrency: int
) -> tuple[list, float]:
    """The outputs and the wall time of `prompts` served `concurrency` at a time."""
    start = time.perf_counter()
    outs = server.generate_many(prompts, params, concurrency, timeout=120)
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


def _margins_at_differences(
    server: SglangServer, prompts: list[list[int]], plain: list[dict], other: list[dict], new_tokens: int
) -> list[dict]:
    """For each output that differs from plain's: plain's margin there (its top-1 minus top-2 log-prob at
    the first differing position, asked again with logprobs) and whether the other output took plain's
    second choice. A correct verify departs from plain only at near-ties (a margin near rounding); a
    broken one departs at confident tokens."""
    found = []
    for ids, a, b in zip(prompts, plain, other, strict=True):
        x, y = a["output_ids"], b["output_ids"]
        if x == y:
            continue
        at = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), None)
        if at is None:
            continue  # one output is a prefix of the other: a length difference, no token to weigh
        out = server.generate(
            {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": min(at + 1, new_tokens), "temperature": 0.0,
                                    "ignore_eos": True},
                "return_logprob": True,
                "top_logprobs_num": 2,
            }
        )  # fmt: skip
        top = out["meta_info"]["output_top_logprobs"][at]
        found.append(
            {
                "at": at,
                "margin": top[0][0] - top[1][0],
                "replayed_same_token": top[0][1] == x[at],
                "other_took_second_choice": top[1][1] == y[at],
            }
        )
    return found


def _tau(outs: list[dict]) -> float:
    values = [o["meta_info"].get("spec_accept_length") for o in outs]
    values = [v for v in values if v]
    return sum(values) / len(values) if values else 1.0


def _servers_side_by_side(
    specs: dict[str, list[str]], args: argparse.Namespace, report: dict
) -> dict[str, SglangServer]:
    """Start the servers at once (a GPU holds them all; each sizes its KV pool from the memory free when
    it profiles, so --max-total-tokens keeps them from racing for it). An OPTIONAL server that fails to
    start is recorded and left out; any other failure stops them all."""
    servers = {
        name: SglangServer(args.model, extra, args.out / f"{name}.log", env=SERVER_ENV.get(name))
        for name, extra in specs.items()
    }

    def start(item: tuple[str, SglangServer]) -> BaseException | None:
        try:
            item[1].start(timeout=args.start_timeout)
        except Exception as exc:  # noqa: BLE001 - sorted below: optional servers may fail
            return exc
        return None

    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        failures = dict(zip(servers, pool.map(start, servers.items()), strict=True))
    for name, exc in failures.items():
        if exc is None:
            continue
        if name not in OPTIONAL:
            _stop(servers)
            raise exc
        _drop_optional(servers, report, name, exc)
    return servers


def _stop(servers: dict[str, SglangServer]) -> None:
    for server in servers.values():
        server.stop()


def _greedy_and_timings(
    args: argparse.Namespace, common: list[str], dart_args: list[str], report: dict
) -> None:
    """1 + 3: greedy parity and timings, servers side by side (a GPU holds all of them)."""
    greedy = {"max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
    prompts = _chat_ids(args.model, max(32, max(args.batch_sizes)))
    specs = {"plain": common, "dart": common + dart_args}
    if args.dart_eager:
        specs["dart-eager"] = common + dart_args
    if args.eagle3_draft:
        specs["eagle3"] = common + [
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", args.eagle3_draft,
            *shlex.split(args.eagle3_args),
        ]  # fmt: skip
    servers = _servers_side_by_side(specs, args, report)
    try:
        outs = _each(servers, report, lambda s: _run(s, prompts[:32], greedy, 8)[0])
        report["greedy_parity"] = _parity(outs["plain"], outs["dart"])
        # The yardstick for that figure: plain decoding against itself, one request at a time instead of
        # eight (other kernels and batch shapes, same model). A target whose greedy tokens are near-ties
        # in this dtype (random weights) differs from itself too.
        one_by_one = _run(servers["plain"], prompts[:32], greedy, 1)[0]
        report["plain_self_parity"] = _parity(outs["plain"], one_by_one)
        report["margins_at_differences"] = _margins_at_differences(
            servers["plain"], prompts[:32], outs["plain"], outs["dart"], args.new_tokens
        )
        report["plain_self_margins_at_differences"] = _margins_at_differences(
            servers["plain"], prompts[:32], outs["plain"], one_by_one, args.new_tokens
        )
        report["tau"] = _tau(outs["dart"])
        if "eagle3" in outs:
            report["eagle3_greedy_parity"] = _parity(outs["plain"], outs["eagle3"])
            report["eagle3_tau"] = _tau(outs["eagle3"])
        _save(args, report)
        timings: dict = {}
        for bs in args.batch_sizes:
            batch = prompts[: max(bs, 8)]

            def timed(server: SglangServer, batch: list = batch, bs: int = bs) -> tuple[list, float]:
                _run(server, batch[:bs], greedy, bs)  # warm-up at this batch size (graphs, caches)
                return _run(server, batch, greedy, bs)

            done = _each(servers, report, timed)
            row = {name: sum(len(o["output_ids"]) for o in out) / secs for name, (out, secs) in done.items()}
            timings[bs] = {name: {"tok_s": v, "vs_plain": v / row["plain"]} for name, v in row.items()}
            for name in done.keys() - {"plain"}:
                timings[bs][name]["tau"] = _tau(done[name][0])
            print(f"batch {bs}: " + ", ".join(f"{n} {v['tok_s']:.1f} tok/s ({v['vs_plain']:.2f}x)"
                                              for n, v in timings[bs].items()), flush=True)  # fmt: skip
            report["timings"] = timings
            _save(args, report)
    finally:
        dart = {name: server for name, server in servers.items() if name.startswith("dart")}
        report["draft_graphs"] = {name: _draft_graphs_seen(server) for name, server in dart.items()}
        _stop(servers)


def _draft_graphs_seen(server: SglangServer) -> dict:
    """What a DART server's log says of its draft graphs: the start-up line, and the captures serving
    paid for (shapes the start-up rehearsal did not cover) or a capture that failed."""
    lines = server.log_text().splitlines()
    return {
        "startup": next((line for line in lines if "DART: draft step graphs" in line), None),
        "captured_while_serving": sum("captured while serving" in line for line in lines),
        "failed": [line for line in lines if "graph failed" in line or "before serving failed" in line],
    }


def _each(servers: dict[str, SglangServer], report: dict, work):  # noqa: ANN001, ANN202
    """work(server) for each server, by name; an optional server that fails is recorded and stopped, and
    the others go on (a failure of any other server raises)."""
    results = {}
    for name in list(servers):
        try:
            results[name] = work(servers[name])
        except Exception as exc:  # noqa: BLE001 - optional servers may fail
            if name not in OPTIONAL:
                raise
            _drop_optional(servers, report, name, exc)
    return results


def _drop_optional(servers: dict[str, SglangServer], report: dict, name: str, exc: Exception) -> None:
    """An OPTIONAL server failed (to start, or to serve): stop it, record why, go on without it."""
    servers.pop(name).stop()
    report.setdefault("errors", {})[name] = repr(exc)[:2000]
    print(f"{name} failed ({exc!r}); going on without it", flush=True)


def _greedy_parity(
    args: argparse.Namespace,
    label: str,
    flags: list[str],
    dart_args: list[str],
    report: dict,
    prompts: int,
    concurrency: int,
    more=None,  # noqa: ANN001 - more(plain server, prompts, plain outputs, DART outputs), while both are up
) -> None:
    """A plain and a DART server on `flags`, side by side: greedy outputs on `prompts` chat prompts, reported
    as `{label}_greedy_parity` and DART's `{label}_tau`."""
    greedy = {"max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
    ids = _chat_ids(args.model, prompts)
    plain, dart = f"plain-{label}", f"dart-{label}"
    servers = _servers_side_by_side({plain: flags, dart: flags + dart_args}, args, report)
    try:
        outs = {name: _run(s, ids, greedy, concurrency)[0] for name, s in servers.items()}
        report[f"{label}_greedy_parity"] = _parity(outs[plain], outs[dart])
        if more is not None:
            more(servers[plain], ids, outs[plain], outs[dart])
        report[f"{label}_tau"] = _tau(outs[dart])
    finally:
        _stop(servers)


def _float32_parity(args: argparse.Namespace, common: list[str], dart_args: list[str], report: dict) -> None:
    """Greedy parity in float32, where a near-tie rounding differently between a one-row decode and an
    N-row verify is rare enough that every output should match. On CUDA SGLang 0.5.17's RMSNorm
    (sgl_kernel) has no float32 kernel (plain serving fails there too, seen on an H200); under
    --enable-deterministic-inference SGLang runs its batch-invariant/native RMSNorm instead."""
    import torch

    f32 = [a if a != args.dtype else "float32" for a in common]
    if torch.cuda.is_available():
        f32 += ["--enable-deterministic-inference"]

    def margins(plain, prompts: list, plain_outs: list, dart_outs: list) -> None:  # noqa: ANN001
        report["float32_margins_at_differences"] = _margins_at_differences(
            plain, prompts, plain_outs, dart_outs, args.new_tokens
        )

    _greedy_parity(args, "float32", f32, dart_args, report, prompts=32, concurrency=8, more=margins)


def _seeded_sampling(args: argparse.Namespace, common: list[str], dart_args: list[str], report: dict) -> None:
    """2: seeded sampling under deterministic inference (a GPU option: SGLang refuses it on CPU backends):
    a request's sampling_seed draws the same tokens under DART as under plain decoding."""
    seeded = common + ["--enable-deterministic-inference"]
    if "--attention-backend" not in seeded:
        seeded += ["--attention-backend", "flashinfer"]
    prompts = _chat_ids(args.model, 16)
    sampled = [
        {"max_new_tokens": 32, "temperature": 0.8, "top_p": 0.95, "sampling_seed": seed, "ignore_eos": True}
        for seed in range(16)
    ]
    servers = _servers_side_by_side({"plain-seeded": seeded, "dart-seeded": seeded + dart_args}, args, report)
    try:
        runs = {
            name: server.generate_many(prompts, sampled, concurrency=1) for name, server in servers.items()
        }
        report["seeded_sampling_parity"] = _parity(runs["plain-seeded"], runs["dart-seeded"])
    finally:
        _stop(servers)


def _fp8_target(args: argparse.Namespace, common: list[str], dart_args: list[str], report: dict) -> None:
    """An fp8 target (SGLang's online --quantization fp8, a GPU option): DART serves it with its drafter
    unquantized, and greedy output against plain fp8 decoding is reported (bf16 activations: near-ties)."""
    fp8 = common + ["--quantization", "fp8"]
    _greedy_parity(args, "fp8_target", fp8, dart_args, report, prompts=16, concurrency=4)


def _stage(name: str, report: dict, args: argparse.Namespace, fn, *fn_args) -> None:  # noqa: ANN001
    """Run one check; a failure is recorded in the report (with its traceback) and the next check runs."""
    import traceback

    start = time.perf_counter()
    try:
        fn(*fn_args, report)
    except Exception:  # noqa: BLE001 - every failure is reported, none stops the other checks
        report.setdefault("errors", {})[name] = traceback.format_exc()[-4000:]
        print(f"{name} FAILED:\n{report['errors'][name]}", flush=True)
    report.setdefault("stage_seconds", {})[name] = round(time.perf_counter() - start, 1)
    _save(args, report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path)
    parser.add_argument(
        "--random-target-like",
        type=Path,
        help="a model dir: the target takes its config and tokenizer, with random weights",
    )
    parser.add_argument("--draft")
    parser.add_argument("--store")
    parser.add_argument("--eagle3-draft", help="an EAGLE3 drafter: a third server, timed beside DART")
    parser.add_argument(
        "--eagle3-args",
        default="--speculative-num-steps 3 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8",
        help="the EAGLE3 server's settings (default: the best of peers runs 8-9 on CPU)",
    )
    parser.add_argument(
        "--dart-eager", action="store_true", help="a DART server with its draft step eager, timed beside"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", help="for every server (default: SGLang's; DART's on DART)")
    parser.add_argument("--server-args", default="", help="more flags for every server, one string")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--checks", nargs="+", default=["greedy", "seeded"],
                        choices=["greedy", "float32", "seeded", "fp8-target"])  # fmt: skip
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    args = parser.parse_args(argv)
    stop_servers_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.random_target_like is not None:
        args.model = _random_target_like(args.random_target_like, args.out / "random-target")
    elif args.model is None:
        from sglang_dart.assets import smollm2_dir

        args.model = smollm2_dir()
    draft, store = _assets(args)
    common = [
        "--dtype", args.dtype,
        "--random-seed", "0",
        "--max-running-requests", str(max(args.batch_sizes)),
        *(["--attention-backend", args.attention_backend] if args.attention_backend else []),
        *shlex.split(args.server_args),
    ]  # fmt: skip
    dart_args = [
        *dart_flags(draft, store),
        "--speculative-num-draft-tokens", str(args.num_draft_tokens),
    ]  # fmt: skip
    report: dict = {"model": str(args.model), "dtype": args.dtype, "draft": str(draft), "store": str(store),
                    "server_args": common}  # fmt: skip
    report.update(_device_facts())
    _save(args, report)
    import torch

    checks = {"greedy": _greedy_and_timings, "float32": _float32_parity, "seeded": _seeded_sampling,
              "fp8-target": _fp8_target}  # fmt: skip
    gpu_only = {"seeded": "seeded_sampling_parity", "fp8-target": "fp8_target_greedy_parity"}  # report keys
    for name in args.checks:
        if name in gpu_only and not torch.cuda.is_available():
            report[gpu_only[name]] = "skipped: no CUDA device"
            continue
        _stage(name, report, args, checks[name], args, common, dart_args)
    return _finish(args, report)


def _device_facts() -> dict:
    import torch

    facts = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
    try:
        import sglang

        facts["sglang"] = sglang.__version__
    except ImportError:
        pass
    return facts


def _save(args: argparse.Namespace, report: dict) -> None:
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))


def _finish(args: argparse.Namespace, report: dict) -> int:
    """Write the report; fail when a check failed or fewer than 80% of bf16 greedy outputs equal plain's
    (bf16 rounding aside, a broken verify path departs in nearly every output)."""
    _save(args, report)
    summary = (
        "greedy_parity",
        "plain_self_parity",
        "tau",
        "eagle3_greedy_parity",
        "eagle3_tau",
        "float32_greedy_parity",
        "float32_margins_at_differences",
        "float32_tau",
        "seeded_sampling_parity",
        "fp8_target_greedy_parity",
        "fp8_target_tau",
        "errors",
    )
    print(json.dumps({k: report[k] for k in summary if k in report}, indent=2)[:6000])
    parity = report.get("greedy_parity")
    if report.get("errors") or parity is None:
        return 1
    return 0 if parity["identical"] >= 0.8 * parity["of"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
