"""Regenerate training conversations with the target itself, through a real SGLang server.

    python -m sglang_dart.train.generate --target DIR --out data.jsonl [--num-prompts N]
        [--max-new-tokens 256] [--concurrency 16] [--dtype auto] [--exclude-file PROMPTS.txt]
        [--temperature 0.0] [--samples-per-prompt 1]

Each output line is {"prompt": str, "input_ids": [...], "prompt_len": int, "text": str}: the chat-templated
prompt followed by the target's answer (greedy by default). A drafter trained on the target's own outputs
learns what the verifier will accept; `text` feeds `python -m sglang_dart.ngram build` for the 3-gram store.
Sampled answers (`--temperature > 0`, several per prompt) add variety from a fixed prompt list: the trainer
labels every position with the target's argmax anyway, so sampling changes the contexts, not the targets.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

from sglang_dart.train.conversations import read_prompts, templated_ids
from sglang_dart.train.prompts import training_prompts


def chat_prompt_ids(tokenizer, prompt: str | list[dict[str, str]]) -> list[int]:
    """The chat-templated ids of a prompt: one user turn, or a conversation ending with a user turn."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return templated_ids(tokenizer, messages, add_generation_prompt=True)


def generate(
    target: Path,
    prompts: list[str] | list[list[dict[str, str]]],
    max_new_tokens: int,
    concurrency: int,
    log_dir: Path,
    dtype: str = "auto",
    temperature: float = 0.0,
) -> Iterator[dict]:
    """Yield one row per prompt, in prompt order, as soon as it and every row before it are answered."""
    from transformers import AutoTokenizer

    from sglang_dart.server_process import SglangServer

    tokenizer = AutoTokenizer.from_pretrained(target)
    server = SglangServer(
        target,
        ["--max-running-requests", str(concurrency), "--dtype", dtype],
        log_dir / "generate-server.log",
    )
    try:  # started inside the try: a SIGTERM while it boots must stop it too
        server.start()
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature}

        def one(prompt: str | list[dict[str, str]]) -> dict:
            ids = chat_prompt_ids(tokenizer, prompt)
            out = server.generate({"input_ids": ids, "sampling_params": params}, timeout=3600)
            full = ids + [int(t) for t in out["output_ids"]]
            return {
                "prompt": prompt if isinstance(prompt, str) else prompt[-1]["content"],
                "input_ids": full,
                "prompt_len": len(ids),
                "text": tokenizer.decode(full),
            }

        pool = ThreadPoolExecutor(max_workers=concurrency)
        try:
            yield from pool.map(one, prompts)
        finally:  # an interrupted run stops now: queued prompts are dropped, the server stop ends the rest
            pool.shutdown(wait=False, cancel_futures=True)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m sglang_dart.train.generate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--target", required=True, type=Path, help="target model directory (HF layout)")
    p.add_argument("--out", required=True, type=Path, help="output .jsonl")
    p.add_argument("--num-prompts", type=int, default=None, help="default: every prompt of the pool")
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="prompts to answer instead of the built-in pool: .txt (one per line) or .jsonl of "
        "{prompt}, OpenAI {messages} or ShareGPT {conversations} (answered after the last user turn)",
    )
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="target dtype, as the server that will use the drafter")
    p.add_argument("--exclude-file", type=Path, default=None, help="prompts (one per line) to keep out")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers")
    p.add_argument("--samples-per-prompt", type=int, default=1, help="answers per prompt (with sampling)")
    args = p.parse_args(argv)
    if args.temperature < 0 or args.samples_per_prompt < 1:
        p.error("--temperature must be >= 0 and --samples-per-prompt >= 1")
    if args.samples_per_prompt > 1 and args.temperature == 0:
        p.error("--samples-per-prompt > 1 needs --temperature > 0 (greedy answers would repeat)")
    exclude = set(args.exclude_file.read_text().splitlines()) if args.exclude_file else set()
    if args.prompts is not None:
        try:
            turns, skipped = read_prompts(args.prompts)
        except (OSError, ValueError) as exc:
            p.error(str(exc))
        turns = [t for t in turns if t[-1]["content"] not in exclude]
        if skipped:
            print(f"{args.prompts}: skipped {sum(skipped.values())} rows ({dict(skipped)})", file=sys.stderr)
        if not turns:
            p.error(f"{args.prompts} holds no prompts")
        prompts = turns[: args.num_prompts]
    else:
        prompts = training_prompts(args.num_prompts, seed=args.seed, exclude=exclude)
    prompts = prompts * args.samples_per_prompt
    # Rows go to a side file as they arrive, so an interrupted run keeps what it generated; the output
    # path only ever holds a complete run.
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_name(args.out.name + ".partial")
    count = tokens = 0
    # The server runs in its own session; a plain SIGTERM would end this process and leave it running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        with partial.open("w") as f:
            answers = generate(
                args.target,
                prompts,
                args.max_new_tokens,
                args.concurrency,
                args.out.parent,  # the server's log stays beside the data: a failed run keeps its cause
                args.dtype,
                args.temperature,
            )
            with closing(answers) as rows:  # on any error the server stops here
                for row in rows:
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    count += 1
                    tokens += len(row["input_ids"]) - row["prompt_len"]
    except BaseException:
        print(
            f"stopped after {count} of {len(prompts)} conversations; they are in {partial}; "
            f"the server's log is {args.out.parent / 'generate-server.log'}",
            file=sys.stderr,
        )
        raise
    partial.replace(args.out)
    print(f"wrote {count} conversations ({tokens} generated tokens) to {args.out}")


if __name__ == "__main__":
    main()
