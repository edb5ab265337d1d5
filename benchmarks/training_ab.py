"""Trainer settings side by side: the same features, the same steps, the held-out τ estimate of each.

    .venv/bin/python benchmarks/training_ab.py --target SMOLLM2 --data answers.jsonl \
        [--sequences 700] [--steps 250] [--dtype bfloat16] --soft-weights 0,0.5,1.0

The target's features (taps, argmax and top-16 labels) are computed once for a seeded sample of the data's
sequences; 10% of them are held out. Each setting then trains a fresh drafter from the same seed and is
scored by `estimate_acceptance` on the held-out sequences (top-1 chain τ and the top-8 bound), so the
settings differ in their loss alone. A short run ranks settings early in training only; say so with its
figures.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from sglang_dart.train import conversations
from sglang_dart.train.checkpoint import draft_config_dict, new_drafter
from sglang_dart.train.estimate import estimate_acceptance, split_holdout
from sglang_dart.train.feature_cache import FeatureCache
from sglang_dart.train.features import SOFT_LABELS, collect_features, load_target
from sglang_dart.train.trainer import TrainSettings, train
from sglang_dart.train.vocab import most_frequent_vocab


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, type=Path)
    p.add_argument("--data", required=True, type=Path, help="any format `python -m sglang_dart.train` reads")
    p.add_argument("--sequences", type=int, default=700)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--soft-weights", default="0,0.5,1.0", help="comma-separated --soft-weight values")
    p.add_argument("--feature-cache", type=Path, default=None, help="as `python -m sglang_dart.train`'s")
    args = p.parse_args()

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    data = conversations.read_sequences(args.data, tokenizer, 1024)
    pairs = list(zip(data.ids, data.answer_starts, strict=True))
    random.Random(0).shuffle(pairs)
    sequences = [ids for ids, _ in pairs[: args.sequences]]
    starts = [start for _, start in pairs[: args.sequences]]
    target = load_target(args.target, getattr(torch, args.dtype))
    started = time.monotonic()
    cache = None
    if args.feature_cache is not None:
        cache = FeatureCache(args.feature_cache, args.target, target.dtype, target.config.num_hidden_layers)
    feats = collect_features(target, sequences, False, SOFT_LABELS, cache, starts)
    feats, held_out = split_holdout(feats, 0.1)
    seconds = time.monotonic() - started
    print(f"features of {len(feats)} + {len(held_out)} held-out sequences in {seconds:.0f}s", flush=True)
    vocab = most_frequent_vocab([f.answer_labels() for f in feats], target.config.vocab_size, 8192)
    config = draft_config_dict(target.config.to_dict(), 7, vocab.size)
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.get_output_embeddings().weight.detach()
    for weight in (float(w) for w in args.soft_weights.split(",")):
        model = new_drafter(config, embed, lm_head, vocab, seed=0)
        settings = TrainSettings(max_steps=args.steps, soft_weight=weight, log_every=0, progress_bar=False)
        started = time.monotonic()
        losses = train(model, feats, vocab, settings, log=lambda _: None)
        estimate = estimate_acceptance(model, held_out, vocab)
        summary = "no held-out anchor" if estimate is None else estimate.describe()
        print(
            f"soft weight {weight}: {len(losses)} steps in {time.monotonic() - started:.0f}s, "
            f"loss {sum(losses[-20:]) / len(losses[-20:]):.3f}; {summary}",
            flush=True,
        )


if __name__ == "__main__":
    main()
