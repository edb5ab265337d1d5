"""`sglang.Engine(model_path=M, device="cpu")`: the offline engine entry point, in its own process."""

from __future__ import annotations

import pytest

from tests.support.engine_run import run_engine

pytestmark = pytest.mark.server


def test_engine_matches_http_server(tiny_llama_dir, tiny_server):
    prompts = ["def f(x):", "import os\n", "class A:"]
    greedy = {"max_new_tokens": 16, "temperature": 0.0}
    engine_kwargs = {
        "model_path": str(tiny_llama_dir),
        "device": "cpu",
        "dtype": "float32",
        "max_total_tokens": 32768,
        "sleep_on_idle": True,
    }
    results = run_engine(engine_kwargs, prompts, greedy)
    assert isinstance(results, list), results
    server_ids = [tiny_server.generate({"text": p, "sampling_params": greedy})["output_ids"] for p in prompts]
    assert [r["output_ids"] for r in results] == server_ids
