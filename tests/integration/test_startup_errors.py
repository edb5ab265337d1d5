"""Bad server arguments end the launcher with SGLang's own clear error, never a hang."""

from __future__ import annotations

import pytest

from sglang_dart.server_process import device_flag, free_port, run_launcher

pytestmark = pytest.mark.server


def test_missing_model_path_fails_fast(tmp_path):
    missing = tmp_path / "no-such-model"
    result = run_launcher(["--model-path", str(missing), *device_flag(), "--port", str(free_port())])
    assert result.returncode != 0
    assert "no-such-model" in result.stdout + result.stderr


def test_unknown_device_is_rejected(tiny_llama_dir):
    result = run_launcher(
        ["--model-path", str(tiny_llama_dir), "--device", "tpu9", "--port", str(free_port())]
    )
    assert result.returncode != 0
    assert "tpu9" in result.stdout + result.stderr


def test_bad_cpu_gemm_setting_stops_the_launcher(tiny_llama_dir):
    result = run_launcher(
        ["--model-path", str(tiny_llama_dir), "--device", "cpu", "--port", str(free_port())],
        env={"SGLANG_DART_CPU_SKINNY_GEMM": "fastest"},
    )
    assert result.returncode != 0
    assert "SGLANG_DART_CPU_SKINNY_GEMM='fastest'" in result.stdout + result.stderr
