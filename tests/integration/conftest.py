"""Fixtures of the DART server tests. The plain tiny-Qwen3 server is one for the whole run (the DART
modules each compare with it; about 2 GB); the DART servers are one per test module, stopped when its last
test is done, so that no more than a few servers are up at a time (each holds 2-4 GB)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sglang_dart.server_process import SglangServer, serving
from tests.support.dart_serving import SEED
from tests.support.peer_training import (
    DFLASH_ANSWER_TOKENS,
    DFLASH_FLAGS,
    EAGLE3_ANSWER_TOKENS,
    EAGLE3_FLAGS,
    Trained,
    Training,
    train_side_by_side,
)


@pytest.fixture(scope="session")
def qwen3_plain(tiny_qwen3_dir, server_logs) -> Iterator[SglangServer]:
    """Also the plain server of test_dart_trees.py's logit-processor and penalty checks, so it takes custom
    logit processors and runs without overlap scheduling: with it, SGLang's penalizers count a request's
    tokens one step late (they read its output while the step producing the newest token is still in
    flight), so penalties would lag one token behind plain decoding's own definition, which DART follows.
    Neither changes what a request without a processor gets, and sharing it saves a server start."""
    args = ["--dtype", "float32", *SEED, "--enable-custom-logit-processor", "--disable-overlap-schedule"]
    server = SglangServer(tiny_qwen3_dir, args, server_logs / "qwen3-plain.log")
    with serving({"qwen3-plain": server}):
        yield server


@pytest.fixture(scope="session")
def peer_drafters(
    smollm2_f32_dir, smollm2_chat_prompts, smollm2_plain_answers, tmp_path_factory
) -> dict[str, Trained]:
    """The EAGLE3 and DFLASH drafters of test_eagle3_cpu.py and test_dflash_cpu.py, trained side by side
    (one core each) on the plain server's own greedy answers to the test prompts: the cheapest drafters that
    get accepted often, so the accept path (not only rejections) is exercised. Each module checks its own."""

    def rows(tokens: int) -> list[list[int]]:
        pairs = zip(smollm2_chat_prompts, smollm2_plain_answers, strict=True)
        return [prompt + answer[:tokens] for prompt, answer in pairs]

    trainings = [
        Training("eagle3", EAGLE3_FLAGS, rows(EAGLE3_ANSWER_TOKENS)),
        Training("dflash", DFLASH_FLAGS, rows(DFLASH_ANSWER_TOKENS)),
    ]
    return train_side_by_side(smollm2_f32_dir, trainings, tmp_path_factory.mktemp("peer-drafters"))
