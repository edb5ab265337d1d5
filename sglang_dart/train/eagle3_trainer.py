"""Training an EAGLE3 drafter with training-time test (EAGLE-3's recipe): every step unrolls the drafter
`ttt_steps` times over a window of one of the target's own sequences (`Eagle3Drafter.ttt_logits`), each
unrolled step fed the hidden state the previous one produced, with a cross-entropy against the target's
greedy token on each, weighted gamma^step. Progress lines and the learning-rate schedule are the DART
trainer's (`trainer.py`)."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch
from torch import nn

from sglang_dart.train.eagle3_model import Eagle3Drafter
from sglang_dart.train.estimate import AcceptEstimate, AcceptTally, estimated_sequences
from sglang_dart.train.features import SequenceFeatures
from sglang_dart.train.trainer import RowStats, TrainSettings, bucketed, fit, pad_rows, top1_hits
from sglang_dart.train.trainer import bf16_autocast as autocast_on
from sglang_dart.train.vocab import DraftVocab


@dataclass(frozen=True)
class Window:
    """Draft position p (0-based in the window) carries taps[p] and tokens[p] and is supervised by
    labels[p] (the target's greedy token two places after the tap's position). A chain of unrolled steps
    starts at a position from `first_origin` on (the sequence's answer: a prompt is never drafted)."""

    taps: torch.Tensor  # [n, 3H]
    tokens: torch.Tensor  # [n]
    labels: torch.Tensor  # [n] draft ids, -100 outside the draft vocabulary
    first_origin: int = 0

    def to(self, device: torch.device | str) -> Window:
        """The window's tensors on `device`: a step moves its window, not its whole sequence."""
        return replace(
            self, taps=self.taps.to(device), tokens=self.tokens.to(device), labels=self.labels.to(device)
        )


def window_of(feats: SequenceFeatures, vocab: DraftVocab, start: int, length: int) -> Window:
    """Position p of the sequence: taps of p, token p + 1, label = the target's argmax at p + 1. Position p
    is DART's anchor p (the root x_{p+1} follows it), so chains start from `feats.first_anchor()` on."""
    end = min(start + length, feats.input_ids.shape[0] - 1)
    return Window(
        feats.taps[start:end],
        feats.input_ids[start + 1 : end + 1],
        vocab.to_draft(feats.labels[start + 1 : end + 1]),
        max(feats.first_anchor() - start, 0),
    )


def padded_window(window: Window) -> Window:
    """The window followed by filler positions up to a bucketed count (`trainer.bucketed`): their labels
    are -100, and no real position attends to a later one."""
    count = bucketed(window.tokens.shape[0])
    return replace(
        window,
        taps=pad_rows(window.taps, count),
        tokens=pad_rows(window.tokens, count),
        labels=pad_rows(window.labels, count, -100),
    )


def step_rows(
    logits: list[torch.Tensor], window: Window, trimmed: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, labels) of the positions each unrolled step k is defined at: p >= k, and its chain's origin
    p - k from the window's first origin on. `trimmed`: the logits already start there
    (`ttt_logits(..., supervised_from=window.first_origin)`)."""
    skip = window.first_origin
    return [
        (step_logits if trimmed else step_logits[k + skip :], window.labels[k + skip :])
        for k, step_logits in enumerate(logits)
    ]


def window_loss(
    model: Eagle3Drafter, window: Window, steps: int, decay: float
) -> tuple[torch.Tensor, RowStats]:
    taps = window.taps.to(model.fc.weight.dtype)
    logits = model.ttt_logits(taps, window.tokens, steps, supervised_from=window.first_origin)
    stats = RowStats()
    losses, weights = [], []
    for k, (rows, labels) in enumerate(step_rows(logits, window, trimmed=True)):
        keep = labels >= 0
        if not bool(keep.any()):
            continue
        rows, labels = rows[keep].float(), labels[keep]
        losses.append(nn.functional.cross_entropy(rows, labels) * decay**k)
        weights.append(decay**k)
        stats.add(k, int(top1_hits(rows, labels).sum()), int(labels.shape[0]))
    if not losses:
        return logits[0].sum() * 0.0, stats
    return torch.stack(losses).sum() / sum(weights), stats


def train(
    model: Eagle3Drafter,
    data: list[SequenceFeatures],
    vocab: DraftVocab,
    settings: TrainSettings,
    ttt_steps: int,
    window: int,
    log=print,
) -> list[float]:
    """Train in place; returns every step's loss. Each sequence contributes one window of `window`
    positions from a random start, unrolled `ttt_steps` times."""
    usable = [f for f in data if f.input_ids.shape[0] >= ttt_steps + 2]
    if not usable:
        raise SystemExit(
            f"no training sequence has the {ttt_steps + 2} tokens {ttt_steps} unrolled steps need"
        )

    device = model.fc.weight.device

    def sequence_step(
        feats: SequenceFeatures, rng: random.Random, row_decay: float
    ) -> tuple[torch.Tensor, RowStats]:
        first = rng.randrange(max(1, feats.input_ids.shape[0] - 1 - window + 1))
        win = padded_window(window_of(feats, vocab, first, window)).to(device)
        return window_loss(model, win, ttt_steps, row_decay)

    return fit(model, usable, settings, sequence_step, log, unit="step")


@torch.no_grad()
def estimate_acceptance(
    model: Eagle3Drafter,
    data: list[SequenceFeatures],
    vocab: DraftVocab,
    ttt_steps: int,
    k: int = 8,
    window: int = 1024,
    bf16_autocast: bool = True,
) -> AcceptEstimate | None:
    """Greedy chain acceptance on held-out sequences, every anchor a whose ttt_steps drafts all have a
    label: step j's guess at position a + j against the target's token there; tau = 1 + the leading
    right guesses (the target's own token always comes along), on the target's own answers where the
    slice has any (`estimate.estimated_sequences`). None when no sequence is long enough."""
    was_training = model.training
    model.eval()
    device = model.fc.weight.device
    tally = AcceptTally(ttt_steps, k)
    data, skipped, own_text = estimated_sequences(data)
    try:
        for feats in data:
            win = window_of(feats, vocab, 0, window).to(device)
            n = win.tokens.shape[0]
            count = n - ttt_steps + 1 - win.first_origin
            if count <= 0:
                continue
            taps = win.taps.to(model.fc.weight.dtype)
            with autocast_on(bf16_autocast, device):
                logits = model.ttt_logits(taps, win.tokens, ttt_steps, supervised_from=win.first_origin)
            a = win.first_origin + torch.arange(count, device=device)
            # step j's logits start at row first_origin + j, so anchor a's guess is row a - first_origin
            rows = torch.stack([logits[j][:count].float() for j in range(ttt_steps)], dim=1)  # [A, steps, Vd]
            labels = torch.stack([win.labels[a + j] for j in range(ttt_steps)], dim=1)
            tally.add(rows, labels)
    finally:
        model.train(was_training)
    return tally.estimate(skipped, own_text)
