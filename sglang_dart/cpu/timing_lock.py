"""One process at a time times CPU linear forms on a machine.

Each CPU server times the forms of its linear layers once its weights are in (`gemm_tuning`), and keeps
the fastest for its lifetime. Servers started together (a DART and a plain server side by side, the demo,
data-parallel replicas, a benchmark's A/B) reached that moment together and timed against each other on
the same cores: on the 2-core EPYC two such servers chose rust / torch for 55 / 25 and 57 / 20 buckets
where one alone chose 68 / 12. So the timing runs under an exclusive `flock` on a file in the temp
directory; the others wait for it (bounded: past `max_wait` a process times anyway). The kernel drops the
lock when its holder exits, crashed or not. Where the file cannot be opened the timing runs unlocked.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_PATH = Path(tempfile.gettempdir()) / "sglang_dart-cpu-timing.lock"
POLL_SECONDS = 0.05


def _open(path: Path) -> int | None:
    """A descriptor to lock (flock needs no write access), or None."""
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
        try:
            return os.open(path, flags, 0o666)
        except OSError:
            continue
    return None


def _acquire(fd: int, deadline: float) -> bool:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_SECONDS)
        except OSError:  # a file system without locks
            return False


@contextmanager
def timing_alone(max_wait: float, path: Path | None = None) -> Iterator[bool]:
    """Run the block holding the machine's timing lock, after waiting at most `max_wait` seconds for it.
    Yields whether the lock is held (False: waited too long, or no lock to take)."""
    fd = _open(path or LOCK_PATH)
    held = fd is not None and _acquire(fd, time.monotonic() + max_wait)
    try:
        yield held
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock
