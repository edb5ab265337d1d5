"""What the drafter learns from: the target's taps and its greedy choice at every position.

The taps are the hidden states entering target layers 2, L//2 and L-3 (what SGLang's EAGLE3 capture hands
the drafter at serving time; `hidden_states[i]` in HF is the input of layer i). The label at position q is
the target's argmax there, i.e. the token greedy verification accepts after position q. Beside it: the
target's K most likely tokens there and their probabilities (its distribution, truncated), soft labels
that tell the drafter what else the target found likely, not only which token won.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_dart.train.feature_cache import FeatureCache


def tap_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


@dataclass
class SequenceFeatures:
    input_ids: torch.Tensor  # [T]
    taps: torch.Tensor  # [T, 3·H]
    labels: torch.Tensor  # [T] target argmax at each position (predicts the token after it)
    soft_ids: torch.Tensor | None = None  # [T, K] the target's K most likely tokens there
    soft_probs: torch.Tensor | None = None  # [T, K] their probabilities (bf16)
    answer_start: int = 0  # index of the first answer token: anchors before it are never served

    def first_anchor(self) -> int:
        """The first real position an anchor may sit at: the one predicting the answer's first token."""
        return min(max(self.answer_start - 1, 0), max(self.input_ids.shape[0] - 2, 0))

    def to(self, device: torch.device | str) -> SequenceFeatures:
        """The same features with every tensor on `device` (stored on the host, moved per training step)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return SequenceFeatures(
            move(self.input_ids),
            move(self.taps),
            move(self.labels),
            move(self.soft_ids),
            move(self.soft_probs),
            self.answer_start,
        )

    def answer_labels(self) -> torch.Tensor:
        """The labels a drafter learns from (row 0 at the first anchor on): what a draft vocabulary should
        cover, without the prompt's."""
        return self.labels[self.first_anchor() + 1 :]


# Soft labels kept per position: 96 bytes a position, under 3% of the taps of a 576-wide target.
SOFT_LABELS = 16


def load_target(target_dir: Path | str, dtype: torch.dtype | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=dtype or "auto")
    return model.eval()


def sequence_features(target, input_ids: list[int], soft_labels: int = 0) -> SequenceFeatures:
    """One sequence's features: `batch_features` of a batch of one."""
    return batch_features(target, [input_ids], soft_labels)[0]


@torch.inference_mode()
def batch_features(target, sequences: list[list[int]], soft_labels: int = 0) -> list[SequenceFeatures]:
    """The features of several sequences from one forward (an accelerator's way: one sequence at a time
    leaves it idle between kernel launches), kept on the host (a run's features outgrow an accelerator's
    memory) and moved per step when training. They are right-padded: under causal attention a real
    position only sees positions before it, all of its own sequence, so its taps and label are what its
    sequence alone gives, up to the rounding of differently shaped products."""
    longest = max(len(ids) for ids in sequences)
    ids = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    out = target(input_ids=ids.to(target.device), output_hidden_states=True, use_cache=False)
    layers = tap_layers(target.config.num_hidden_layers)
    taps = torch.cat([out.hidden_states[i] for i in layers], dim=-1).to(torch.bfloat16).cpu()
    labels = out.logits.argmax(-1).cpu()
    soft_ids = soft_probs = None
    if soft_labels > 0:
        top = torch.softmax(out.logits.float(), dim=-1).topk(min(soft_labels, out.logits.shape[-1]), dim=-1)
        soft_ids, soft_probs = top.indices.to(torch.int32).cpu(), top.values.to(torch.bfloat16).cpu()
    feats = []
    for row, seq in enumerate(sequences):
        n = len(seq)
        feats.append(
            SequenceFeatures(
                ids[row, :n].clone(),
                taps[row, :n].clone(),
                labels[row, :n].clone(),
                None if soft_ids is None else soft_ids[row, :n].clone(),
                None if soft_probs is None else soft_probs[row, :n].clone(),
            )
        )
    return feats


def _length_batches(indices: list[int], sequences: list[list[int]], batch_tokens: int) -> list[list[int]]:
    """`indices` grouped for `batch_features`: by length, so that little is padding, each group's padded
    size (rows x longest) within `batch_tokens`; 0 gives one sequence a group, in the order given."""
    if batch_tokens <= 0:
        return [[i] for i in indices]
    groups: list[list[int]] = []
    for i in sorted(indices, key=lambda i: len(sequences[i])):
        group = groups[-1] if groups else None
        if group is None or (len(group) + 1) * len(sequences[i]) > batch_tokens:
            groups.append([i])
        else:
            group.append(i)
    return groups


def collect_features(
    target,
    sequences: list[list[int]],
    progress: bool = True,
    soft_labels: int = 0,
    cache: FeatureCache | None = None,
    answer_starts: list[int] | None = None,
    batch_tokens: int = 0,
) -> list[SequenceFeatures]:
    """Every sequence's features, read from `cache` where it has them (and written to it where not), each
    with its `answer_starts` entry (0, every position, where none is given). `batch_tokens` > 0 computes
    the missing ones in length-sorted batches of at most that many padded tokens (`batch_features`)."""
    starts = answer_starts if answer_starts is not None else [0] * len(sequences)
    if len(starts) != len(sequences):
        raise ValueError(f"{len(starts)} answer starts for {len(sequences)} sequences")
    feats: list[SequenceFeatures | None] = [None] * len(sequences)
    missing = []
    for i, ids in enumerate(sequences):
        feats[i] = None if cache is None else cache.get(ids, soft_labels)
        if feats[i] is None:
            missing.append(i)
    done = len(sequences) - len(missing)
    for group in _length_batches(missing, sequences, batch_tokens):
        computed = batch_features(target, [sequences[i] for i in group], soft_labels)
        for i, one in zip(group, computed, strict=True):
            if cache is not None:
                cache.put(one)
            feats[i] = one
        before, done = done, done + len(group)
        if progress and done // 50 > before // 50:
            print(f"features: {done}/{len(sequences)} sequences", flush=True)
    for one, start in zip(feats, starts, strict=True):
        one.answer_start = start
    if progress and cache is not None:
        print(cache.counts.describe(), flush=True)
    return feats  # type: ignore[return-value]  # every entry was filled above
