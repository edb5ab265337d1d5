"""The peers' trainers learn from the same positions as DART's: chains (EAGLE3) and anchor blocks (DFLASH)
start in the answer, where a server drafts, never in the prompt."""

from __future__ import annotations

import random

import torch

from sglang_dart.train.dflash_train import sample_anchors
from sglang_dart.train.eagle3_trainer import step_rows, window_of
from sglang_dart.train.features import SequenceFeatures
from sglang_dart.train.vocab import most_frequent_vocab


def _feats(length: int, answer_start: int) -> SequenceFeatures:
    ids = torch.arange(length)
    return SequenceFeatures(ids, torch.zeros(length, 12), (ids + 1) % length, answer_start=answer_start)


def test_eagle3_chains_start_at_the_answer():
    vocab = most_frequent_vocab([torch.arange(30)], 30, 30)
    feats = _feats(20, answer_start=8)  # DART's first anchor: position 7
    for start, skip in ((0, 7), (5, 2), (10, 0)):
        window = window_of(feats, vocab, start, 64)
        logits = [torch.randn(window.labels.shape[0], 30) for _ in range(3)]
        assert window.first_origin == skip
        for k, (rows, labels) in enumerate(step_rows(logits, window)):
            # row i of step k is window position skip + k + i, whose chain starts at skip + i
            assert rows.shape[0] == labels.shape[0] == window.labels.shape[0] - skip - k
            assert torch.equal(labels, window.labels[skip + k :])
    whole = window_of(_feats(20, answer_start=0), vocab, 0, 64)
    logits = [torch.randn(19, 30) for _ in range(3)]
    assert whole.first_origin == 0 and len(step_rows(logits, whole)[0][1]) == 19


def test_eagle3_trimmed_logits_are_the_supervised_rows_of_the_full_ones():
    """Training computes the head only where a chain is supervised; those rows must not change."""
    from sglang_dart.train.eagle3_model import Eagle3Drafter, Eagle3Shape

    torch.manual_seed(0)
    shape = Eagle3Shape(
        hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=10000.0, vocab_size=30, draft_vocab_size=30,
    )  # fmt: skip
    model = Eagle3Drafter(shape, torch.randn(30, 32))
    vocab = most_frequent_vocab([torch.arange(30)], 30, 30)
    feats = SequenceFeatures(
        torch.randint(0, 30, (20,)), torch.randn(20, 96), torch.randint(0, 30, (20,)), answer_start=8
    )
    for start in (0, 5, 10):
        window = window_of(feats, vocab, start, 64)
        with torch.no_grad():
            full = model.ttt_logits(window.taps, window.tokens, 3)
            trimmed = model.ttt_logits(window.taps, window.tokens, 3, supervised_from=window.first_origin)
        pairs = zip(step_rows(full, window), step_rows(trimmed, window, trimmed=True), strict=True)
        for (rows, labels), (rows_t, labels_t) in pairs:
            assert torch.equal(labels, labels_t)
            torch.testing.assert_close(rows_t, rows, rtol=1e-5, atol=1e-5)


def test_dflash_anchor_blocks_start_at_the_answer():
    rng = random.Random(0)
    assert sample_anchors(20, 64, rng, first=15).tolist() == [15, 16, 17, 18, 19]
    assert sample_anchors(20, 64, rng).min() == 1  # no answer start: every block still has context
    assert sample_anchors(5, 64, rng, first=0).tolist() == [1, 2, 3, 4]
