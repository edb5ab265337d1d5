"""`sglang.Engine(model_path=M, device="cpu")`: the offline engine entry point, in its own process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.server

ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import sglang

    if __name__ == "__main__":
        model, prompts = sys.argv[1], json.loads(sys.argv[2])
        engine = sglang.Engine(
            model_path=model, device="cpu", dtype="float32", max_total_tokens=32768, sleep_on_idle=True
        )
        try:
            outs = engine.generate(prompts, {"max_new_tokens": 16, "temperature": 0.0})
            print("RESULT " + json.dumps([o["output_ids"] for o in outs]))
        finally:
            engine.shutdown()
    """
)


def test_engine_matches_http_server(tiny_llama_dir, tiny_server, tmp_path):
    prompts = ["def f(x):", "import os\n", "class A:"]
    script = tmp_path / "engine_run.py"
    script.write_text(ENGINE_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(tiny_llama_dir), json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    engine_ids = json.loads(line[len("RESULT ") :])
    server_ids = [
        tiny_server.generate({"text": p, "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}})[
            "output_ids"
        ]
        for p in prompts
    ]
    assert engine_ids == server_ids
