"""`sglang.Engine(**kwargs)`, the offline entry point, run in a process of its own (it spawns its scheduler
processes and must be built under `if __name__ == "__main__"`); the test side calls `run_engine`."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

_RESULT, _ERROR = "RESULT ", "ERROR "


def run_engine(
    engine_kwargs: dict[str, Any], prompts: list[str], sampling_params: dict[str, Any], timeout: float = 600
) -> list[dict[str, Any]] | str:
    """Each prompt's {"output_ids", "meta_info"} from one `Engine.generate` call, or the message of the
    exception the Engine's construction raised (a refused configuration)."""
    job = json.dumps({"engine": engine_kwargs, "prompts": prompts, "sampling_params": sampling_params})
    done = subprocess.run(
        [sys.executable, __file__, job], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for line in done.stdout.splitlines():
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT) :])
        if line.startswith(_ERROR):
            return json.loads(line[len(_ERROR) :])
    output = done.stdout[-3000:] + done.stderr[-3000:]
    raise AssertionError("the engine process printed no result:\n" + output)


def _main() -> None:
    import sglang

    job = json.loads(sys.argv[1])
    try:
        engine = sglang.Engine(**job["engine"])
    except Exception as exc:  # noqa: BLE001 - reported to the test, which checks the message
        print(_ERROR + json.dumps(f"{type(exc).__name__}: {exc}"), flush=True)
        return
    try:
        outs = engine.generate(job["prompts"], job["sampling_params"])
        rows = [{"output_ids": o["output_ids"], "meta_info": o["meta_info"]} for o in outs]
        print(_RESULT + json.dumps(rows, default=str), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    _main()
