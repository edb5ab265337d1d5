"""Loaded at interpreter start by `sglang_dart_cpu.pth`: makes stock SGLang start on a machine with no GPU.

It only installs an import hook (microseconds). The hook acts at two moments:
- the first `import sglang`: if the machine has no accelerator (see `detect`), it sets
  SGLANG_USE_CPU_ENGINE=1, which SGLang reads at import time and which child processes inherit;
  then, still before SGLang runs, it tries the real `sgl_kernel` (a CPU build of it works); if that cannot
  load, every later `import sgl_kernel[.sub]` is served the stand-in from `kernel_shim`.
This must happen before SGLang's own modules import, which is earlier than SGLang's plugins load.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys

from sglang_dart.cpu import detect

_KERNEL_PACKAGE = "sgl_kernel"


class _CpuImportHook:
    """A meta-path finder that never finds anything itself except the `sgl_kernel` stand-in."""

    def __init__(self) -> None:
        self._engine_decided = False
        self._real_kernels: bool | None = None
        self._probing = False

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname == "sglang" and not self._engine_decided:
            self._engine_decided = True
            if detect.cpu_engine_wanted():
                detect.os.environ[detect.CPU_ENGINE_ENV] = "1"
            # Probe here, not inside an `import sgl_kernel`: a nested import of the same name would make
            # the import system execute the real package twice.
            if detect.cpu_engine_active() and _KERNEL_PACKAGE not in sys.modules:
                self._real_kernels = self._real_package_loads()
            return None
        if self._probing or fullname.partition(".")[0] != _KERNEL_PACKAGE:
            return None
        if not detect.cpu_engine_active() or self._real_kernels is not False:
            return None
        from sglang_dart.cpu.kernel_shim import stand_in_spec

        return stand_in_spec(fullname)

    def _real_package_loads(self) -> bool:
        """Import the real package once; on failure forget every piece of it that got imported."""
        self._probing = True
        try:
            importlib.import_module(_KERNEL_PACKAGE)
        except Exception:
            for name in [m for m in sys.modules if m.partition(".")[0] == _KERNEL_PACKAGE]:
                del sys.modules[name]
            return False
        finally:
            self._probing = False
        return True

    def real_kernels_loaded(self) -> bool | None:
        return self._real_kernels


def install() -> _CpuImportHook:
    for finder in sys.meta_path:
        if isinstance(finder, _CpuImportHook):
            return finder
    hook = _CpuImportHook()
    sys.meta_path.insert(0, hook)
    return hook


install()
