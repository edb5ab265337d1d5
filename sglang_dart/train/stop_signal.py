"""A training run stopped by SIGTERM or SIGINT (Ctrl-C, `timeout`, a job scheduler) keeps its work: the
signal only asks the loop to stop after the step it is in, and the run saves its drafter as at the end
of its budget (then `--init` continues it). A second signal stops at once, the default way."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_requested = threading.Event()


def stop_requested() -> bool:
    return _requested.is_set()


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """While inside: the first SIGTERM or SIGINT asks for a stop, a second one ends the process as the
    signal would have. Outside the main thread (no handlers there) it changes nothing."""
    _requested.clear()  # a request belongs to one loop: an earlier stopped run's must not end this one
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, frame: object) -> None:
        if _requested.is_set():  # asked twice: do what the signal would have done
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        print(f"\n{signal.Signals(signum).name}: stopping after this step and saving", flush=True)
        _requested.set()

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:  # the request stays readable after the loop: a stopped run skips its held-out estimate
        for sig, old in previous.items():
            signal.signal(sig, old)
