"""What `python -m sglang.launch_server` does with its arguments before it serves anything (load SGLang's
plugins, then `prepare_server_args`), for many argument lists in one process: each launcher start costs
~30 s of imports on a 2-core CI machine, and a refused configuration is refused right there. The test side
calls `refusals`; one case per test module should still go through the real launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

_RESULT = "REFUSALS "


def refusals(cases: list[tuple[list[str], dict[str, str]]], timeout: float = 300) -> list[str | None]:
    """For each (launcher arguments, environment variables) case, the message of the exception that
    preparing the server arguments raised, its type's name first, or None where they were accepted."""
    done = subprocess.run(
        [sys.executable, __file__, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for line in done.stdout.splitlines():
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT) :])
    raise AssertionError("the launcher-arguments process printed no result:\n" + done.stderr[-3000:])


def _prepare_each(cases: list[tuple[list[str], dict[str, Any]]]) -> list[str | None]:
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    results: list[str | None] = []
    for argv, env in cases:
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            prepare_server_args(argv)
            results.append(None)
        except (Exception, SystemExit) as error:  # noqa: BLE001 - the refusal is the result
            results.append(f"{type(error).__name__}: {error}")
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    return results


if __name__ == "__main__":
    print(_RESULT + json.dumps(_prepare_each(json.loads(sys.argv[1]))), flush=True)
