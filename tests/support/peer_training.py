"""The EAGLE3 and DFLASH test drafters, trained side by side through `python -m sglang_dart.train`.

Each trainer runs on one torch thread (on a loaded 2-core machine two OpenMP threads ran the target 17x
slower), so two of them fill the two cores: both drafters take about as long as the slower one alone.
Each trains a fixed number of steps, not a time budget, so that a slow machine gets the same drafter
(CI stopped an EAGLE3 run at one minute on an AVX2-only machine after 9 steps, and its drafter fell under
the acceptance floor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_S = 900

# The EAGLE3 drafter: 3 training-time-test steps, a 2,048-token draft vocabulary, 60 steps; it learns (and the
# test then decodes) the first 32 tokens of each plain answer. 50 steps reached 0.71 / 0.62 / 0.53 top-1 by
# step on the AVX2-only machine, and 60 steps gave 2.65 tokens per verify step.
EAGLE3_ANSWER_TOKENS = 32
EAGLE3_FLAGS = [
    "--format", "eagle3", "--target-dtype", "float32", "--draft-vocab-size", "2048",
    "--eagle3-ttt-steps", "3", "--eagle3-window", "96", "--lr", "3e-3", "--max-steps", "60",
]  # fmt: skip

# The DFLASH drafter: blocks of 4 (anchor token + 3 drafts per verify step), 150 steps of one sequence and
# 64 anchors each, on the first 24 tokens of each plain answer: 1.91 tokens per verify step on the AVX2-only
# machine (200 steps gave 2.40, 120 steps 1.55-1.60). 150, not 200: the EAGLE3 training beside it ends first,
# so the 50 steps cut save about 40 s of CI's critical path.
DFLASH_ANSWER_TOKENS = 24
DFLASH_BLOCK = 4
DFLASH_FLAGS = [
    "--format", "dflash", "--dflash-block-size", str(DFLASH_BLOCK), "--max-steps", "150",
    "--sequences-per-step", "1", "--anchors", "64", "--lr", "3e-3",
]  # fmt: skip


@dataclass(frozen=True)
class Training:
    """One drafter to train: its format-specific flags and the rows (prompt + answer ids) it learns."""

    name: str
    flags: list[str]
    rows: list[list[int]]


@dataclass(frozen=True)
class Trained:
    out: Path  # the checkpoint directory
    stdout: str
    stderr: str
    returncode: int


def train_side_by_side(target: Path, trainings: list[Training], root: Path) -> dict[str, Trained]:
    """Run every training at once, in float32, with no held-out slice; name -> its result."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    running: dict[str, tuple[subprocess.Popen, Path]] = {}
    results = {}
    try:
        for job in trainings:
            work = root / job.name
            work.mkdir(parents=True, exist_ok=True)
            data = work / "answers.jsonl"
            data.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in job.rows))
            command = [
                sys.executable, "-m", "sglang_dart.train", "--target", str(target), "--data", str(data),
                "--out", str(work / "draft"), "--no-bf16", "--holdout", "0", *job.flags,
            ]  # fmt: skip
            # Output goes to files: a pipe left unread while another training is awaited would stall it.
            with open(work / "stdout.txt", "w") as out, open(work / "stderr.txt", "w") as err:
                running[job.name] = (subprocess.Popen(command, stdout=out, stderr=err, env=env), work)
        for name, (proc, work) in running.items():
            proc.wait(timeout=TIMEOUT_S)
            stdout, stderr = (work / "stdout.txt").read_text(), (work / "stderr.txt").read_text()
            results[name] = Trained(work / "draft", stdout, stderr, proc.returncode)
    finally:  # a failed launch or a timeout leaves no training behind
        for proc, _ in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results
