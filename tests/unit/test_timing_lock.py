"""Start-up timing of CPU linear forms takes turns between processes (`timing_lock`): a second process
waits for the first, a bounded time, and the lock goes when its holder does."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from sglang_dart.cpu.timing_lock import timing_alone

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _holder(path: Path, seconds: float) -> subprocess.Popen:
    """Another process holding the lock for `seconds` (returned once it holds it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_process_waits_for_the_first(tmp_path):
    path = tmp_path / "timing.lock"
    holder = _holder(path, 1.0)
    started = time.monotonic()
    with timing_alone(max_wait=30, path=path) as held:
        waited = time.monotonic() - started
        assert held
        assert holder.poll() is not None or waited >= 0.5  # it ran once the holder was done
    holder.wait(timeout=30)
    assert waited >= 0.5


def test_the_wait_is_bounded(tmp_path):
    path = tmp_path / "timing.lock"
    holder = _holder(path, 30.0)
    try:
        started = time.monotonic()
        with timing_alone(max_wait=0.3, path=path) as held:
            assert not held  # timed anyway, unlocked
        assert time.monotonic() - started < 5
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_holder_that_dies_leaves_the_lock_free(tmp_path):
    path = tmp_path / "timing.lock"
    holder = _holder(path, 30.0)
    holder.kill()
    holder.wait(timeout=30)
    with timing_alone(max_wait=5, path=path) as held:
        assert held
    with timing_alone(max_wait=0, path=path) as held:  # and released on the way out
        assert held


def test_no_lock_to_take_times_unlocked(tmp_path):
    with timing_alone(max_wait=0, path=tmp_path / "missing-dir" / "timing.lock") as held:
        assert not held
