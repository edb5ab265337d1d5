"""How much CPU an idle server's scheduler takes: SGLang's scheduler busy-polls a whole core between
batches unless its idle sleeper is on."""

from __future__ import annotations

import time

import psutil

from sglang_dart.server_process import SglangServer

# A polling scheduler measured 1.01 cores idle, a sleeping one 0.02 (SmolLM2, a 2-core AVX2-only EPYC).
SLEEPING_AT_MOST = 0.25


def idle_scheduler_cores(server: SglangServer, seconds: float = 4.0) -> float:
    """Cores' worth of CPU time the server's scheduler processes use over `seconds` without requests."""
    assert server.proc is not None and server.alive(), "the server is not running"
    children = psutil.Process(server.proc.pid).children(recursive=True)
    schedulers = [p for p in children if p.name().startswith("sglang::sched")]
    assert schedulers, f"no scheduler process under the launcher, only {[p.name() for p in children]}"
    time.sleep(1.0)  # let the last request's step and the idle housekeeping finish

    def used() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in schedulers)

    start_cpu, start = used(), time.monotonic()
    time.sleep(seconds)
    return (used() - start_cpu) / (time.monotonic() - start)
