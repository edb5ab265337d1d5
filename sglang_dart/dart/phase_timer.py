"""Where a DART step's time goes: with SGLANG_DART_PROFILE=1 the worker logs, every
SGLANG_DART_PROFILE_EVERY steps (default 50), the mean milliseconds per step of each phase (target
verify, acceptance, draft forward, pruning, ...) for each batch size it ran, plus "outside": the rest of
the interval since the previous decode step ended (the scheduler's own work: result processing, batch
upkeep, streaming; and the worker's code outside the named phases). Prefills (the target's extend and
the draft after it) belong to no step: they are reported apart, as their count and mean milliseconds.
Off by default; then it costs one attribute check.

SGLANG_DART_CPROFILE=PATH runs cProfile over the scheduler thread (the worker and the scheduler's own
per-step work) for SGLANG_DART_CPROFILE_STEPS decode steps (default 300) after the first
SGLANG_DART_CPROFILE_START (default 200), and writes the pstats to PATH ("{pid}" in it becomes the
process id): where a host-bound step's time goes, function by function (on a GPU the step waits on the
host, not on kernels)."""

from __future__ import annotations

import cProfile
import logging
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

OUTSIDE = "outside"


class StepCProfile:
    """cProfile of decode steps START..START+STEPS, written once (see the module's docstring)."""

    def __init__(self) -> None:
        self.path = os.environ.get("SGLANG_DART_CPROFILE") or None
        self.start = max(1, int(os.environ.get("SGLANG_DART_CPROFILE_START", "200")))
        self.stop = self.start + int(os.environ.get("SGLANG_DART_CPROFILE_STEPS", "300"))
        self._steps = 0
        self._profile: cProfile.Profile | None = None

    def step_done(self) -> None:
        if self.path is None:
            return
        self._steps += 1
        # A diagnostic never stops serving: a profiler already active or an unwritable path is logged.
        try:
            if self._steps == self.start:
                self._profile = cProfile.Profile()
                self._profile.enable()
            elif self._steps == self.stop and self._profile is not None:
                self._profile.disable()
                path = self.path.replace("{pid}", str(os.getpid()))
                self._profile.dump_stats(path)
                logger.info("DART cProfile of decode steps %d-%d written to %s", self.start, self.stop, path)
                self.path, self._profile = None, None
        except (OSError, ValueError) as exc:
            logger.warning("SGLANG_DART_CPROFILE: no profile (%s)", exc)
            self.path, self._profile = None, None


class PhaseTimer:
    def __init__(self, enabled: bool | None = None, every: int | None = None) -> None:
        self.cprofile = StepCProfile()
        self.enabled = os.environ.get("SGLANG_DART_PROFILE") == "1" if enabled is None else enabled
        self.every = every or int(os.environ.get("SGLANG_DART_PROFILE_EVERY", "50"))
        self._step: dict[str, float] = defaultdict(float)  # the phases of the step under way
        self._totals: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._counts: dict[int, int] = defaultdict(int)
        self._steps = 0
        self._last_end: float | None = None
        self._prefills = 0
        self._prefill_seconds = 0.0
        self._prefill_draft_seconds = 0.0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self._step[name] += time.perf_counter() - start

    def step_done(self, batch_size: int) -> None:
        self.cprofile.step_done()
        if not self.enabled:
            return
        now = time.perf_counter()
        totals = self._totals[batch_size]
        for name, seconds in self._step.items():
            totals[name] += seconds
        if self._last_end is not None:
            totals[OUTSIDE] += max(now - self._last_end - sum(self._step.values()), 0.0)
        self._step.clear()
        self._last_end = now
        self._counts[batch_size] += 1
        self._steps += 1
        if self._steps % self.every == 0:
            logger.info("DART step profile (ms/step): %s", self.report())
            self._totals.clear()
            self._counts.clear()
            self._prefills, self._prefill_seconds, self._prefill_draft_seconds = 0, 0.0, 0.0

    def step_start(self) -> None:
        """A decode step begins: phases timed since the last one (a prefill's draft) are not its own."""
        self._step.clear()

    def interrupt(self) -> None:
        """A prefill ran since the last step: the next interval is not one decode step's."""
        self._last_end = None
        self._step.clear()

    def prefill_done(self, seconds: float) -> None:
        """A prefill forward and the draft after it took `seconds`, of which the phases timed since the
        last step (the draft's) are its draft share."""
        if not self.enabled:
            return
        self._prefills += 1
        self._prefill_seconds += seconds
        self._prefill_draft_seconds += sum(self._step.values())
        self._step.clear()

    def report(self) -> str:
        parts = []
        for bs in sorted(self._totals, reverse=True):
            n = self._counts[bs]
            phases = ", ".join(f"{k} {1000 * v / n:.1f}" for k, v in self._totals[bs].items())
            parts.append(f"bs {bs} x{n}: {phases}")
        if self._prefills:
            n = self._prefills
            mean_ms, draft_ms = 1000 * self._prefill_seconds / n, 1000 * self._prefill_draft_seconds / n
            parts.append(f"prefill x{n}: {mean_ms:.1f} (draft {draft_ms:.1f})")
        return "; ".join(parts)
