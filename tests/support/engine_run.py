"""`sglang.Engine(**kwargs)`, the offline entry point, run in a process of its own (it spawns its scheduler
processes and must be built under `if __name__ == "__main__"`); the test side calls `run_engine`, or
`run_engines` for several engines one after the other in one process (SGLang's imports paid once)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

_RESULT, _ERROR = "RESULT ", "ERROR "

EngineJob = tuple[dict[str, Any], list[str], dict[str, Any]]  # Engine kwargs, prompts, sampling params


def run_engine(
    engine_kwargs: dict[str, Any], prompts: list[str], sampling_params: dict[str, Any], timeout: float = 600
) -> list[dict[str, Any]] | str:
    """Each prompt's {"output_ids", "meta_info"} from one `Engine.generate` call, or the message of the
    exception the Engine's construction raised (a refused configuration)."""
    return run_engines([(engine_kwargs, prompts, sampling_params)], timeout)[0]


def run_engines(jobs: list[EngineJob], timeout: float = 900) -> list[list[dict[str, Any]] | str]:
    """`run_engine`'s result for each job, its engine built after the previous one shut down."""
    payload = json.dumps([{"engine": e, "prompts": p, "sampling_params": s} for e, p, s in jobs])
    done = subprocess.run(
        [sys.executable, __file__, payload], capture_output=True, text=True, timeout=timeout, check=False
    )
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, output
    results = []
    for line in done.stdout.splitlines():
        for mark in (_RESULT, _ERROR):
            if line.startswith(mark):
                results.append(json.loads(line[len(mark) :]))
    assert len(results) == len(jobs), f"{len(results)} results for {len(jobs)} engines:\n{output}"
    return results


def _run_one(job: dict[str, Any]) -> None:
    import sglang

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
    for one in json.loads(sys.argv[1]):
        _run_one(one)
