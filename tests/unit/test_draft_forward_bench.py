"""benchmarks/draft_forward.py runs a served drafter's step (projections joined, as `load_weights` leaves
them) after a verify or after a prefill, and prints one row per batch size and depth."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "draft_forward.py"
ROOT = SCRIPT.parents[1]


@pytest.mark.parametrize("after", ["verify", "prefill"])
def test_the_draft_step_benchmark_prints_every_depth(after):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--batch-sizes", "1", "2", "--depths", "3", "--dtype", "float32"]
        + ["--draft-vocab", "512", "--prefix", "16", "--steps", "1", "--repeats", "1", "--after", after],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
        cwd=ROOT,
    )
    rows = re.findall(
        r"^\| (\d+) \| (\d+)(?: \(full\))? \| ([\d.]+) \| ([\d.]+)x \|$", run.stdout, re.MULTILINE
    )
    assert [(int(r[0]), int(r[1])) for r in rows] == [(1, 8), (1, 3), (2, 8), (2, 3)]
    assert all(float(r[2]) > 0 for r in rows)
    assert run.stdout.startswith(f"draft step after a {after}")
