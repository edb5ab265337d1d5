"""The main job: `python -m sglang_dart.demo` serves SmolLM2 with DART and the shipped drafter, streams the
answer, and reports DART against plain decoding from the same run; in float32 the two texts are identical."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_serves_dart_with_the_shipped_drafter_and_compares_with_plain():
    run = subprocess.run(
        [sys.executable, "-m", "sglang_dart.demo", "--max-tokens", "32", "--dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "shipped/smollm2-135m-instruct/draft" in out
    assert re.search(r"\| plain \| \d+ \|", out) and re.search(r"\| DART \| \d+ \|", out)
    tau = float(re.search(r"tokens per verify step \(tau\): ([\d.]+)", out).group(1))
    assert 1.0 <= tau <= 8.0  # at most the tree depth d + 1
    assert re.search(r"DART / plain: [\d.]+x", out)
    assert "identical text: yes" in out
