"""`sglang.Engine(model_path=M)` (device="cpu" without a GPU): the offline engine entry point, in its own
process."""

from __future__ import annotations

import pytest

from sglang_dart.server_process import default_engine_kwargs
from tests.support.engine_run import run_engine

pytestmark = pytest.mark.server


def test_engine_matches_http_server(tiny_llama_dir, tiny_server):
    prompts = ["def f(x):", "import os\n", "class A:"]
    greedy = {"max_new_tokens": 16, "temperature": 0.0}
    engine_kwargs = {
        "model_path": str(tiny_llama_dir),
        "dtype": "float32",
        **default_engine_kwargs(),
    }
    results = run_engine(engine_kwargs, prompts, greedy)
    assert isinstance(results, list), results
    server_ids = [tiny_server.generate({"text": p, "sampling_params": greedy})["output_ids"] for p in prompts]
    assert [r["output_ids"] for r in results] == server_ids
