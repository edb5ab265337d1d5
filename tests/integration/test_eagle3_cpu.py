"""SGLang's builtin EAGLE3 worker serves on a CPU-only machine through the plugin, with a drafter trained by
`python -m sglang_dart.train --format eagle3`: greedy output equals plain decoding token for token (float32
SmolLM2-135M, 50 prompts, eight requests in flight; one at a time too in the nightly run), and drafts really
get accepted.

The drafter is trained here, for 60 steps in float32, on the plain server's own answers to the test
prompts: the cheapest drafter that gets accepted often, so the accept path (not only rejections) is
exercised. A step count, not a time budget: CI stopped at one minute on an AVX2-only machine where bf16
autocast was emulated, after 9 steps, and its drafter fell under the acceptance floor (1.15 tokens per
verify step). In float32 that machine trains 75 steps a minute: 50 steps reach 0.71 / 0.62 / 0.53 top-1
by step, and 90 steps gave 3.39 tokens per verify step here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_dart.server_process import SglangServer, default_device_args

pytestmark = pytest.mark.server

NEW_TOKENS = 32
# EAGLE3 settings that run on the CPU engine: a chain (topk 1) of 3 drafted tokens, verified with the
# bonus token as a tree of 4. Wider trees (topk > 1) also build, but a chain costs least per step on CPU.
EAGLE3_ARGS = [
    "--speculative-algorithm",
    "EAGLE3",
    "--speculative-num-steps",
    "3",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "4",
]


@pytest.fixture(scope="module")
def prompts(smollm2_chat_prompts) -> list[list[int]]:
    return smollm2_chat_prompts


@pytest.fixture(scope="module")
def plain_answers(smollm2_plain_answers) -> list[list[int]]:
    return [answer[:NEW_TOKENS] for answer in smollm2_plain_answers]


@pytest.fixture(scope="module")
def eagle3_draft(smollm2_f32_dir, prompts, plain_answers, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eagle3")
    data = root / "answers.jsonl"
    data.write_text(
        "".join(json.dumps({"input_ids": p + a}) + "\n" for p, a in zip(prompts, plain_answers, strict=True))
    )
    out = root / "draft"
    command = [
        sys.executable,
        "-m",
        "sglang_dart.train",
        "--format",
        "eagle3",
        "--target",
        str(smollm2_f32_dir),
        "--data",
        str(data),
        "--out",
        str(out),
        "--target-dtype",
        "float32",
        "--draft-vocab-size",
        "2048",
        "--eagle3-ttt-steps",
        "3",
        "--eagle3-window",
        "96",
        "--lr",
        "3e-3",
        "--max-steps",
        "60",
        "--no-bf16",
        "--holdout",
        "0",
    ]
    # One torch thread: on a loaded 2-core machine two OpenMP threads ran the target 17x slower.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "top-1 by step" in done.stdout, done.stdout[-2000:]
    report = json.loads((out / "train_report.json").read_text())
    assert report["format"] == "eagle3" and report["steps"] == 60
    return out


@pytest.fixture(scope="module")
def eagle3_server(smollm2_f32_dir, eagle3_draft, server_logs) -> Iterator[SglangServer]:
    device = [a if a != "32768" else "16384" for a in default_device_args()]  # a smaller KV pool
    args = ["--dtype", "float32", *EAGLE3_ARGS, "--speculative-draft-model-path", str(eagle3_draft)]
    server = SglangServer(smollm2_f32_dir, args, server_logs / "smollm2-eagle3.log", device_args=device)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("concurrency", [pytest.param(1, marks=pytest.mark.slow), 8])
def test_eagle3_greedy_equals_plain(eagle3_server, prompts, plain_answers, concurrency):
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}
    outs = eagle3_server.generate_many(prompts, params, concurrency=concurrency)
    for i, (out, ref) in enumerate(zip(outs, plain_answers, strict=True)):
        assert out["output_ids"] == ref, f"prompt {i}: EAGLE3 departs from plain decoding"

    # Drafts must really be accepted, or the equality above would hold with speculation doing nothing.
    verify_steps = sum(out["meta_info"]["spec_verify_ct"] for out in outs)
    emitted = sum(out["meta_info"]["completion_tokens"] for out in outs)
    assert verify_steps > 0
    assert emitted / verify_steps > 1.2, f"{emitted / verify_steps:.2f} tokens per verify step"
    print(f"EAGLE3 concurrency {concurrency}: {emitted / verify_steps:.2f} tokens per verify step")
    assert eagle3_server.healthy()
