"""Where a DART step's time goes: with SGLANG_DART_PROFILE=1 the worker logs the mean milliseconds per
step of each phase (target verify, acceptance, draft forward, pruning, ...) every
SGLANG_DART_PROFILE_EVERY steps (default 50). Off by default; then it costs one attribute check."""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


class PhaseTimer:
    def __init__(self, enabled: bool | None = None, every: int | None = None) -> None:
        self.enabled = os.environ.get("SGLANG_DART_PROFILE") == "1" if enabled is None else enabled
        self.every = every or int(os.environ.get("SGLANG_DART_PROFILE_EVERY", "50"))
        self._totals: dict[str, float] = defaultdict(float)
        self._steps = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self._totals[name] += time.perf_counter() - start

    def step_done(self, batch_size: int) -> None:
        if not self.enabled:
            return
        self._steps += 1
        if self._steps % self.every:
            return
        parts = ", ".join(f"{k} {1000 * v / self._steps:.1f}" for k, v in self._totals.items())
        logger.info(
            "DART step profile (ms/step over %d steps, last bs %d): %s", self._steps, batch_size, parts
        )
        self._totals.clear()
        self._steps = 0
