"""What a drafter would accept, estimated offline on sequences it was not trained on.

For an anchor p (the last verified position) the drafter's rows predict the target's greedy tokens at
p+1, p+2, ...; greedy verification of a chain (the top-1 token of every row) accepts the leading rows that
are right, plus the target's own next token: tau_chain = 1 + (number of leading rows right). With the k
best tokens of each row in the tree, a row counts while the target's token is among its k best: an upper
bound on what a tree of k per depth could accept (the pruner keeps <= 60 of those paths, so real trees sit
between the two). Both are means over the anchors of the held-out sequences' answers (a prompt's positions
are never drafted when serving, and a chat template's fixed system prompt would flatter the figures).

Only the target's own answers are counted where the held-out slice has any. On text it did not write
(documents, another model's answers) a row's label past the first departure from the target's greedy
choice is the target's guess after text a served chain never holds, so its hits and misses say nothing
about serving; such sequences are skipped and counted. A slice with none of the target's answers is read
whole, as a proxy, and the estimate says so.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from sglang_dart.drafter.model import DartDrafter
from sglang_dart.train.blocks import block_logits
from sglang_dart.train.features import SequenceFeatures
from sglang_dart.train.trainer import bf16_autocast as autocast_on
from sglang_dart.train.trainer import sample_anchors
from sglang_dart.train.vocab import DraftVocab


@dataclass(frozen=True)
class AcceptEstimate:
    sequences: int
    anchors: int
    top1_by_row: list[float]  # accuracy of each draft row (row 0: the token after the root)
    tau_chain: float  # mean tokens per step verifying the top-1 chain
    tau_topk_bound: float  # mean tokens per step if each depth offered its k best tokens
    k: int
    not_target_written: int = 0  # held-out sequences skipped: text the target did not write
    target_text_only: bool = True  # False: no held-out answer was the target's, all were read (a proxy)

    def describe(self) -> str:
        rows = " ".join(f"{a:.2f}" for a in self.top1_by_row)
        return (
            f"held-out {self.sequences} sequences, {self.anchors} anchors: top-1 by row [{rows}]; "
            f"estimated tau {self.tau_chain:.2f} (top-1 chain), at most {self.tau_topk_bound:.2f} "
            f"(top-{self.k} per depth){text_caveat(self.not_target_written, self.target_text_only)}"
        )


# A greedy answer of the target keeps to the feature pass's argmax almost everywhere (the generating engine
# and the feature pass round near-ties apart now and then); a document keeps to it at well under half.
TARGET_WRITTEN_SHARE = 0.9


def target_written(feats: SequenceFeatures) -> bool:
    """Whether the sequence's answer is the target's own greedy text: at least TARGET_WRITTEN_SHARE of its
    tokens are the target's argmax after the text before them."""
    first = feats.first_anchor()
    follows = feats.input_ids[first + 1 :] == feats.labels[first : feats.input_ids.shape[0] - 1]
    return follows.numel() > 0 and float(follows.float().mean()) >= TARGET_WRITTEN_SHARE


def estimated_sequences(data: list[SequenceFeatures]) -> tuple[list[SequenceFeatures], int, bool]:
    """(the sequences an estimate reads, how many it skips, whether they are the target's text only): the
    target's own answers where the slice has any, otherwise all of it."""
    own = [f for f in data if target_written(f)]
    if own:
        return own, len(data) - len(own), True
    return list(data), 0, False


def text_caveat(skipped: int, target_text_only: bool) -> str:
    if not target_text_only:
        return " (no held-out answer is the target's own text: read as a proxy)"
    return f" ({skipped} held-out sequences the target did not write skipped)" if skipped else ""


def split_holdout(
    data: list[SequenceFeatures], fraction: float, seed: int = 0
) -> tuple[list[SequenceFeatures], list[SequenceFeatures]]:
    """(train, held out): a seeded share of the sequences, at least one when there are 10 or more and the
    fraction is positive, none otherwise (a tiny data set is all needed for training)."""
    if fraction <= 0 or len(data) < 10:
        return list(data), []
    count = max(1, int(len(data) * fraction))
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    held = set(order[:count])
    return [f for i, f in enumerate(data) if i not in held], [f for i, f in enumerate(data) if i in held]


def _leading_hits(hits: torch.Tensor) -> torch.Tensor:
    """[A, rows] bool -> [A] number of leading True per row."""
    return hits.int().cumprod(dim=1).sum(dim=1)


class AcceptTally:
    """Sums what a drafter's guesses would accept, one held-out sequence at a time, for the DART, EAGLE3
    and DFLASH estimates alike: row j of an anchor is its guess j + 1 tokens ahead (a DFLASH block's
    position j + 1), and a chain accepts rows 0, 1, ... while they are right."""

    def __init__(self, rows: int, k: int) -> None:
        self.k = k
        self.correct = torch.zeros(rows)
        self.anchors = 0
        self.sequences = 0
        self.chain_total = 0.0
        self.bound_total = 0.0

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """logits [A, rows, V], labels [A, rows] (negative: no label, a miss) of one sequence's anchors."""
        top1 = (logits.argmax(dim=-1) == labels) & (labels >= 0)
        best = logits.topk(min(self.k, logits.shape[-1]), dim=-1).indices
        in_topk = (best == labels.unsqueeze(-1)).any(dim=-1) & (labels >= 0)
        self.correct += top1.float().sum(dim=0).cpu()
        self.anchors += labels.shape[0]
        self.chain_total += float((1 + _leading_hits(top1)).sum())
        self.bound_total += float((1 + _leading_hits(in_topk)).sum())
        self.sequences += 1

    def estimate(self, skipped: int, target_text_only: bool) -> AcceptEstimate | None:
        """None when no anchor was added."""
        if not self.anchors:
            return None
        return AcceptEstimate(
            sequences=self.sequences,
            anchors=self.anchors,
            top1_by_row=(self.correct / self.anchors).tolist(),
            tau_chain=self.chain_total / self.anchors,
            tau_topk_bound=self.bound_total / self.anchors,
            k=self.k,
            not_target_written=skipped,
            target_text_only=target_text_only,
        )


@torch.no_grad()
def estimate_acceptance(
    model: DartDrafter,
    data: list[SequenceFeatures],
    vocab: DraftVocab,
    k: int = 8,
    max_anchors_per_sequence: int = 64,
    bf16_autocast: bool = True,
    seed: int = 0,
) -> AcceptEstimate | None:
    """None when no held-out sequence has an anchor."""
    was_training = model.training
    model.eval()
    rng = random.Random(seed)
    d = model.cfg.draft_length
    device = model.fc.weight.device
    vocab = vocab.to(device)
    tally = AcceptTally(d + 1, k)
    data, skipped, own_text = estimated_sequences(data)
    try:
        for feats in data:
            num_real = feats.input_ids.shape[0] - 1
            # Anchors whose d + 1 rows all have a label (the window ends inside the sequence): a run cut
            # short by the sequence's end would count as a miss.
            first = feats.first_anchor()
            if num_real - d <= first:
                continue
            anchors = sample_anchors(num_real - d, max_anchors_per_sequence, rng, first).to(device)
            feats = feats.to(device)
            with autocast_on(bf16_autocast, device):
                taps = feats.taps[:num_real].to(model.fc.weight.dtype)
                out = block_logits(model, taps, feats.input_ids[1:], anchors, real_rows=anchors)
            rows = torch.cat([out.real.unsqueeze(1), out.masks], dim=1).float()  # [A, d + 1, Vd]
            rows_ahead = torch.arange(d + 1, device=device)
            label_index = anchors.unsqueeze(1) + 1 + rows_ahead  # row j: the token at p + 1 + j
            tally.add(rows, vocab.to_draft(feats.labels[label_index]))  # -100: outside the draft vocabulary
    finally:
        model.train(was_training)
    return tally.estimate(skipped, own_text)
