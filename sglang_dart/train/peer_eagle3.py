"""Train a EAGLE3 drafter in the layout SGLang's builtin EAGLE3 worker loads (`--format eagle3`).

    python -m sglang_dart.train --format eagle3 --target DIR --data data.jsonl --out DRAFT_DIR
        [--eagle3-ttt-steps 4] [--eagle3-window 512] [--draft-vocab-size 8192] [--max-minutes M] ...

Serve the result with `--speculative-algorithm EAGLE3 --speculative-draft-model-path DRAFT_DIR`
(on CPU: --speculative-eagle-topk 1, --speculative-num-steps S, --speculative-num-draft-tokens S + 1).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from sglang_dart.train import eagle3_checkpoint, eagle3_trainer, run_summary
from sglang_dart.train.stop_signal import stop_requested
from sglang_dart.train.vocab import most_frequent_vocab


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """Options of this format only, each named --eagle3-..."""
    group.add_argument(
        "--eagle3-ttt-steps",
        type=int,
        default=4,
        help="unrolled drafting steps per training window (training-time test); serve with at most this "
        "many --speculative-num-steps for the deeper drafts to be trained",
    )
    group.add_argument(
        "--eagle3-window", type=int, default=512, help="positions per training window (attention is O(n^2))"
    )


def train_and_save(
    args: argparse.Namespace, target: Any, feats: list, held_out: list, device: torch.device
) -> dict:
    """Build the drafter from the (host) target, train it on `device`, save it from the host."""
    if args.eagle3_ttt_steps < 1 or args.eagle3_window < 2:
        raise SystemExit("--eagle3-ttt-steps must be >= 1 and --eagle3-window >= 2")
    vocab_size = target.config.vocab_size
    if args.init:
        model, config, vocab = eagle3_checkpoint.load(args.init, target)
    else:
        vocab = most_frequent_vocab([f.answer_labels() for f in feats], vocab_size, args.draft_vocab_size)
        model, config = eagle3_checkpoint.new_drafter(target, vocab, seed=args.seed)
    print(
        f"EAGLE3 drafter: draft vocabulary {vocab.size}, {args.eagle3_ttt_steps} unrolled steps, "
        f"windows of {args.eagle3_window}",
        flush=True,
    )
    model.to(device)  # with the target's embedding (a buffer); the features move per step
    settings = run_summary.settings_from_args(args)  # anchors: unused (whole windows)
    started = time.monotonic()
    losses = eagle3_trainer.train(
        model,
        feats,
        vocab,
        settings,
        args.eagle3_ttt_steps,
        args.eagle3_window,
        log=lambda s: print(s, flush=True),
    )
    seconds = time.monotonic() - started
    eagle3_checkpoint.save(model, config, vocab, args.out)
    run_summary.announce_saved(losses, seconds, args.out)
    estimate = None  # a run stopped by a signal saves and goes, before a second signal ends it
    if not stop_requested():
        estimate = eagle3_trainer.estimate_acceptance(
            model, held_out, vocab, args.eagle3_ttt_steps, bf16_autocast=args.bf16
        )
    if estimate is not None:
        print(estimate.describe().replace("by row", "by step"), flush=True)
    return run_summary.report(
        args,
        losses,
        seconds,
        feats,
        held_out,
        estimate,
        format="eagle3",
        ttt_steps=args.eagle3_ttt_steps,
        draft_vocab_size=vocab.size,
    )
