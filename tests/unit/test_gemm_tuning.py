"""Start-up choice of the CPU linear forms: every bucket a serving call can reach is decided before the
first call, so a product computes with the same form (and the same rounding) from its first call on."""

from __future__ import annotations

import types

import pytest
import torch

from sglang_dart.cpu import gemm_tuning, skinny_gemm, small_step_threads
from sglang_dart.drafter.config import DraftConfig
from sglang_dart.drafter.model import DartDrafter


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(skinny_gemm, "_choices", {})
    monkeypatch.setattr(skinny_gemm, "_mode", None)
    monkeypatch.delenv(skinny_gemm.ENV, raising=False)


def _every_bucket_decided(weight: torch.Tensor) -> None:
    for rows in range(1, skinny_gemm.PACKED_MAX_ROWS + 1):
        probe = torch.empty(rows, weight.shape[1], dtype=weight.dtype)
        forms = skinny_gemm.forms_for(rows, probe, weight)
        if len(forms) > 1:
            assert skinny_gemm.bucket_choice(rows, weight, forms).chosen in forms, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_bucket_is_decided_before_the_first_call(dtype):
    weights = [torch.randn(48, 40, dtype=dtype) for _ in range(3)] + [torch.randn(24, 40, dtype=dtype)]
    counts = gemm_tuning.tune_weights(weights)
    if dtype == torch.bfloat16 and skinny_gemm.bf16_rust_only():
        assert sum(counts.values()) == len(skinny_gemm._choices) == 0  # every bf16 product is Rust's
    else:
        assert sum(counts.values()) == len(skinny_gemm._choices) > 0
    for weight in weights:
        _every_bucket_decided(weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_and_later_calls_compute_alike(dtype):
    """Timed on serving calls, a bucket's first calls rotate through forms that round differently (in
    float32 too: the Rust product sums in another order than the BLAS)."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(96, 80, generator=generator).to(dtype) for _ in range(2)]
    gemm_tuning.tune_weights(weights)
    for rows in (1, 2, 5, 16, 33, 64, 65, 97, 200, 511):
        x = torch.randn(rows, 80, generator=generator).to(dtype)
        first = skinny_gemm.linear(x, weights[0])
        for _ in range(4 * skinny_gemm.SAMPLES_PER_FORM):
            assert torch.equal(skinny_gemm.linear(x, weights[0]), first), rows
        torch.testing.assert_close(first.float(), (x.float() @ weights[0].float().T), rtol=3e-2, atol=3e-2)


def test_a_decided_bucket_is_left_alone():
    weight = torch.randn(32, 16)
    gemm_tuning.tune_weights([weight])
    before = {key: (choice.chosen, dict(choice.seconds)) for key, choice in skinny_gemm._choices.items()}
    assert sum(gemm_tuning.tune_weights([weight]).values()) == 0
    after = {key: (choice.chosen, dict(choice.seconds)) for key, choice in skinny_gemm._choices.items()}
    assert after == before


def test_only_the_given_row_counts_are_tuned():
    weight = torch.randn(32, 16)
    gemm_tuning.tune_weights([weight], [1, 2, 4, 8, 16])
    buckets = {key[3] for key in skinny_gemm._choices}
    assert buckets == set(range(1, (16).bit_length() + 1))


def test_a_row_count_that_would_overrun_the_deadline_is_left_to_serving_calls():
    weight = torch.randn(32, 16)
    assert gemm_tuning.tune_weights([weight], [1, 2], deadline=0.0) is None
    assert all(choice.chosen is None for choice in skinny_gemm._choices.values())
    x = torch.randn(2, 16)
    skinny_gemm.linear(x, weight)  # timed on its serving calls, as without start-up tuning
    (choice,) = [c for key, c in skinny_gemm._choices.items() if key[3] == 2]
    assert sum(len(v) for v in choice.seconds.values()) == 1


def test_the_budget_keeps_the_smallest_row_counts(monkeypatch):
    """Row counts go smallest first, each at every thread count, until the budget would be overrun."""
    runner = types.SimpleNamespace(dtype=torch.float32, device="cpu", model=torch.nn.Module())
    runner.model.proj = skinny_gemm.Linear(256, 512, bias=False)
    clock = iter(range(10**6))
    monkeypatch.setattr(gemm_tuning.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(gemm_tuning, "budget_seconds", lambda: 150.0)  # ticks: a few row counts
    monkeypatch.setattr(gemm_tuning, "served_weights", lambda model: [model.proj.weight])
    gemm_tuning.tune_model_runner(runner)
    decided = sorted({key[3] for key, c in skinny_gemm._choices.items() if c.chosen is not None})
    undecided = {key[3] for key, c in skinny_gemm._choices.items() if c.chosen is None}
    assert decided and decided == list(range(1, len(decided) + 1))  # a prefix of the buckets
    assert len(decided) < skinny_gemm.PACKED_MAX_ROWS.bit_length() and min(undecided) > max(decided)


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf"])
def test_a_bad_budget_is_refused(monkeypatch, value):
    gemm_tuning.budget_seconds.cache_clear()
    monkeypatch.setenv(gemm_tuning.BUDGET_ENV, value)
    try:
        with pytest.raises(ValueError, match=gemm_tuning.BUDGET_ENV):
            gemm_tuning.budget_seconds()
    finally:
        gemm_tuning.budget_seconds.cache_clear()


def test_row_counts_reach_every_set_of_forms():
    counts = gemm_tuning.row_counts()
    assert counts[0] == 1 and counts[-1] <= skinny_gemm.PACKED_MAX_ROWS
    for edge in (2, skinny_gemm.SKINNY_MATMUL_MAX_ROWS + 1, skinny_gemm.MAX_ROWS + 1):
        assert edge in counts
    assert {r.bit_length() for r in counts} == set(range(1, skinny_gemm.PACKED_MAX_ROWS.bit_length() + 1))


@pytest.mark.skipif(not skinny_gemm.packing_available(), reason="no packed bf16 products on this CPU")
@pytest.mark.parametrize("through", ["tune_weights", "tune_model_runner"])
def test_packed_copies_made_only_for_timing_are_dropped(monkeypatch, through):
    runner = types.SimpleNamespace(dtype=torch.bfloat16, device="cpu", model=torch.nn.Module())
    runner.model.proj = skinny_gemm.Linear(64, 64, bias=False).to(torch.bfloat16)
    weight = runner.model.proj.weight
    monkeypatch.setattr(skinny_gemm, "packed_weights", skinny_gemm.PackedWeights())
    monkeypatch.setattr(skinny_gemm, "REQUIRED_GAIN", 1.0)  # torch always kept: nothing chooses packed
    monkeypatch.setattr(gemm_tuning, "served_weights", lambda model: [model.proj.weight])
    if through == "tune_weights":
        gemm_tuning.tune_weights([weight])
    else:
        gemm_tuning.tune_model_runner(runner)
    assert skinny_gemm._choices and all(c.chosen == "torch" for c in skinny_gemm._choices.values())
    assert not skinny_gemm.packed_weights.has(weight) and skinny_gemm.packed_weights.bytes == 0


def test_the_drafter_lists_the_weights_its_serving_step_multiplies_by():
    cfg = DraftConfig.from_dict(
        {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 60, "draft_vocab_size": 50, "draft_length": 3}
    )  # fmt: skip
    drafter = DartDrafter(cfg, None)
    model = torch.nn.Module()
    model.drafter = drafter
    before = {id(w) for w in gemm_tuning.served_weights(model)}
    drafter.join_projections()
    after = gemm_tuning.served_weights(model)
    attn, mlp = drafter.midlayer.self_attn, drafter.midlayer.mlp
    assert {id(w) for w in after} == {
        id(w)
        for w in (drafter.fc.weight, drafter.qkv_weight, attn.k_proj.weight, attn.v_proj.weight,
                  drafter.gate_up_weight, attn.o_proj.weight, mlp.down_proj.weight, drafter.lm_head.weight)
    }  # fmt: skip
    assert id(attn.q_proj.weight) in before and id(drafter.qkv_weight) not in before


def test_small_step_runners_are_tuned_on_one_thread_too(monkeypatch):
    runner = types.SimpleNamespace(dtype=torch.float32, device="cpu")
    monkeypatch.setattr(small_step_threads, "installed", lambda: True)
    monkeypatch.setattr(small_step_threads, "configured_threads", lambda: 2)
    assert gemm_tuning.thread_counts(runner) == [2, 1]
    bf16_elsewhere = types.SimpleNamespace(dtype=torch.bfloat16, device="cpu")
    if torch.bfloat16 not in skinny_gemm.rust_dtypes():  # where torch's pool takes every bf16 linear
        assert gemm_tuning.thread_counts(bf16_elsewhere) == [torch.get_num_threads()]
    monkeypatch.setattr(small_step_threads, "installed", lambda: False)
    assert gemm_tuning.thread_counts(runner) == [torch.get_num_threads()]


def test_a_zero_budget_leaves_every_bucket_to_serving_calls(monkeypatch):
    runner = types.SimpleNamespace(dtype=torch.float32, device="cpu", model=torch.nn.Module())
    runner.model.proj = skinny_gemm.Linear(16, 32, bias=False)
    monkeypatch.setattr(gemm_tuning, "budget_seconds", lambda: 0.0)
    monkeypatch.setattr(gemm_tuning, "served_weights", lambda model: [model.proj.weight])
    gemm_tuning.tune_model_runner(runner)
    assert skinny_gemm._choices == {}
