"""`--greedy-chains-only`: on text the target did not write, a draft row learns only where the text keeps
to the target's greedy chain from the anchor's root on (what a verify step accepts). The loss must equal a
per-row cross-entropy over exactly those (anchor, row) pairs, and change nothing on the target's own
greedy text."""

from __future__ import annotations

import pytest
import torch

from sglang_dart.train.blocks import block_logits
from sglang_dart.train.features import SequenceFeatures
from sglang_dart.train.trainer import TrainSettings, greedy_run_lengths, sequence_loss, train
from tests.unit.test_train import _copy_task, _drafter, _with_answer_start


def test_run_lengths_count_the_greedy_tokens_from_each_position_on():
    labels = torch.tensor([1, 2, 3, 9, 5, 6, 7])
    ids = torch.tensor([0, 1, 2, 3, 4, 5, 6])  # x_{t+1} == labels[t] except at t = 3 (x_4 = 4, not 9)
    assert greedy_run_lengths(ids, labels).tolist() == [3, 2, 1, 0, 2, 1]
    assert greedy_run_lengths(torch.tensor([4, 4]), torch.tensor([4, 0])).tolist() == [1]
    assert greedy_run_lengths(torch.tensor([4, 5]), torch.tensor([4, 0])).tolist() == [0]


def _off_chain(feats: SequenceFeatures, positions: list[int], seed: int) -> SequenceFeatures:
    """A text that departs from the target's greedy choice at `positions` (x_p is another token than
    labels[p-1]); taps and labels stay, since the rule reads only tokens and labels."""
    ids = feats.input_ids.clone()
    gen = torch.Generator().manual_seed(seed)
    for p in positions:
        other = int(torch.randint(0, 50, (1,), generator=gen))
        ids[p] = other if other != int(feats.labels[p - 1]) else (other + 1) % 50
    return SequenceFeatures(ids, feats.taps, feats.labels, answer_start=feats.answer_start)


def _reference_loss(model, feats, vocab, anchors, row_decay, first):
    """Per draft row, a cross-entropy over the pairs the rule allows, computed with Python loops."""
    d = model.cfg.draft_length
    ids, target = feats.input_ids.tolist(), feats.labels.tolist()
    num_real = len(ids) - 1
    follows = [ids[t + 1] == target[t] for t in range(num_real)]

    def greedy(t: int, count: int) -> bool:
        return t + count <= num_real and all(follows[t : t + count])

    labels = vocab.to_draft(feats.labels)
    taps = feats.taps[:num_real].to(model.fc.weight.dtype)
    out = block_logits(model, taps, feats.input_ids[1:], anchors, torch.arange(first, num_real))
    rows = [[(out.real[t - first], int(labels[t + 1])) for t in range(first, num_real) if greedy(t, 1)]]
    for j in range(1, d + 1):
        rows.append(
            [
                (out.masks[a, j - 1], int(labels[p + 1 + j]))
                for a, p in enumerate(anchors.tolist())
                if p + 1 + j < len(ids) and greedy(p, j + 1)
            ]
        )
    losses, weights, counts = [], [], []
    for row, pairs in enumerate(rows):
        pairs = [(logit, label) for logit, label in pairs if label >= 0]
        counts.append(len(pairs))
        if not pairs:
            continue
        logits = torch.stack([logit for logit, _ in pairs])
        target_t = torch.tensor([label for _, label in pairs])
        losses.append(torch.nn.functional.cross_entropy(logits, target_t) * row_decay**row)
        weights.append(row_decay**row)
    return torch.stack(losses).sum() / sum(weights), counts


@pytest.mark.parametrize(
    ("seed", "length", "start", "departures", "anchors"),
    [
        (0, 24, 6, [9, 14], [5, 7, 8, 12, 13, 20]),
        (1, 40, 3, [4, 20, 21, 30], [2, 3, 10, 18, 19, 29, 35]),
        (2, 33, 1, [], [0, 5, 31]),
    ],
)
def test_only_pairs_on_the_greedy_chain_are_supervised(seed, length, start, departures, anchors):
    model, _, vocab = _drafter(vocab_size=30, seed=seed)
    feats = _with_answer_start(_copy_task(count=1, length=length, seed=seed)[0], start)
    feats = _off_chain(feats, departures, seed)
    anchors = torch.tensor(anchors)
    with torch.no_grad():
        got = sequence_loss(model, feats, vocab, anchors, 0.8, greedy_chains_only=True)
        want, counts = _reference_loss(model, feats, vocab, anchors, 0.8, first=start - 1)
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-6)
    got_counts = [int(t) for t in got.stats.total] + [0] * (len(counts) - len(got.stats.total))
    assert got_counts == counts
    if departures:  # the rule dropped something that the plain loss counts
        with torch.no_grad():
            plain = sequence_loss(model, feats, vocab, anchors, 0.8)
        assert sum(plain.stats.total) > sum(got.stats.total)


def test_on_the_targets_own_greedy_text_the_rule_changes_nothing():
    model, _, vocab = _drafter(vocab_size=30, seed=4)
    feats = _with_answer_start(_copy_task(count=1, length=30, seed=4)[0], 5)
    anchors = torch.tensor([4, 9, 17, 25])
    with torch.no_grad():
        plain = sequence_loss(model, feats, vocab, anchors, 0.8)
        chained = sequence_loss(model, feats, vocab, anchors, 0.8, greedy_chains_only=True)
    torch.testing.assert_close(chained.loss, plain.loss)
    assert chained.stats.total == plain.stats.total


def test_training_with_the_rule_still_learns():
    model, _, vocab = _drafter(seed=5)
    data = [_off_chain(f, [7, 15], i) for i, f in enumerate(_copy_task(count=16, length=24, seed=5))]
    settings = TrainSettings(max_steps=60, learning_rate=3e-3, greedy_chains_only=True, log_every=0)
    with torch.no_grad():
        before = float(sequence_loss(model, data[0], vocab, torch.tensor([2, 9, 16]), 0.8, True).loss)
    losses = train(model, data, vocab, settings, log=lambda _: None)
    with torch.no_grad():
        after = float(sequence_loss(model, data[0], vocab, torch.tensor([2, 9, 16]), 0.8, True).loss)
    assert len(losses) == 60 and after < before * 0.7
