"""What SGLang's builtin DFLASH worker needs to serve on a CPU-only machine."""

from __future__ import annotations


def install() -> None:
    """Patch SGLang (in this process) so that --speculative-algorithm DFLASH serves on the CPU engine."""
