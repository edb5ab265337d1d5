"""A training run stopped by SIGTERM/SIGINT keeps its work: the loop ends after its step and the run saves
its drafter (which `--init` continues) instead of dying with nothing written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from sglang_dart.train import stop_signal
from sglang_dart.train.trainer import TrainSettings, train
from tests.support.tiny_models import training_corpus
from tests.unit.test_train import _copy_task, _drafter


def test_a_signal_ends_the_loop_after_its_step_and_the_handlers_are_restored():
    model, _, vocab = _drafter()
    before = signal.getsignal(signal.SIGTERM)
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith("step 3/"):
            os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (main) thread's handler

    settings = TrainSettings(
        anchors_per_sequence=4, sequences_per_step=1, max_steps=1000, warmup_steps=1, bf16_autocast=False,
        log_every=1,
    )  # fmt: skip
    try:
        losses = train(model, _copy_task(count=4, length=12, seed=2), vocab, settings, log=log)
        assert len(losses) == 3 and "stopped by a signal after 3 steps" in lines
        assert stop_signal.stop_requested()  # read by the run: it saves and skips its held-out estimate
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        stop_signal._requested.clear()


def test_a_stopped_training_run_saves_its_drafter(tiny_llama_dir: Path, tmp_path: Path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t[:400]}) + "\n" for t in training_corpus(12)))
    out = tmp_path / "draft"
    command = [
        sys.executable, "-m", "sglang_dart.train", "--target", str(tiny_llama_dir), "--data", str(data),
        "--out", str(out), "--max-steps", "1000000", "--max-len", "96", "--no-bf16", "--holdout", "0.2",
        "--draft-vocab-size", "300",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:  # the first logged step: training is under way
            seen.append(line)
            if line.startswith("step ") or time.monotonic() > deadline:
                break
        assert any(line.startswith("step ") for line in seen), "".join(seen[-20:])
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(seen) + rest
    assert proc.returncode == 0, output[-3000:]
    assert "stopped by a signal after" in output and "estimated tau" not in output
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert json.loads((out / "train_report.json").read_text())["steps"] >= 1
