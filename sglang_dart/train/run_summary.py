"""What every format's command (`python -m sglang_dart.train --format dart|eagle3|dflash`) shares around
its own training loop: the training settings read from the command line, and the report saved beside the
drafter (`train_report.json`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sglang_dart.train.features import SequenceFeatures
from sglang_dart.train.trainer import TrainSettings

# Anchor blocks per sequence when --anchors is not given. DART: 32, which beat 64 in served tokens per step
# by about 2% over two seeds at an equal 20-minute budget (benchmarks/results/acceptance.md, run 20); DFLASH
# keeps the 64 it was measured with. EAGLE3 trains on whole windows and has none.
DEFAULT_ANCHORS = {"dart": TrainSettings.anchors_per_sequence, "dflash": 64}

# γ, the loss weight's ratio from one row (or step) to the next, when --row-decay is not given. DART: 0.5,
# which beat 0.8 from scratch over two seeds (held-out τ +5%, served tokens per step +2-4%; peers.md runs 29
# and 31) and was level in a continuation of the shipped drafter (acceptance.md, run 15). EAGLE3 and DFLASH
# keep the 0.8 they were measured with.
DEFAULT_ROW_DECAY = {"dart": 0.5}


def row_decay_of(args: argparse.Namespace) -> float:
    """`--row-decay` if given, else the format's default."""
    if args.row_decay is not None:
        return args.row_decay
    return DEFAULT_ROW_DECAY.get(args.format, TrainSettings.row_decay)


def settings_from_args(args: argparse.Namespace, **overrides: Any) -> TrainSettings:
    """The common options as `TrainSettings`; a format overrides what it sets its own way."""
    anchors = args.anchors if args.anchors is not None else DEFAULT_ANCHORS.get(args.format, 64)
    values: dict[str, Any] = {
        "anchors_per_sequence": anchors,
        "sequences_per_step": args.sequences_per_step,
        "learning_rate": args.lr,
        "max_steps": args.max_steps,
        "max_seconds": args.max_minutes * 60 if args.max_minutes else float("inf"),
        "row_decay": row_decay_of(args),
        "row_decay_final": args.row_decay_final,
        "soft_weight": args.soft_weight,
        "feature_noise": args.feature_noise,
        "greedy_chains_only": args.greedy_chains_only,
        "bf16_autocast": args.bf16,
        "seed": args.seed,
    }
    return TrainSettings(**{**values, **overrides})


def announce_saved(losses: list[float], seconds: float, out: Path) -> None:
    print(f"trained {len(losses)} steps in {seconds:.0f}s; final loss {losses[-1]:.3f}; saved {out}")


def report(
    args: argparse.Namespace,
    losses: list[float],
    seconds: float,
    train: list[SequenceFeatures],
    held_out: list[SequenceFeatures],
    estimate: Any,
    **fields: Any,
) -> dict:
    """The run's report: the format's own `fields` first, then steps, time, loss, data counts, the
    held-out estimate (None where no held-out sequence was long enough) and every argument."""
    return {
        **fields,
        "steps": len(losses),
        "seconds": round(seconds, 1),
        "final_loss": losses[-1],
        "train_sequences": len(train),
        "held_out_sequences": len(held_out),
        "held_out": None if estimate is None else estimate.__dict__,
        "data": str(args.data),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
