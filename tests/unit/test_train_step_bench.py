"""benchmarks/train_step.py times a packed and a one-at-a-time DART step on the same features and drafter."""

import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_step.py"


def test_the_training_step_benchmark_times_both_forms(tiny_llama_dir, tmp_path):
    data = tmp_path / "answers.jsonl"
    rows = [{"input_ids": list(range(10 + i, 40 + 3 * i)), "prompt_len": 4} for i in range(6)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--target",
            str(tiny_llama_dir),
            "--data",
            str(data),
            "--sequences",
            "6",
        ]
        + ["--steps", "2", "--rounds", "2", "--target-dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    rounds = re.findall(
        r"^round \d: packed ([\d.]+) sequences/s, one at a time ([\d.]+) \(([\d.]+)x\)$", run.stdout, re.M
    )
    assert len(rounds) == 2 and all(float(packed) > 0 and float(alone) > 0 for packed, alone, _ in rounds)
    assert re.search(r"median of 2 rounds: [\d.]+x$", run.stdout, re.M)
