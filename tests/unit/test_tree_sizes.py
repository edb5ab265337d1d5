"""The tree-size schedule: parsing, lookup by batch size, capping, and where the server reads it from."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sglang_dart.dart import settings
from sglang_dart.dart.settings import DartArgsError, tree_size_schedule
from sglang_dart.dart.tree_sizes import (
    CPU_AMX,
    CPU_AVX512_BF16,
    TreeSizeSchedule,
    TreeSizesError,
    default_schedule,
    default_schedule_key,
)


def test_lookup_by_batch_size():
    schedule = TreeSizeSchedule.parse("4:4, 1:8, 8:1", max_size=16)  # order does not matter
    assert [schedule.size_for(bs) for bs in (1, 2, 3, 4, 7, 8, 64)] == [8, 8, 8, 4, 4, 1, 1]
    assert schedule.describe() == "1:8,4:4,8:1"
    assert schedule.max_size == 8


def test_sizes_are_capped_and_fixed_means_the_server_size():
    assert TreeSizeSchedule.parse("1:64,8:16", max_size=8).sizes == (8, 8)
    fixed = TreeSizeSchedule.parse("fixed", max_size=12)
    assert [fixed.size_for(bs) for bs in (1, 100)] == [12, 12]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2:8,8:1", "first min_batch must be 1"),
        ("1:8,1:4", "appears twice"),
        ("1:0", ">= 1"),
        ("1:8,x:2", "'x:2' is not min_batch:size"),
        ("8", "is not min_batch:size"),
        ("", "is not min_batch:size"),
    ],
)
def test_malformed_schedules_are_refused(text, message):
    with pytest.raises(TreeSizesError, match=message):
        TreeSizeSchedule.parse(text, max_size=8)


def test_cpu_default_shrinks_with_batch_size_and_other_devices_are_fixed():
    schedule = default_schedule("cpu", max_size=16)
    sizes = [schedule.size_for(bs) for bs in range(1, 129)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 1 and sizes[-1] == 1
    for device in ("cuda", "xpu"):  # CUDA: decode graphs are captured for N tokens per request only
        assert default_schedule(device, max_size=16).sizes == (16,)


def _server_args(tmp_path, config: dict) -> SimpleNamespace:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return SimpleNamespace(
        speculative_draft_model_path=str(tmp_path), speculative_num_draft_tokens=8, device="cpu"
    )


def test_environment_overrides_the_drafter_config(tmp_path, monkeypatch):
    args = _server_args(tmp_path, {"dart_tree_sizes": "1:6,2:1"})
    monkeypatch.delenv("SGLANG_DART_TREE_SIZES", raising=False)
    assert tree_size_schedule(args).describe() == "1:6,2:1"
    monkeypatch.setenv("SGLANG_DART_TREE_SIZES", "1:8,4:2")
    assert tree_size_schedule(args).describe() == "1:8,4:2"
    monkeypatch.setenv("SGLANG_DART_TREE_SIZES", "1:8;4:2")
    with pytest.raises(DartArgsError, match="SGLANG_DART_TREE_SIZES"):
        tree_size_schedule(args)
    monkeypatch.delenv("SGLANG_DART_TREE_SIZES")
    assert tree_size_schedule(_server_args(tmp_path, {})).schedule == default_schedule("cpu", 8)


def test_bf16_targets_on_amx_cpus_get_their_own_default():
    assert default_schedule_key("cpu", "torch.bfloat16", cpu_has_amx_bf16=True) == CPU_AMX
    assert default_schedule_key("cpu", "bfloat16", cpu_has_amx_bf16=True) == CPU_AMX
    for dtype, amx in (("torch.float32", True), ("torch.bfloat16", False), ("auto", True)):
        assert default_schedule_key("cpu", dtype, cpu_has_amx_bf16=amx) == "cpu"
    assert default_schedule_key("cuda", "torch.bfloat16", cpu_has_amx_bf16=True) == "cuda"
    for key in (CPU_AMX, CPU_AVX512_BF16):
        schedule = default_schedule(key, max_size=16)
        sizes = [schedule.size_for(bs) for bs in range(1, 129)]
        assert sizes == sorted(sizes, reverse=True) and sizes[0] > 1
    assert default_schedule(CPU_AMX, max_size=16).size_for(32) == 1  # root-only from 32 (run 22)


def test_bf16_targets_on_avx512_bf16_cpus_without_amx_get_their_own_default():
    assert default_schedule_key("cpu", "torch.bfloat16", False, cpu_has_avx512_bf16=True) == CPU_AVX512_BF16
    assert default_schedule_key("cpu", "torch.bfloat16", True, cpu_has_avx512_bf16=True) == CPU_AMX
    assert default_schedule_key("cpu", "torch.float32", False, cpu_has_avx512_bf16=True) == "cpu"
    assert default_schedule_key("cuda", "torch.bfloat16", False, cpu_has_avx512_bf16=True) == "cuda"
    # Without AMX, trees of 8 pay at batch 1 only, of 4 at 2-3 and of 2 from 4 on (runs 81-85: a verify
    # near 8 rows, where the Rust bf16 tile is at its best); root-only steps from 32 (runs 87-88).
    schedule = default_schedule(CPU_AVX512_BF16, max_size=16)
    assert [schedule.size_for(bs) for bs in (1, 2, 3, 4, 16, 31, 32, 64)] == [8, 4, 4, 2, 2, 2, 1, 1]


def test_half_precision_on_a_cpu_without_bf16_instructions_gets_a_hint():
    hint = settings.slow_half_precision_hint
    for dtype in ("torch.bfloat16", "torch.float16"):
        assert "--dtype float32" in hint("cpu", dtype, cpu_has_amx=False, cpu_has_avx512_bf16=False)
        assert hint("cpu", dtype, cpu_has_amx=True, cpu_has_avx512_bf16=False) is None
        assert hint("cpu", dtype, cpu_has_amx=False, cpu_has_avx512_bf16=True) is None
        assert hint("cuda", dtype, cpu_has_amx=False, cpu_has_avx512_bf16=False) is None
    assert hint("cpu", "torch.float32", cpu_has_amx=False, cpu_has_avx512_bf16=False) is None
    # Half-precision linears on the Rust product's AVX2 kernels (bf16 widened, float16 by F16C): trees pay.
    for dtype in ("torch.bfloat16", "torch.float16"):
        assert hint("cpu", dtype, False, False, rust_half_products=True) is None


def test_the_fast_dtype_is_bf16_only_where_bf16_products_are_native():
    assert settings.fast_dtype("cpu", cpu_has_amx=True, cpu_has_avx512_bf16=False) == "bfloat16"
    assert settings.fast_dtype("cpu", cpu_has_amx=False, cpu_has_avx512_bf16=True) == "bfloat16"
    assert settings.fast_dtype("cpu", cpu_has_amx=False, cpu_has_avx512_bf16=False) == "float32"  # AVX2 only
    assert settings.fast_dtype("cuda", cpu_has_amx=False, cpu_has_avx512_bf16=False) == "bfloat16"


def test_the_auto_dtype_follows_this_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for amx, avx512_bf16, expected in (
        (False, False, "float32"),
        (False, True, "bfloat16"),
        (True, False, "bfloat16"),
    ):
        monkeypatch.setattr(settings, "cpu_has_amx_bf16", lambda amx=amx: amx)
        monkeypatch.setattr(settings, "cpu_has_avx512_bf16", lambda v=avx512_bf16: v)
        assert settings.resolve_dtype("auto") == expected
    assert settings.resolve_dtype("float32") == "float32" and settings.resolve_dtype("bfloat16") == "bfloat16"


def test_the_loaded_targets_dtype_picks_the_default(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_DART_TREE_SIZES", raising=False)
    monkeypatch.setattr(settings, "cpu_has_amx_bf16", lambda: True)
    args = _server_args(tmp_path, {})
    assert tree_size_schedule(args, torch.bfloat16).schedule == default_schedule(CPU_AMX, 8)
    assert tree_size_schedule(args, torch.float32).schedule == default_schedule("cpu", 8)
    monkeypatch.setattr(settings, "cpu_has_amx_bf16", lambda: False)
    monkeypatch.setattr(settings, "cpu_has_avx512_bf16", lambda: True)
    assert tree_size_schedule(args, torch.bfloat16).schedule == default_schedule(CPU_AVX512_BF16, 8)
    monkeypatch.setattr(settings, "cpu_has_avx512_bf16", lambda: False)
    assert tree_size_schedule(args, torch.bfloat16).schedule == default_schedule("cpu", 8)
