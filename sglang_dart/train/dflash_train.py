"""DFLASH's anchor-block loss, its training loop and its held-out acceptance estimate.

An anchor s (1 <= s < T) stands for a verify step whose last accepted token is x_s: the drafter sees the
target's hidden states at positions < s and the block [x_s, mask, ..., mask]; block position j >= 1 is
trained towards the target's greedy token at s + j, i.e. its argmax at position s + j - 1 (`labels`).
Position j is weighted gamma^(j-1): a draft at j only counts when every one before it was accepted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

from sglang_dart.train import trainer
from sglang_dart.train.dflash_model import DFlashDrafter
from sglang_dart.train.estimate import AcceptTally, estimated_sequences, text_caveat
from sglang_dart.train.features import SequenceFeatures
from sglang_dart.train.trainer import RowStats, TrainSettings, fit, top1_hits
from sglang_dart.train.trainer import bf16_autocast as autocast_on

LOG_SECONDS = 15.0


@dataclass(frozen=True)
class FrozenTarget:
    """What the drafter borrows from the target: its input embedding and LM head (never trained)."""

    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]


@dataclass
class BlockLoss:
    loss: torch.Tensor
    stats: RowStats  # top-1 per block position (row 0 = block position 1)


def block_logits(
    model: DFlashDrafter,
    target: FrozenTarget,
    feats: SequenceFeatures,
    anchors: torch.Tensor,
    block: int,
    mask_id: int,
) -> torch.Tensor:
    """[A, block-1, V] logits of block positions 1..block-1 for the anchors (positions >= 1; given on the
    host, their largest is read without waiting on the device)."""
    seen = int(anchors.max())  # no block sees the context at or after its own anchor
    anchors = anchors.to(feats.input_ids.device)
    ids = torch.full((anchors.shape[0], block), mask_id, dtype=torch.long, device=anchors.device)
    ids[:, 0] = feats.input_ids[anchors]
    # Context rows padded to a bucketed count (`trainer.bucketed`): no block sees them (each sees the
    # context before its anchor), and the products keep a few row counts.
    taps = trainer.pad_rows(feats.taps[:seen].to(model.fc.weight.dtype), trainer.bucketed(seen))
    hidden = model(target.embed[ids], anchors, taps)
    # The LM head in float32 outside autocast: on CPUs without AMX a bf16 product of this size (rows x the
    # whole vocabulary) ran several times slower than float32, and it is most of a step's work.
    # A 2-D product: a batched one against the broadcast head was slower on CPU, forward and backward.
    # (On a GPU the product stays under CUDA autocast: bf16 is what its matrix units are fast at.)
    with torch.autocast("cpu", enabled=False):
        rows = hidden[:, 1:].float()
        return (rows.reshape(-1, rows.shape[-1]) @ target.lm_head.T).view(*rows.shape[:2], -1)


def block_labels(feats: SequenceFeatures, anchors: torch.Tensor, block: int) -> torch.Tensor:
    """[A, block-1] target greedy token for block positions 1..block-1; -100 past the sequence's end."""
    anchors = anchors.to(feats.labels.device)
    index = anchors.unsqueeze(1) + torch.arange(block - 1, device=anchors.device)  # s + j - 1 drafts s + j
    inside = index < feats.labels.shape[0]
    return torch.where(inside, feats.labels[index.clamp(max=feats.labels.shape[0] - 1)], -100)


def block_loss(
    model: DFlashDrafter,
    target: FrozenTarget,
    feats: SequenceFeatures,
    anchors: torch.Tensor,
    block: int,
    mask_id: int,
    decay: float,
) -> BlockLoss:
    logits = block_logits(model, target, feats, anchors, block, mask_id)
    labels = block_labels(feats, anchors, block)
    # One cross-entropy over every row (per-position slices of the logits cost a full-size zero gradient
    # each in backward), then a mean per block position.
    flat = logits.reshape(-1, logits.shape[-1])
    losses = nn.functional.cross_entropy(flat, labels.reshape(-1), ignore_index=-100, reduction="none")
    losses = losses.view(labels.shape)
    hits = top1_hits(logits, labels)
    stats = RowStats()
    total, weights = logits.new_zeros(()), 0.0
    for j in range(block - 1):
        keep = labels[:, j] >= 0
        count = int(keep.sum())
        if not count:
            continue
        total = total + losses[keep, j].mean() * decay**j
        weights += decay**j
        stats.add(j, int(hits[:, j].sum()), count)
    return BlockLoss(total / weights, stats)


def sample_anchors(length: int, count: int, rng: random.Random, first: int = 0) -> torch.Tensor:
    """Sorted anchors in [max(1, first), length): every block has at least one earlier position as context,
    and none starts before `first` (the sequence's answer; anchor s is DART's anchor s)."""
    return trainer.sample_anchors(length, count, rng, max(1, first))


def train(
    model: DFlashDrafter,
    target: FrozenTarget,
    data: list[SequenceFeatures],
    settings: TrainSettings,
    block: int,
    mask_id: int,
    log=print,
) -> list[float]:
    """Train in place; returns every step's loss. Logs loss, top-1 per block position and the ETA."""
    usable = [f for f in data if f.input_ids.shape[0] >= 2]
    if not usable:
        raise ValueError("no training sequence has the 2 tokens an anchor block needs")

    device = model.fc.weight.device

    def sequence_step(
        feats: SequenceFeatures, rng: random.Random, row_decay: float
    ) -> tuple[torch.Tensor, RowStats]:
        length = feats.input_ids.shape[0]
        anchors = sample_anchors(length, settings.anchors_per_sequence, rng, feats.first_anchor())
        result = block_loss(model, target, feats.to(device), anchors, block, mask_id, row_decay)
        return result.loss, result.stats

    # A CPU step of the full-vocabulary head can take seconds: a run must show its loss and ETA long
    # before `log_every` of them.
    return fit(model, usable, settings, sequence_step, log, log_seconds=LOG_SECONDS)


@dataclass(frozen=True)
class BlockEstimate:
    sequences: int
    anchors: int
    top1_by_position: list[float]  # block positions 1..B-1
    tau: float  # mean tokens per verify step: 1 + leading correct drafts
    not_target_written: int = 0  # held-out sequences skipped: text the target did not write
    target_text_only: bool = True  # False: no held-out answer was the target's, all were read (a proxy)

    def describe(self) -> str:
        rows = " ".join(f"{a:.2f}" for a in self.top1_by_position)
        caveat = text_caveat(self.not_target_written, self.target_text_only)
        return (
            f"held-out {self.sequences} sequences, {self.anchors} anchor blocks: top-1 by block position "
            f"[{rows}]; estimated tau {self.tau:.2f} (tokens per verify step, greedy){caveat}"
        )


@torch.no_grad()
def estimate_acceptance(
    model: DFlashDrafter,
    target: FrozenTarget,
    data: list[SequenceFeatures],
    block: int,
    mask_id: int,
    max_anchors_per_sequence: int = 64,
    bf16_autocast: bool = True,
    seed: int = 0,
) -> BlockEstimate | None:
    """Greedy chain verification of each anchor block: accepted = leading block positions whose draft is the
    target's token, plus the target's own token. Only blocks whose every position has a label count (one cut
    short by the sequence's end would count as a miss), on the target's own answers where the slice has
    any (`estimate.estimated_sequences`). None when no held-out sequence has such a block."""
    rng = random.Random(seed)
    device = model.fc.weight.device
    tally = AcceptTally(block - 1, k=1)  # SGLang's DFLASH verifies one chain: no wider bound to report
    data, skipped, own_text = estimated_sequences(data)
    model.eval()
    for feats in data:
        length = feats.input_ids.shape[0] - block + 2  # anchors s < length have labels up to s + block - 2
        if length <= max(1, feats.first_anchor()):
            continue
        anchors = sample_anchors(length, max_anchors_per_sequence, rng, feats.first_anchor())
        feats = feats.to(device)
        with autocast_on(bf16_autocast, device):
            logits = block_logits(model, target, feats, anchors, block, mask_id)
        tally.add(logits.float(), block_labels(feats, anchors, block))
    found = tally.estimate(skipped, own_text)
    if found is None:
        return None
    return BlockEstimate(
        found.sequences, found.anchors, found.top1_by_row, found.tau_chain, skipped, own_text
    )
