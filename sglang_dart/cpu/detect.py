"""Decide, cheaply and without importing torch, whether this process runs on a machine with no GPU."""

from __future__ import annotations

import ctypes
import os

# "1": always use the CPU path; "0": never; unset: decide from the machine.
FORCE_ENV = "SGLANG_DART_CPU"
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"


def has_accelerator() -> bool:
    """True when an NVIDIA driver (libcuda) or a ROCm device node is present."""
    if os.path.exists("/dev/kfd"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def cpu_engine_wanted() -> bool:
    """Whether SGLang's CPU engine should be switched on for this process tree."""
    forced = os.environ.get(FORCE_ENV)
    if forced is not None:
        return forced == "1"
    if os.environ.get(CPU_ENGINE_ENV) is not None:
        return os.environ[CPU_ENGINE_ENV] == "1"
    return not has_accelerator()


def cpu_engine_active() -> bool:
    return os.environ.get(CPU_ENGINE_ENV) == "1"
