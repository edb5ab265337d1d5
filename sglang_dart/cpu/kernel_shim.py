"""A stand-in for the CUDA-only `sgl_kernel` package on machines with no GPU.

SGLang's CPU path imports `sgl_kernel` ops at module import time. The PyPI wheel cannot load without
libcuda, so the bootstrap serves this module instead. Ops that `sglang_dart.cpu.ops` implements are
returned as they are; any other op is a function that raises, naming the op, when it is called, so a path
we have not covered fails loudly instead of silently.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import types
from collections.abc import Callable
from typing import Any

# Set on every stand-in module so other code can tell it is not the real package.
STAND_IN_MARKER = "__sglang_dart_stand_in__"

# Submodules of the real package that are plain Python with no native code (data types, not ops):
# served from the real package's own file, because callers need the objects they define.
PURE_PYTHON_SUBMODULES = frozenset({"scalar_type"})


class MissingKernelOpError(NotImplementedError):
    """An `sgl_kernel` op was called that has no CPU implementation here."""


def _missing_op(qualified_name: str) -> Callable[..., Any]:
    def missing(*_args: Any, **_kwargs: Any) -> Any:
        raise MissingKernelOpError(
            f"sgl_kernel op '{qualified_name}' was called, but the real sgl_kernel cannot load on this "
            "machine (no GPU) and sglang_dart provides no CPU implementation of it"
        )

    missing.__name__ = qualified_name.rsplit(".", 1)[-1]
    missing.__qualname__ = qualified_name
    return missing


class StandInKernelModule(types.ModuleType):
    """`sgl_kernel` or one of its submodules: attributes resolve to provided or failing ops."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        from sglang_dart.cpu.ops import PROVIDED_OPS

        op = PROVIDED_OPS.get(name) or _missing_op(f"{self.__name__}.{name}")
        setattr(self, name, op)
        return op


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = StandInKernelModule(spec.name)
        setattr(module, STAND_IN_MARKER, True)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []  # every stand-in is a package, so any submodule import resolves here too


def stand_in_spec(fullname: str) -> importlib.machinery.ModuleSpec:
    package, _, leaf = fullname.partition(".")
    if leaf in PURE_PYTHON_SUBMODULES:
        real = importlib.machinery.PathFinder.find_spec(package)
        for folder in (real.submodule_search_locations or []) if real else []:
            path = os.path.join(folder, f"{leaf}.py")
            if os.path.isfile(path):
                return importlib.util.spec_from_file_location(fullname, path)
    return importlib.machinery.ModuleSpec(fullname, _StandInLoader(), is_package=True)


def is_stand_in(module: object) -> bool:
    return bool(getattr(module, STAND_IN_MARKER, False))
