"""The `packed` form of the few-row CPU linear: torch's oneDNN bf16 product on a weight reordered once.
Same bits as F.linear for the row counts decode and verify use, offered only where it applies, one copy
per live weight within its budget, and dropped when SGLang updates weights in place."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from sglang_dart.cpu import skinny_gemm

needs_packing = pytest.mark.skipif(
    not skinny_gemm.packing_available(), reason="torch's oneDNN takes no packed bf16 weights on this CPU"
)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    monkeypatch.setattr(skinny_gemm, "_choices", {})
    monkeypatch.setattr(skinny_gemm, "_mode", None)
    monkeypatch.setattr(skinny_gemm, "packed_weights", skinny_gemm.PackedWeights())
    skinny_gemm.packed_budget_bytes.cache_clear()
    yield
    skinny_gemm.packed_budget_bytes.cache_clear()


def _forms(n: int, k: int, dtype: torch.dtype, bucket: int) -> tuple[str, ...]:
    """The forms timed for a weight shape, dtype and row bucket at torch's thread count."""
    key = (n, k, dtype, bucket, torch.get_num_threads())
    (forms,) = [c.forms for k_, c in skinny_gemm._choices.items() if k_[:5] == key]
    return forms


def _bf16(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@needs_packing
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 15, 16])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (100, 40)])
def test_packed_form_gives_f_linears_bits(monkeypatch, rows, n, k):
    monkeypatch.setenv(skinny_gemm.ENV, "packed")
    x, weight = _bf16(rows, k, seed=rows), _bf16(n, k, seed=n)
    out = skinny_gemm.linear(x, weight)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    assert torch.equal(out, F.linear(x, weight))


@needs_packing
def test_packed_form_adds_the_bias_and_keeps_batched_shapes(monkeypatch):
    monkeypatch.setenv(skinny_gemm.ENV, "packed")
    x, weight, bias = _bf16(3, 4, 32), _bf16(40, 32, seed=1), _bf16(40, seed=2)
    out = skinny_gemm.linear(x, weight, bias)
    assert out.shape == (3, 4, 40)
    torch.testing.assert_close(out.float(), F.linear(x, weight, bias).float(), rtol=1e-2, atol=1e-2)


@needs_packing
def test_auto_offers_packed_for_bf16_inference_only(monkeypatch):
    monkeypatch.setenv(skinny_gemm.ENV, "auto")
    monkeypatch.setattr(skinny_gemm, "bf16_kernel_pays", lambda: False)
    weight = _bf16(64, 32)
    skinny_gemm.linear(_bf16(1, 32), weight)
    skinny_gemm.linear(_bf16(8, 32), weight)
    skinny_gemm.linear(torch.randn(8, 32), weight.float())
    assert _forms(64, 32, torch.bfloat16, 1) == ("torch", "packed")
    assert _forms(64, 32, torch.bfloat16, 4) == (
        "torch",
        "transposed",
        "packed",
    )
    assert "packed" not in _forms(64, 32, torch.float32, 4)
    # Training: oneDNN's packed product has no backward, so torch computes it, gradients and all.
    layer = skinny_gemm.Linear(32, 16, bias=False).bfloat16()
    x = _bf16(4, 32).requires_grad_()
    layer(x).float().sum().backward()
    assert x.grad is not None and skinny_gemm.packed_weights.bytes == 0


@needs_packing
def test_past_the_few_row_forms_auto_still_offers_packed_up_to_its_reach(monkeypatch):
    # DART's verify from batch 25 (trees of 4: 100+ rows) and prefill chunks: torch against packed only.
    monkeypatch.setenv(skinny_gemm.ENV, "auto")
    monkeypatch.setattr(skinny_gemm, "bf16_kernel_pays", lambda: False)
    weight = _bf16(64, 32)
    for rows in (skinny_gemm.MAX_ROWS + 1, 128, skinny_gemm.PACKED_MAX_ROWS):
        x = _bf16(rows, 32, seed=rows)
        torch.testing.assert_close(skinny_gemm.linear(x, weight), F.linear(x, weight))
        bucket = skinny_gemm._bucket(rows)
        assert _forms(64, 32, torch.bfloat16, bucket) == ("torch", "packed")
    known = len(skinny_gemm._choices)
    for x in (_bf16(skinny_gemm.PACKED_MAX_ROWS + 1, 32), torch.randn(128, 32)):  # past it; float32
        skinny_gemm.linear(x, weight.to(x.dtype))
    assert len(skinny_gemm._choices) == known  # F.linear directly, nothing timed


@needs_packing
def test_a_zero_budget_turns_the_form_off(monkeypatch):
    monkeypatch.setenv(skinny_gemm.ENV, "auto")
    monkeypatch.setenv(skinny_gemm.PACKED_BUDGET_ENV, "0")
    skinny_gemm.linear(_bf16(8, 32), _bf16(64, 32))
    (choice,) = skinny_gemm._choices.values()
    assert "packed" not in choice.forms


@needs_packing
def test_one_copy_per_weight_while_it_lives(monkeypatch):
    monkeypatch.setenv(skinny_gemm.ENV, "packed")
    weight = _bf16(64, 32)
    skinny_gemm.linear(_bf16(2, 32), weight)
    first = skinny_gemm.packed_weights.get(weight)
    skinny_gemm.linear(_bf16(9, 32), weight)
    assert skinny_gemm.packed_weights.get(weight) is first
    assert skinny_gemm.packed_weights.bytes == 64 * 32 * 2
    del weight, first
    gc.collect()
    assert skinny_gemm.packed_weights.bytes == 0


@needs_packing
def test_past_the_budget_weights_stay_unpacked_and_right(monkeypatch):
    monkeypatch.setenv(skinny_gemm.ENV, "packed")
    monkeypatch.setenv(skinny_gemm.PACKED_BUDGET_ENV, str(1.5 * 64 * 32 * 2 / 2**30))  # one weight fits
    first, second, x = _bf16(64, 32, seed=1), _bf16(64, 32, seed=2), _bf16(4, 32)
    assert torch.equal(skinny_gemm.linear(x, first), F.linear(x, first))
    assert torch.equal(skinny_gemm.linear(x, second), F.linear(x, second))
    assert skinny_gemm.packed_weights.get(first) is not None
    assert skinny_gemm.packed_weights.get(second) is None
    assert skinny_gemm.packed_weights.bytes == 64 * 32 * 2


@needs_packing
def test_a_weight_update_drops_the_stale_copies(monkeypatch):
    # SGLang writes updated weights into the same tensors; the wrapped updater must drop the copies.
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    monkeypatch.setenv(skinny_gemm.ENV, "packed")
    weight, x = _bf16(64, 32, seed=1), _bf16(3, 32)
    skinny_gemm.linear(x, weight)
    fresh = _bf16(64, 32, seed=2)

    def update_in_place(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        weight.copy_(fresh)
        return True, "updated"

    for name in skinny_gemm.WEIGHT_UPDATES:
        monkeypatch.setattr(WeightUpdater, name, update_in_place)
    skinny_gemm.drop_packed_weights_after_updates()
    assert WeightUpdater.update_weights_from_disk(object()) == (True, "updated")
    assert torch.equal(skinny_gemm.linear(x, weight), F.linear(x, fresh))


def test_a_bad_budget_names_the_variable(monkeypatch):
    for value in ("lots", "-1", "nan"):
        monkeypatch.setenv(skinny_gemm.PACKED_BUDGET_ENV, value)
        skinny_gemm.packed_budget_bytes.cache_clear()
        with pytest.raises(ValueError, match=skinny_gemm.PACKED_BUDGET_ENV):
            skinny_gemm.packed_budget_bytes()
