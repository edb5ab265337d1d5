"""An idle server on the CPU engine sleeps instead of polling.

Without `--sleep-on-idle`, SGLang's scheduler loop polls its sockets without pause between batches, so an
idle server keeps a whole core busy. On a GPU host that core is spare; on a CPU-only machine it is taken
from the model's own threads and from any other process (issue 28, item 6: two idle servers took ~40% of
a core each while a third served). SGLang's idle sleeper waits on the same sockets with zmq's poller, so a
request wakes it at once, and it sleeps only when nothing runs, waits or compiles a grammar. So on the CPU
engine it is on by default; `SGLANG_DART_SLEEP_ON_IDLE=0` keeps SGLang's polling.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "SGLANG_DART_SLEEP_ON_IDLE"


def wanted() -> bool:
    """Whether idle CPU servers sleep (unset or empty: yes); any value other than 0 or 1 is refused, and
    the plugin then stops the launcher."""
    value = os.environ.get(ENV, "").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, not {value!r}")
    return value == "1"


def apply(server_args: Any) -> None:
    """Turn SGLang's idle sleeper on (runs once the server arguments are resolved, before any scheduler
    starts; resolved arguments are read-only except through `override`, which records the change)."""
    if wanted() and not server_args.sleep_on_idle:
        server_args.override(__name__, sleep_on_idle=True)
