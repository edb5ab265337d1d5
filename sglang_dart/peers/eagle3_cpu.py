"""What SGLang's builtin EAGLE3 worker needs to serve on a CPU-only machine."""

from __future__ import annotations


def install() -> None:
    """Patch SGLang (in this process) so that --speculative-algorithm EAGLE3 serves on the CPU engine."""
