"""SGLang's builtin EAGLE3 worker serves on a CPU-only machine through the plugin, with a drafter trained by
`python -m sglang_dart.train --format eagle3`: greedy output equals plain decoding token for token (float32
SmolLM2-135M, 50 prompts, eight requests in flight; one at a time too in the nightly run), and drafts really
get accepted.

The drafter is trained here, beside the DFLASH module's (`peer_drafters`, tests/support/peer_training.py):
60 steps in float32 on the plain server's own answers to the test prompts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_dart.server_process import SglangServer, default_device_args
from tests.support.peer_training import EAGLE3_ANSWER_TOKENS

pytestmark = pytest.mark.server

NEW_TOKENS = EAGLE3_ANSWER_TOKENS
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
def eagle3_draft(peer_drafters) -> Path:
    trained = peer_drafters["eagle3"]
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "top-1 by step" in trained.stdout, trained.stdout[-2000:]
    report = json.loads((trained.out / "train_report.json").read_text())
    assert report["format"] == "eagle3" and report["steps"] == 60
    return trained.out


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
