"""The interpreter-start bootstrap: CPU engine switched on, sgl_kernel stand-in served, missing ops named."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE", "SGLANG_DART_CPU")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**clean, **env},
    )


def test_bootstrap_enables_cpu_engine_and_stand_in():
    result = _run(
        """
        import os, sglang, sgl_kernel
        from sglang_dart.cpu.kernel_shim import is_stand_in
        from sglang_dart.cpu.ops import copy_all_layer_kv_cache_cpu
        print(os.environ["SGLANG_USE_CPU_ENGINE"], is_stand_in(sgl_kernel))
        print(sgl_kernel.copy_all_layer_kv_cache_cpu is copy_all_layer_kv_cache_cpu)
        from sgl_kernel.scalar_type import scalar_types
        print(hasattr(scalar_types, "uint4b8"))  # the real pure-Python module
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "True", "True", "True"]


def test_missing_op_raises_naming_it():
    result = _run(
        """
        import sglang
        from sgl_kernel.speculative import some_unprovided_op
        some_unprovided_op(1, 2)
        """
    )
    assert result.returncode != 0
    assert "MissingKernelOpError" in result.stderr
    assert "sgl_kernel.speculative.some_unprovided_op" in result.stderr


def test_force_off_leaves_sglang_alone():
    result = _run("import os, sglang; print(os.environ.get('SGLANG_USE_CPU_ENGINE'))", SGLANG_DART_CPU="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"
