"""DART training steps a second, a step's sequences through one packed forward (what training runs) against
one sequence at a time, in the same process on the same features, rounds alternating.

    .venv/bin/python benchmarks/train_step.py --target DIR --data answers.jsonl[.gz] [--device cpu|cuda]
        [--sequences 64] [--sequences-per-step 4] [--steps 10] [--rounds 3] [--target-dtype bfloat16]

The features of the first --sequences answers are computed once; each round times --steps optimizer steps
of each mode (the same drafter, AdamW, bf16 autocast where training would use it), after one warm-up step.
Prints sequences a second per mode and round, and the median ratio of the rounds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from sglang_dart.train import run_summary
from sglang_dart.train.__main__ import (
    ACCELERATOR_FEATURE_BATCH_TOKENS,
    DEFAULT_DRAFT_VOCAB,
    make_parser,
    read_sequences,
)
from sglang_dart.train.checkpoint import draft_config_dict, new_drafter
from sglang_dart.train.features import collect_features, load_target
from sglang_dart.train.trainer import RowStats, _step_backward, bf16_autocast_pays, dart_steps
from sglang_dart.train.vocab import most_frequent_vocab


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, type=Path)
    p.add_argument("--data", required=True, type=Path)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--sequences-per-step", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--target-dtype", default="bfloat16")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    train_args = make_parser().parse_args(
        ["--target", str(args.target), "--data", str(args.data), "--out", "unused", "--device", args.device,
         "--sequences-per-step", str(args.sequences_per_step)]
    )  # fmt: skip
    train_args.bf16 = device.type == "cuda" or bf16_autocast_pays()
    settings = run_summary.settings_from_args(train_args)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    data = read_sequences(args.data, tokenizer, 1024)
    sequences, starts = data.ids[: args.sequences], data.answer_starts[: args.sequences]
    target = load_target(args.target, getattr(torch, args.target_dtype)).to(device)
    batch_tokens = 0 if device.type == "cpu" else ACCELERATOR_FEATURE_BATCH_TOKENS
    started = time.monotonic()
    feats = collect_features(
        target, sequences, progress=False, answer_starts=starts, batch_tokens=batch_tokens
    )
    print(f"features of {len(feats)} sequences in {time.monotonic() - started:.0f}s on {device}")
    target = target.cpu()
    labels = [f.answer_labels() for f in feats]
    vocab = most_frequent_vocab(labels, target.config.vocab_size, DEFAULT_DRAFT_VOCAB)
    config = draft_config_dict(target.config.to_dict(), train_args.draft_length, vocab.size)
    model = new_drafter(
        config,
        target.get_input_embeddings().weight.detach(),
        target.get_output_embeddings().weight.detach(),
        vocab,
    )
    model.to(device)
    model.embed_tokens = model.embed_tokens.to(device)
    sequence_step, batch_step = dart_steps(model, vocab, settings)
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    usable = [f for f in feats if f.input_ids.shape[0] >= 3]

    def timed(packed: bool, seed: int) -> float:
        rng = random.Random(seed)
        order = list(range(len(usable)))
        rng.shuffle(order)
        _sync(device)
        started = time.perf_counter()
        for step in range(args.steps + 1):
            if step == 1:  # the first step warms up
                _sync(device)
                started = time.perf_counter()
            batch = [usable[order[(step * settings.sequences_per_step + i) % len(order)]]
                     for i in range(settings.sequences_per_step)]  # fmt: skip
            optimizer.zero_grad(set_to_none=True)
            packing = batch_step if packed else None
            _step_backward(batch, settings, device, sequence_step, rng, RowStats(), packing)
            optimizer.step()
        _sync(device)
        return args.steps * settings.sequences_per_step / (time.perf_counter() - started)

    ratios = []
    for r in range(args.rounds):
        modes = [True, False] if r % 2 == 0 else [False, True]
        rates = {packed: timed(packed, seed=r) for packed in modes}
        ratios.append(rates[True] / rates[False])
        print(
            f"round {r + 1}: packed {rates[True]:.1f} sequences/s, one at a time {rates[False]:.1f} "
            f"({ratios[-1]:.2f}x)",
            flush=True,
        )
    print(f"packed / one at a time, median of {args.rounds} rounds: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
