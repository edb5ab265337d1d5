"""The main job: serve SmolLM2-135M-Instruct with DART on this machine (CPU when there is no GPU), using the
drafter and 3-gram store shipped in the package, stream one answer as it is generated, then answer the same
prompt with plain decoding and report, from this run: tokens per second of both, DART's tokens per verify
step (τ) and whether the two texts are identical.

Run: `python -m sglang_dart.demo [--prompt TEXT] [--max-tokens N] [--dtype auto|bfloat16|float32]
[--plain-only] [--draft DIR --store FILE]`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import requests

from sglang_dart.assets import shipped_smollm2_drafter, smollm2_dir
from sglang_dart.dart.settings import resolve_dtype
from sglang_dart.server_process import (
    SglangServer,
    dart_flags,
    default_device_args,
    serving,
    stop_servers_on_sigterm,
)

DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: int
    seconds: float
    verify_steps: int  # 0 without speculation

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def stream_answer(server: SglangServer, prompt: str, max_tokens: int, echo: bool) -> Answer:
    """Greedy answer through SGLang's streaming /generate (the chat template applied by the server's
    OpenAI layer would hide the verify count): the text as it grows, then the final counts."""
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0},
        "stream": True,
    }
    shown, last = "", {}
    start = time.perf_counter()
    with requests.post(f"{server.url}/generate", json=body, stream=True, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            last = json.loads(line[len(b"data:") :])
            if echo:
                sys.stdout.write(last["text"][len(shown) :])
                sys.stdout.flush()
            shown = last["text"]
    seconds = time.perf_counter() - start
    meta = last.get("meta_info", {})
    return Answer(shown, int(meta.get("completion_tokens", 0)), seconds, int(meta.get("spec_verify_ct", 0)))


def chat_prompt(model: Path, question: str) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def first_difference(a: str, b: str) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_dart.demo", description=__doc__)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--plain-only", action="store_true", help="serve without speculation, as before")
    parser.add_argument("--draft", type=Path, help="draft checkpoint (default: the shipped SmolLM2 drafter)")
    parser.add_argument("--store", type=Path, help="3-gram store (default: the shipped one)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="auto (default): bfloat16 where it is fast (a GPU, or a CPU with AMX or AVX512-BF16), float32 "
        "elsewhere; bfloat16: on a CPU without AMX both servers run every bf16 product on the Rust kernel "
        "(row-invariant), so the texts are equal; elsewhere they may round a product differently (a verify "
        "step's where torch's products take trees), so the texts may part; float32: greedy DART output is "
        "the target's, token for token",
    )
    args = parser.parse_args(argv)
    stop_servers_on_sigterm()

    dtype = resolve_dtype(args.dtype)
    model = smollm2_dir(dtype)
    logs = Path(tempfile.mkdtemp(prefix="sglang-dart-demo-"))
    prompt = chat_prompt(model, args.prompt)
    print(f"model: {model} ({dtype})\nserver logs: {logs}\n\n> {args.prompt}\n", flush=True)
    answer = partial(_answer, prompt=prompt, max_tokens=args.max_tokens)
    if args.plain_only:
        with _servers(model, {"plain": []}, logs, dtype) as servers:
            plain = answer(servers["plain"], echo=True)
        rate = plain.tokens_per_second
        print(f"\n\n[plain: {plain.tokens} tokens in {plain.seconds:.2f} s, {rate:.1f} tok/s]")
        return

    shipped_draft, shipped_store = shipped_smollm2_drafter()
    draft, store = args.draft or shipped_draft, args.store or shipped_store
    print(f"DART drafter: {draft}\n3-gram store: {store}\n", flush=True)
    with _servers(model, {"dart": dart_flags(draft, store), "plain": []}, logs, dtype) as servers:
        dart = answer(servers["dart"], echo=True)
        servers["dart"].stop()  # its memory back before plain decoding is timed
        print("\n\n(now the same prompt with plain decoding, for comparison)", flush=True)
        plain = answer(servers["plain"], echo=False)
    print(report(dart, plain, dtype))


@contextmanager
def _servers(
    model: Path, flags: dict[str, list[str]], logs: Path, dtype: str
) -> Iterator[dict[str, SglangServer]]:
    """A started server per entry of `flags` (its log: logs/NAME.log), all stopped on the way out. On the
    CPU engine they start side by side: a start-up is mostly single-threaded imports, and the CPU engine's
    KV pool is small. On a GPU one after the other: each would claim SGLang's static share of its memory."""
    env = _row_invariant_env(dtype)
    servers = {
        name: SglangServer(model, [*args, "--dtype", dtype], logs / f"{name}.log", env=env)
        for name, args in flags.items()
    }
    with serving(servers, start=bool(default_device_args())):
        yield servers


def _row_invariant_env(dtype: str) -> dict[str, str | None]:
    """The servers' environment: in bf16 on the CPU engine, where the Rust product takes bf16 linears (no
    AMX), the row-invariant setting (`skinny_gemm.rust_only`), so that the prompt's prefill rounds as the
    decode and verify steps do and DART's text is plain's token for token, as in float32. It costs the
    short prompt's prefill a few milliseconds; decoding at batch 1 runs level (throughput.md, run 125).
    A setting of the user's is kept; AMX CPUs (torch's tile products, not measured against the Rust one
    there) and GPUs keep the default."""
    from sglang_dart.cpu import skinny_gemm

    if dtype != "bfloat16" or not default_device_args() or skinny_gemm.ENV in os.environ:
        return {}
    return {skinny_gemm.ENV: "rust"} if skinny_gemm.bf16_kernel_pays() else {}


def _answer(server: SglangServer, *, prompt: str, max_tokens: int, echo: bool) -> Answer:
    """The timed answer to `prompt`, after a short untimed one (first-request set-up is not decoding speed);
    a server not started yet (GPU) is started first."""
    if not server.alive():
        server.start()
    stream_answer(server, "Hello", 4, echo=False)
    return stream_answer(server, prompt, max_tokens, echo)


def report(dart: Answer, plain: Answer, dtype: str) -> str:
    tau = dart.tokens / dart.verify_steps if dart.verify_steps else float("nan")
    diff = first_difference(dart.text, plain.text)
    same = "yes" if diff is None else f"no (first difference at character {diff})"
    if diff is not None and dtype != "float32":
        same += (
            f"; in {dtype} the two servers rounded a product differently (a verify step's, where torch's "
            "products take trees): --dtype float32 gives the target's text token for token"
        )
    return "\n".join(
        [
            "",
            "| decoding | tokens | seconds | tokens/s |",
            "|---|---|---|---|",
            f"| plain | {plain.tokens} | {plain.seconds:.2f} | {plain.tokens_per_second:.1f} |",
            f"| DART | {dart.tokens} | {dart.seconds:.2f} | {dart.tokens_per_second:.1f} |",
            "",
            f"DART / plain: {dart.tokens_per_second / plain.tokens_per_second:.2f}x"
            if plain.tokens_per_second
            else "DART / plain: n/a",
            f"tokens per verify step (tau): {tau:.2f}",
            f"identical text: {same}",
        ]
    )


if __name__ == "__main__":
    main()
