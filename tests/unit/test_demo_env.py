"""The demo's servers run the row-invariant setting in bf16 on a CPU engine whose bf16 linears the Rust
product takes, and nowhere else: not in float32, not on AMX CPUs, not on a GPU host, not over a user's
own setting."""

from __future__ import annotations

import pytest

from sglang_dart import demo
from sglang_dart.cpu import skinny_gemm


@pytest.fixture
def cpu_engine(monkeypatch):
    monkeypatch.delenv(skinny_gemm.ENV, raising=False)
    monkeypatch.setattr(demo, "default_device_args", lambda: ["--device", "cpu"])
    monkeypatch.setattr(skinny_gemm, "bf16_kernel_pays", lambda: True)


def test_bf16_on_a_cpu_whose_bf16_linears_rust_takes_is_row_invariant(cpu_engine):
    assert demo._row_invariant_env("bfloat16") == {skinny_gemm.ENV: "rust"}
    assert demo._row_invariant_env("float32") == {}


def test_amx_a_gpu_host_and_a_user_setting_keep_their_own(cpu_engine, monkeypatch):
    monkeypatch.setattr(skinny_gemm, "bf16_kernel_pays", lambda: False)  # AMX
    assert demo._row_invariant_env("bfloat16") == {}
    monkeypatch.setattr(skinny_gemm, "bf16_kernel_pays", lambda: True)
    monkeypatch.setenv(skinny_gemm.ENV, "auto")
    assert demo._row_invariant_env("bfloat16") == {}
    monkeypatch.delenv(skinny_gemm.ENV)
    monkeypatch.setattr(demo, "default_device_args", lambda: [])  # a GPU host
    assert demo._row_invariant_env("bfloat16") == {}
