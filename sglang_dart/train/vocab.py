"""The draft vocabulary: the target tokens the drafter may propose, and the `d2t` offsets that map a draft
id back to a target id (target = draft + d2t[draft], the EAGLE3/SpecForge convention)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftVocab:
    target_ids: torch.Tensor  # [Vd] ascending target ids
    t2d: torch.Tensor  # [V] draft id of each target id, -1 where absent

    @classmethod
    def of(cls, target_ids: torch.Tensor, vocab_size: int) -> DraftVocab:
        """The vocabulary of these (ascending) target ids."""
        t2d = torch.full((vocab_size,), -1, dtype=torch.int64)
        t2d[target_ids] = torch.arange(target_ids.shape[0])
        return cls(target_ids, t2d)

    def to(self, device: torch.device | str) -> DraftVocab:
        return DraftVocab(self.target_ids.to(device), self.t2d.to(device))

    @property
    def size(self) -> int:
        return int(self.target_ids.shape[0])

    @property
    def d2t(self) -> torch.Tensor:
        return self.target_ids - torch.arange(self.size)

    def to_draft(self, target_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        draft = self.t2d[target_ids]
        return torch.where(draft >= 0, draft, torch.full_like(draft, ignore_index))


def most_frequent_vocab(labels: list[torch.Tensor], vocab_size: int, draft_vocab_size: int) -> DraftVocab:
    """The `draft_vocab_size` most frequent label tokens (the whole vocabulary if it is not smaller)."""
    if draft_vocab_size >= vocab_size:
        ids = torch.arange(vocab_size)
    else:
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for lab in labels:
            counts += torch.bincount(lab, minlength=vocab_size)
        ids = torch.sort(torch.topk(counts, draft_vocab_size, sorted=False).indices).values
    return DraftVocab.of(ids, vocab_size)


def vocab_from_d2t(d2t: torch.Tensor, vocab_size: int) -> DraftVocab:
    """The draft vocabulary of an existing checkpoint."""
    return DraftVocab.of(torch.arange(d2t.shape[0]) + d2t.to(torch.int64), vocab_size)


def grown_vocab(vocab: DraftVocab, labels: list[torch.Tensor], draft_vocab_size: int) -> DraftVocab:
    """`vocab` plus the label tokens it lacks, most frequent first, up to `draft_vocab_size` ids. Ties and
    tokens the labels never use go by ascending id: a BPE vocabulary lists its commoner merges first."""
    vocab_size = vocab.t2d.shape[0]
    if not vocab.size <= draft_vocab_size <= vocab_size:
        raise ValueError(
            f"a draft vocabulary of {vocab.size} can grow to at most {vocab_size} ids, not {draft_vocab_size}"
        )
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for lab in labels:
        counts += torch.bincount(lab, minlength=vocab_size)
    counts[vocab.target_ids] = -1  # already in: sorted last, never picked
    order = torch.argsort(-counts, stable=True)
    added = order[: draft_vocab_size - vocab.size]
    return DraftVocab.of(torch.sort(torch.cat([vocab.target_ids, added])).values, vocab_size)
