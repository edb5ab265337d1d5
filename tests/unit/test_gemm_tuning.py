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


def test_max_rows_bounds_the_buckets():
    weight = torch.randn(32, 16)
    gemm_tuning.tune_weights([weight], max_rows=16)
    buckets = {key[3] for key in skinny_gemm._choices}
    assert buckets == set(range(1, (16).bit_length() + 1))


def test_row_counts_reach_every_set_of_forms():
    counts = gemm_tuning.row_counts()
    assert counts[0] == 1 and counts[-1] <= skinny_gemm.PACKED_MAX_ROWS
    for edge in (2, skinny_gemm.SKINNY_MATMUL_MAX_ROWS + 1, skinny_gemm.MAX_ROWS + 1):
        assert edge in counts
    assert {r.bit_length() for r in counts} == set(range(1, skinny_gemm.PACKED_MAX_ROWS.bit_length() + 1))


@pytest.mark.skipif(not skinny_gemm.packing_available(), reason="no packed bf16 products on this CPU")
def test_packed_copies_made_only_for_timing_are_dropped(monkeypatch):
    weight = torch.randn(64, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(skinny_gemm, "packed_weights", skinny_gemm.PackedWeights())
    monkeypatch.setattr(skinny_gemm, "REQUIRED_GAIN", 1.0)  # torch always kept: nothing chooses packed
    gemm_tuning.tune_weights([weight])
    assert all(choice.chosen == "torch" for choice in skinny_gemm._choices.values())
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
