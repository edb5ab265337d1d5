"""Bad server arguments end the launcher with SGLang's own clear error, never a hang. The eight launches
run side by side (each is mostly single-threaded imports) in one module fixture; each test reads its own."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_dart.server_process import device_flag, free_port, run_launcher

pytestmark = [pytest.mark.server, pytest.mark.standalone]


@pytest.fixture(scope="module")
def refused_launches(tiny_llama_dir, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    missing = tmp_path_factory.mktemp("missing") / "no-such-model"
    launches = {
        "missing model": ([str(missing), *device_flag()], None),
        "unknown device": ([str(tiny_llama_dir), "--device", "tpu9"], None),
        "bad gemm setting": (
            [str(tiny_llama_dir), "--device", "cpu"],
            {"SGLANG_DART_CPU_SKINNY_GEMM": "fastest"},
        ),
        "bad packed budget": (
            [str(tiny_llama_dir), "--device", "cpu"],
            {"SGLANG_DART_PACKED_WEIGHTS_GB": "lots"},
        ),
        "bad tuning budget": (
            [str(tiny_llama_dir), "--device", "cpu"],
            {"SGLANG_DART_GEMM_TUNING_SECONDS": "-5"},
        ),
        "bad row-wise setting": (
            [str(tiny_llama_dir), "--device", "cpu"],
            {"SGLANG_DART_CPU_ROWWISE": "yes"},
        ),
        "bad attention setting": (
            [str(tiny_llama_dir), "--device", "cpu"],
            {"SGLANG_DART_CPU_ATTENTION": "sdpa"},
        ),
        "bad idle setting": (
            [str(tiny_llama_dir), "--device", "cpu"],
            {"SGLANG_DART_SLEEP_ON_IDLE": "yes"},
        ),
    }
    with ThreadPoolExecutor(max_workers=len(launches)) as pool:
        futures = {
            name: pool.submit(run_launcher, ["--model-path", *args, "--port", str(free_port())], env=env)
            for name, (args, env) in launches.items()
        }
        return {name: future.result() for name, future in futures.items()}


def _refused_naming(result: subprocess.CompletedProcess, text: str) -> None:
    assert result.returncode != 0
    assert text in result.stdout + result.stderr, (result.stdout + result.stderr)[-3000:]


def test_missing_model_path_fails_fast(refused_launches):
    _refused_naming(refused_launches["missing model"], "no-such-model")


def test_unknown_device_is_rejected(refused_launches):
    _refused_naming(refused_launches["unknown device"], "tpu9")


def test_bad_cpu_gemm_setting_stops_the_launcher(refused_launches):
    _refused_naming(refused_launches["bad gemm setting"], "SGLANG_DART_CPU_SKINNY_GEMM='fastest'")


def test_bad_packed_weights_budget_stops_the_launcher(refused_launches):
    _refused_naming(refused_launches["bad packed budget"], "SGLANG_DART_PACKED_WEIGHTS_GB='lots'")


def test_bad_tuning_budget_stops_the_launcher(refused_launches):
    _refused_naming(refused_launches["bad tuning budget"], "SGLANG_DART_GEMM_TUNING_SECONDS='-5'")


def test_bad_row_wise_setting_stops_the_launcher(refused_launches):
    _refused_naming(refused_launches["bad row-wise setting"], "SGLANG_DART_CPU_ROWWISE='yes'")


def test_bad_attention_setting_stops_the_launcher(refused_launches):
    _refused_naming(refused_launches["bad attention setting"], "SGLANG_DART_CPU_ATTENTION='sdpa'")


def test_bad_idle_sleep_setting_stops_the_launcher(refused_launches):
    message = "SGLANG_DART_SLEEP_ON_IDLE must be 0 or 1, not 'yes'"
    _refused_naming(refused_launches["bad idle setting"], message)
