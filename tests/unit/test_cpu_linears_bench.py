import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_dart.cpu import skinny_gemm

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_linears.py"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_linears_benchmark_times_every_product_in_either_dtype(dtype):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "1", "3", "--repeats", "1", "--layers", "1"]
        + ["--dtype", dtype],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert run.stdout.startswith(dtype)
    header = next(line for line in run.stdout.splitlines() if line.startswith("| rows |"))
    forms = re.findall(r"F\.linear / (\w+)", header)
    packs = dtype == "bfloat16" and skinny_gemm.packing_available()
    assert forms == (["rust", "packed"] if packs else ["rust"])
    # | rows | F.linear ms | then "ms | ratio" per other form
    cells = r"\| ([\d.]+) \| ([\d.]+)x " * len(forms)
    rows = re.findall(rf"^\| (\d+) \| ([\d.]+) {cells}\|$", run.stdout, re.MULTILINE)
    assert [int(r[0]) for r in rows] == [1, 3]
    assert all(float(value) > 0 for row in rows for value in row[1:])


def test_the_linears_benchmark_refuses_an_unknown_dtype():
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--dtype", "float16"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode != 0 and "invalid choice" in run.stderr
