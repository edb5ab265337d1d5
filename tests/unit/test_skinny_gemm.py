"""The few-row CPU linear layer: same values as F.linear in either form, a choice made once per dtype,
and a clear error for a bad setting."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from sglang_dart.cpu import skinny_gemm


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.setattr(skinny_gemm, "_choices", {})
    monkeypatch.setattr(skinny_gemm, "_mode", None)


@pytest.mark.parametrize("form", ["transposed", "torch", "auto"])
@pytest.mark.parametrize("rows", [1, 2, 7, 96, 97])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_match_f_linear(monkeypatch, form, rows, with_bias):
    monkeypatch.setenv(skinny_gemm.ENV, form)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=generator)
    weight = torch.randn(48, 64, generator=generator)
    bias = torch.randn(48, generator=generator) if with_bias else None
    out = skinny_gemm.linear(x, weight, bias)
    assert out.shape == (rows, 48) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_batched_input_keeps_its_shape(monkeypatch):
    monkeypatch.setenv(skinny_gemm.ENV, "transposed")
    x = torch.randn(3, 5, 32)
    weight = torch.randn(40, 32)
    out = skinny_gemm.linear(x, weight)
    assert out.shape == (3, 5, 40)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_auto_times_each_shape_then_keeps_the_faster_form(monkeypatch, caplog):
    monkeypatch.setenv(skinny_gemm.ENV, "auto")
    wide, square = torch.randn(3072, 576), torch.randn(576, 576)
    x = torch.randn(8, 576)
    with caplog.at_level(logging.INFO, logger=skinny_gemm.__name__):
        for _ in range(2 * skinny_gemm.SAMPLES_PER_FORM - 1):
            skinny_gemm.linear(x, wide)
        assert skinny_gemm._choices[(3072, 576, torch.float32)].transposed is None
        skinny_gemm.linear(x, wide)
        skinny_gemm.linear(x, square)  # another shape starts its own timing
    choice = skinny_gemm._choices[(3072, 576, torch.float32)]
    assert [len(s) for s in choice.seconds] == [skinny_gemm.SAMPLES_PER_FORM] * 2
    assert choice.transposed is not None
    assert skinny_gemm._choices[(576, 576, torch.float32)].transposed is None
    assert caplog.text.count("sglang_dart: CPU linear 576->3072 (float32, 2-96 rows) uses") == 1
    # Decided: later calls are not timed.
    skinny_gemm.linear(x, wide)
    assert [len(s) for s in choice.seconds] == [skinny_gemm.SAMPLES_PER_FORM] * 2


def test_one_row_and_many_rows_are_left_to_torch(monkeypatch):
    monkeypatch.setenv(skinny_gemm.ENV, "auto")
    weight = torch.randn(64, 32)
    for rows in (1, skinny_gemm.MAX_ROWS + 1):
        skinny_gemm.linear(torch.randn(rows, 32), weight)
    assert skinny_gemm._choices == {}


def test_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(skinny_gemm.ENV, "fastest")
    with pytest.raises(ValueError, match=f"{skinny_gemm.ENV}='fastest'"):
        skinny_gemm.linear(torch.randn(4, 8), torch.randn(8, 8))


def test_module_keeps_nn_linear_state_dict():
    layer = skinny_gemm.Linear(16, 8, bias=False)
    assert list(layer.state_dict()) == ["weight"]
    torch.nn.Linear(16, 8, bias=False).load_state_dict(layer.state_dict())
