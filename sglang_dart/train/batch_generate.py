"""Training answers written by the target on a machine with an accelerator but no SGLang (a lent GPU host):
Magpie prompts the target samples itself, then its greedy answers, in batches through transformers.

    python -m sglang_dart.train.batch_generate --target DIR --out data.jsonl --magpie N
        [--magpie-system TEXT ...] [--exclude-file PROMPTS.txt] [--exclude-data FILES ...] [--device cuda]
        [--dtype float32] [--batch-size 512] [--max-new-tokens 256] [--max-seconds S] [--seed 0]

Rows are what `python -m sglang_dart.train.generate` writes ({prompt, input_ids, prompt_len, text}; an answer
that finished ends with its stop token), and prompts are screened as there (`magpie.py`: empty, short,
overlong, degenerate, template markup, excluded, duplicate). Each `--magpie-system` frames an equal share
of the prompts (and of the time for them): several framings, several kinds of user turn. `--exclude-data`
keeps out the prompts of earlier answer files too, so that new rows add prompts, not repeats.

The answers are computed in float32 by default: a left-padded bf16 batch breaks the target's near-ties
otherwise than one sequence alone does (SmolLM2, 4 of 6 answers parted within 48 tokens), float32 did
not (6 of 6 equal). The trainer labels every position with the target's own argmax anyway, so a parted
answer would only shift the contexts the drafter learns from.

Rows are appended to OUT as they are answered, and sampled prompts to OUT.magpie.jsonl as they are kept: a
run stopped by `--max-seconds` or a kill keeps what it finished, and a second run answers the prompts the
first sampled but did not answer before sampling only the rest of its --magpie (prompts in OUT, answered,
are never sampled again).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sglang_dart.jsonl import iter_jsonl
from sglang_dart.train import magpie
from sglang_dart.train.generate import _read_rows, answer_row, chat_prompt_ids, stop_token_ids

# A sampled user turn as generate.py samples it through SGLang.
MAGPIE_SAMPLING = {"temperature": 1.0, "top_p": 0.99, "max_new_tokens": 96}
BARREN_BATCHES = 8


@torch.inference_mode()
def continue_batch(
    model: Any,
    prompts: list[list[int]],
    stop_ids: set[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    pad_id: int | None = None,
) -> list[tuple[list[int], bool]]:
    """Each prompt's continuation (up to and including its first stop token) and whether it stopped, from one
    left-padded `generate` over the batch (greedy at temperature 0). The padding is masked out, so any
    token does; by default the smallest stop id."""
    pad = min(stop_ids) if pad_id is None else pad_id
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, longest - len(prompt) :] = 1
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        max_new_tokens=max_new_tokens,
        eos_token_id=sorted(stop_ids),
        pad_token_id=pad,
        **sampling,
    )
    results = []
    for row in out[:, longest:].tolist():
        end = next((i for i, token in enumerate(row) if token in stop_ids), None)
        results.append((row, False) if end is None else (row[: end + 1], True))
    return results


def sample_prompts(
    model: Any,
    tokenizer: Any,
    count: int,
    stop_ids: set[int],
    exclude: set[str],
    batch_size: int,
    deadline: float,
    system: str | None = None,
    on_kept: Callable[[str], None] | None = None,
) -> tuple[list[str], Counter]:
    """Up to `count` distinct user turns the target writes after its chat template's user-turn prefix,
    screened as `magpie.sample_prompts` screens a server's; sampling stops at `deadline` (time.monotonic).
    `on_kept` is called with each prompt as it is kept (the caller saves it)."""
    prefix = magpie.user_turn_prefix(tokenizer, system)
    screen = magpie.Screen(tokenizer, exclude)
    kept: list[str] = []
    barren = 0  # batches in a row that kept nothing: a target whose turns all fail the screen ends here
    while len(kept) < count and time.monotonic() < deadline and barren < BARREN_BATCHES:
        rows = continue_batch(
            model, [prefix] * batch_size, stop_ids, MAGPIE_SAMPLING["max_new_tokens"],
            MAGPIE_SAMPLING["temperature"], MAGPIE_SAMPLING["top_p"],
        )  # fmt: skip
        before = len(kept)
        for tokens, stopped in rows:
            text = tokenizer.decode(tokens[:-1] if stopped else tokens, skip_special_tokens=True)
            finish = {"type": "stop" if stopped else "length"}
            prompt = screen.keep({"text": text, "meta_info": {"finish_reason": finish}})
            if prompt is not None and len(kept) < count:
                kept.append(prompt)
                if on_kept is not None:
                    on_kept(prompt)
        barren = barren + 1 if len(kept) == before else 0
    return kept, screen.skipped


def answer_rows(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    stop_ids: set[int],
    batch_size: int,
    max_new_tokens: int,
    deadline: float,
) -> Any:
    """Yield the target's greedy answer to each prompt as a generate.py row, in batches of similar
    prompt length; no batch starts after `deadline`."""
    templated = [(prompt, chat_prompt_ids(tokenizer, prompt)) for prompt in prompts]
    templated.sort(key=lambda item: len(item[1]))
    for at in range(0, len(templated), batch_size):
        if time.monotonic() >= deadline:
            return
        batch = templated[at : at + batch_size]
        answers = continue_batch(model, [ids for _, ids in batch], stop_ids, max_new_tokens)
        for (prompt, ids), (tokens, _) in zip(batch, answers, strict=True):
            yield answer_row(tokenizer, prompt, ids, tokens)


def _known_prompts(paths: list[Path]) -> set[str]:
    """The prompts of earlier answer files (.jsonl or .jsonl.gz), those of OUT included."""
    known = set()
    for path in paths:
        if path.exists():
            rows = iter_jsonl(path)
            known |= {row["prompt"] for _, row in rows if isinstance(row, dict) and "prompt" in row}
    return known


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m sglang_dart.train.batch_generate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--target", required=True, type=Path, help="target model directory (HF layout)")
    p.add_argument("--out", required=True, type=Path, help="output .jsonl (appended to)")
    p.add_argument("--magpie", required=True, type=int, help="prompts the target writes, then answers")
    p.add_argument(
        "--magpie-system",
        action="append",
        default=None,
        help="system prompt framing the sampled user turns; repeat for several framings, each an equal share",
    )
    p.add_argument("--exclude-file", type=Path, default=None, help="prompts (one per line) to keep out")
    p.add_argument(
        "--exclude-data", type=Path, nargs="*", default=[], help="answer files whose prompts to keep out"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batch-size", type=int, default=512, help="sequences per generate call")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-seconds", type=float, default=None, help="start no batch after this long")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.magpie < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
        p.error("--magpie, --batch-size and --max-new-tokens must be >= 1")
    started = time.monotonic()
    deadline = started + (args.max_seconds if args.max_seconds is not None else float("inf"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.target)
    except (OSError, ValueError) as exc:
        p.error(f"--target {args.target}: no tokenizer to load ({exc})")
    if not getattr(tokenizer, "chat_template", None):
        p.error(f"{args.target}: the tokenizer has no chat template to put prompts in")
    systems = args.magpie_system or [None]
    try:
        for system in systems:
            magpie.user_turn_prefix(tokenizer, system)
    except ValueError as exc:
        p.error(f"--magpie: {exc}")
    try:
        exclude = set(args.exclude_file.read_text().splitlines()) if args.exclude_file else set()
        exclude |= _known_prompts([*args.exclude_data, args.out])
    except (OSError, ValueError) as exc:
        p.error(f"prompts to keep out: {exc}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    stops = stop_token_ids(tokenizer, args.target)
    # Prompts sampled by an earlier run and not answered yet (its side file) are answered first.
    side = args.out.with_name(args.out.name + ".magpie.jsonl")
    prompts = _unanswered_prompts(side, exclude)
    if prompts:
        print(f"magpie: {len(prompts)} prompts of an earlier run still to answer", file=sys.stderr)
    to_sample = max(0, args.magpie - len(prompts))
    # Half the time for prompts at most (a run cut short still answers what it sampled), shared by framings.
    with side.open("a") as saved:

        def keep(prompt: str) -> None:
            saved.write(json.dumps(prompt) + "\n")
            saved.flush()

        sampled: list[str] = []
        for share, system in enumerate(systems, 1):
            wanted = to_sample * share // len(systems) - len(sampled)
            share_deadline = started + (deadline - started) / 2 * share / len(systems)
            kept, skipped = sample_prompts(
                model, tokenizer, wanted, stops, exclude | set(prompts) | set(sampled), args.batch_size,
                share_deadline, system, keep,
            )  # fmt: skip
            sampled += kept
            print(
                f"magpie: {len(kept)} prompts framed by {system!r:.40} after "
                f"{time.monotonic() - started:.0f}s (skipped: {dict(skipped)})",
                file=sys.stderr,
                flush=True,
            )
    prompts += sampled
    count = tokens = 0
    with args.out.open("a") as f:
        for row in answer_rows(
            model, tokenizer, prompts, stops, args.batch_size, args.max_new_tokens, deadline
        ):
            f.write(json.dumps(row) + "\n")
            f.flush()  # a kill loses at most the batch in flight
            count += 1
            tokens += len(row["input_ids"]) - row["prompt_len"]
            if count % args.batch_size == 0:
                seconds = time.monotonic() - started
                print(f"answers: {count}/{len(prompts)} ({seconds:.0f}s)", file=sys.stderr, flush=True)
    left = len(prompts) - count
    if not left:
        side.unlink(missing_ok=True)  # every sampled prompt is answered in OUT
    print(
        f"wrote {count} conversations ({tokens} generated tokens) to {args.out} "
        f"in {time.monotonic() - started:.0f}s"
        + (f"; {left} sampled prompts left in {side.name}: run again to answer them" if left else "")
    )


def _unanswered_prompts(side: Path, answered: set[str]) -> list[str]:
    """The prompts an earlier run saved in `side` (its complete lines) that are not in `answered`; the file
    is rewritten to hold just those."""
    if not side.exists():
        return []
    prompts = list(dict.fromkeys(p for p in _read_rows(side) if isinstance(p, str) and p not in answered))
    side.write_text("".join(json.dumps(prompt) + "\n" for prompt in prompts))
    return prompts


if __name__ == "__main__":
    main()
