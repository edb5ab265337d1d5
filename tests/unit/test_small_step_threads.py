"""Single-threaded torch ops for small forwards: the thread count chosen per forward, the setting's
validation, and the Rust team keeping the configured size (each case in a fresh process, since torch's
thread count and the team's size are per process)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_dart.cpu import skinny_gemm, small_step_threads


def _run(code: str, **env_overrides: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in (skinny_gemm.THREADS_ENV, small_step_threads.ENV)}
    env.update(env_overrides)
    prelude = (
        "import os, torch; torch.set_num_threads(2); from sglang_dart.cpu import small_step_threads as s; "
    )
    run = subprocess.run([sys.executable, "-c", prelude + code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_small_forwards_run_torch_on_one_thread_and_large_ones_get_the_configured_count():
    code = (
        "seen = []\n"
        "for tokens in (1, 8, 64, 65, 2000, 0, 3):\n"
        "    s.apply_for(tokens); seen.append(torch.get_num_threads())\n"
        "print(seen)"
    )
    assert _run(code) == "[1, 1, 1, 2, 2, 2, 1]"


def test_bf16_forwards_keep_torchs_threads_past_16_tokens_whatever_the_requests():
    code = "print([s.threads_for(n, torch.bfloat16) for n in (1, 5, 16, 17, 32, 64)])"
    assert _run(code) == "[1, 1, 1, 2, 2, 2]"
    assert _run(code, **{small_step_threads.ENV: "32"}) == "[1, 1, 1, 1, 1, 2]"
    assert _run("print(s.threads_for(64, torch.float32), s.threads_for(65, torch.float32))") == "1 2"


def test_limit_comes_from_the_environment_and_zero_turns_it_off():
    code = "print([s.threads_for(n) for n in (1, 16, 17)])"
    assert _run(code, **{small_step_threads.ENV: "16"}) == "[1, 1, 2]"
    assert _run(code, **{small_step_threads.ENV: "0"}) == "[2, 2, 2]"


def test_rust_team_keeps_the_configured_size_and_polls_unless_set():
    code = (
        "from sglang_dart.cpu import skinny_gemm; s.apply_for(1); "
        "skinny_gemm._rust(torch.randn(2, 8), torch.randn(4, 8)); "
        "print(torch.get_num_threads(), os.environ[skinny_gemm.THREADS_ENV], "
        "os.environ[skinny_gemm.TEAM_SPIN_ENV])"
    )
    assert _run(code) == f"1 2 {small_step_threads.TEAM_SPIN_US}"
    assert _run(code, **{skinny_gemm.TEAM_SPIN_ENV: "0"}) == "1 2 0"


@pytest.mark.parametrize("value", ["-1", "many", "1.5"])
def test_bad_setting_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(small_step_threads.ENV, value)
    small_step_threads.small_step_tokens.cache_clear()
    try:
        with pytest.raises(ValueError, match=small_step_threads.ENV):
            small_step_threads.small_step_tokens()
    finally:
        small_step_threads.small_step_tokens.cache_clear()


@pytest.mark.parametrize(
    ("dtype", "device", "form", "expected"),
    [
        (torch.float32, "cpu", "auto", True),
        (torch.float32, "cpu", "rust", True),
        # bf16: the Rust product takes them only where its kernel pays (AVX512-BF16, no AMX) or is forced
        (torch.bfloat16, "cpu", "auto", skinny_gemm.bf16_kernel_pays()),
        (torch.bfloat16, "cpu", "rust", True),
        # float16: where the F16C kernel runs (any AVX2 CPU without AMX) or forced
        (torch.float16, "cpu", "auto", skinny_gemm.f16_kernel_pays()),
        (torch.float16, "cpu", "rust", True),
        (torch.float32, "cpu", "torch", False),
        (torch.float32, "cuda", "auto", False),
    ],
)
def test_only_forwards_whose_linears_rust_takes_are_switched(monkeypatch, dtype, device, form, expected):
    monkeypatch.setattr(skinny_gemm, "_mode", None)
    monkeypatch.setenv(skinny_gemm.ENV, form)
    runner = SimpleNamespace(dtype=dtype, device=device)
    assert small_step_threads.rust_takes_the_linears(runner) is expected
