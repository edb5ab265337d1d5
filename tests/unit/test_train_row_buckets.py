"""Every trainer pads its forwards' row counts to a multiple of `trainer.ROW_BUCKET` (so that oneDNN's
kernels for a product's row count are reused, not compiled anew each step). The filler rows must change
nothing: each format's loss, top-1 counts and gradients equal those of the unpadded forward (the bucket
set to 1), in float32, for sequences of lengths on and off the bucket's multiples."""

from __future__ import annotations

import pytest
import torch

from sglang_dart.train import trainer
from sglang_dart.train.features import SequenceFeatures
from sglang_dart.train.trainer import bucketed, pad_rows, padded_rows, sequence_loss
from sglang_dart.train.vocab import DraftVocab
from tests.unit.test_train import _copy_task, _drafter, _with_answer_start


def _loss_and_grads(model: torch.nn.Module, compute) -> tuple[torch.Tensor, object, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss, stats = compute()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), stats, grads


def _assert_padding_changes_nothing(monkeypatch, model: torch.nn.Module, compute) -> None:
    padded = _loss_and_grads(model, compute)
    monkeypatch.setattr(trainer, "ROW_BUCKET", 1)
    plain = _loss_and_grads(model, compute)
    torch.testing.assert_close(padded[0], plain[0], rtol=1e-5, atol=1e-6)
    assert padded[1] == plain[1]  # the same top-1 counts per row: filler rows are never counted
    assert padded[2].keys() == plain[2].keys() and len(plain[2]) > 3
    for name, grad in plain[2].items():
        torch.testing.assert_close(padded[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_bucketed_counts_and_filler_rows():
    assert [bucketed(n) for n in (0, 1, 31, 32, 33, 64)] == [0, 32, 32, 32, 64, 64]
    rows = torch.arange(6).view(3, 2)
    assert pad_rows(rows, 3) is rows
    assert pad_rows(rows, 5, -1).tolist() == [[0, 1], [2, 3], [4, 5], [-1, -1], [-1, -1]]
    taps, tokens, wanted_from = padded_rows(torch.ones(50, 4), torch.arange(50), first=40)
    assert taps.shape == (64, 4) and tokens.shape == (64,)
    assert not taps[50:].any() and tokens[:50].tolist() == list(range(50))
    assert wanted_from == 32  # rows 40..63 are 24: moved back to 32 rows, from 32 on
    for first in range(51):  # every answer row is wanted, and the wanted rows are a bucketed count
        wanted_from = padded_rows(torch.ones(50, 4), torch.arange(50), first)[2]
        assert 0 <= wanted_from <= first and (64 - wanted_from) % 32 == 0


@pytest.mark.parametrize(
    ("length", "start", "anchors"), [(24, 6, [5, 9, 20, 22]), (45, 30, [29, 33, 43]), (33, 1, [0, 31])]
)
def test_dart_loss_and_gradients_do_not_see_the_padding(monkeypatch, length, start, anchors):
    model, _, vocab = _drafter(vocab_size=30, seed=length)  # labels outside the vocabulary too
    feats = _with_answer_start(_copy_task(count=1, length=length, seed=length)[0], start)
    anchors = torch.tensor(anchors)

    def compute():
        result = sequence_loss(model, feats, vocab, anchors, 0.8)
        return result.loss, result.stats

    _assert_padding_changes_nothing(monkeypatch, model, compute)


@pytest.mark.parametrize(("length", "first"), [(20, 2), (40, 0), (33, 5)])
def test_eagle3_loss_and_gradients_do_not_see_the_padding(monkeypatch, length, first):
    from sglang_dart.train.eagle3_model import Eagle3Drafter, Eagle3Shape
    from sglang_dart.train.eagle3_trainer import padded_window, window_loss, window_of

    shape = Eagle3Shape(
        hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=10000.0, vocab_size=100, draft_vocab_size=40,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(length)
    model = Eagle3Drafter(shape, torch.randn(100, 32, generator=gen))
    feats = SequenceFeatures(
        torch.randint(0, 100, (length,), generator=gen),
        torch.randn(length, 96, generator=gen),
        torch.randint(0, 100, (length,), generator=gen),
        answer_start=6,
    )
    vocab = DraftVocab.of(torch.arange(40) * 2, 100)  # half the labels fall outside

    def compute():
        return window_loss(model, padded_window(window_of(feats, vocab, first, 512)), 3, 0.8)

    _assert_padding_changes_nothing(monkeypatch, model, compute)


@pytest.mark.parametrize("anchors", [[3, 8, 15], [1, 2], [30, 33]])
def test_dflash_loss_and_gradients_do_not_see_the_padding(monkeypatch, anchors):
    from sglang_dart.train.dflash_model import DFlashDrafter, DFlashShape
    from sglang_dart.train.dflash_train import FrozenTarget, block_loss

    shape = DFlashShape(
        hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=2,
        num_context_features=3, rms_norm_eps=1e-6, rope_theta=10000.0,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(len(anchors))
    model = DFlashDrafter(shape)
    frozen = FrozenTarget(
        embed=torch.randn(100, 32, generator=gen), lm_head=torch.randn(100, 32, generator=gen)
    )
    feats = SequenceFeatures(
        torch.randint(0, 99, (36,), generator=gen),
        torch.randn(36, 96, generator=gen),
        torch.randint(0, 99, (36,), generator=gen),
    )
    anchors = torch.tensor(anchors)

    def compute():
        result = block_loss(model, frozen, feats, anchors, 4, 99, 0.8)
        return result.loss, result.stats

    _assert_padding_changes_nothing(monkeypatch, model, compute)
