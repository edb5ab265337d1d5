"""SGLang's own NGRAM speculative decoding runs on CPU through the tree-verify attention path, and its greedy
output equals the non-speculative greedy output token for token (the plain answers the SmolLM2 modules
share)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sglang_dart.server_process import SglangServer

pytestmark = pytest.mark.server

NEW_TOKENS = 32  # at most SMOLLM2_PLAIN_TOKENS (tests/conftest.py)


@pytest.fixture(scope="module")
def ngram_server(smollm2_f32_dir, server_logs) -> Iterator[SglangServer]:
    """Stopped with this module (a SmolLM2 server holds about 5.6 GB)."""
    args = ["--dtype", "float32", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"]
    server = SglangServer(smollm2_f32_dir, args, server_logs / "smollm2-ngram.log").start()
    yield server
    server.stop()


def test_ngram_greedy_equals_plain_greedy(ngram_server, smollm2_chat_prompts, smollm2_plain_answers):
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}
    speculative = ngram_server.generate_many(smollm2_chat_prompts, params, 4)  # batches of up to 4
    for i, (spec, ref) in enumerate(zip(speculative, smollm2_plain_answers, strict=True)):
        assert spec["output_ids"] == ref[:NEW_TOKENS], f"prompt {i}"

    # Verification must really accept drafted tokens, or the test would pass with speculation doing nothing.
    verify_steps = sum(out["meta_info"]["spec_verify_ct"] for out in speculative)
    emitted = sum(len(out["output_ids"]) for out in speculative)
    assert verify_steps > 0
    print(f"NGRAM: {emitted / verify_steps:.3f} tokens per verify step")
    assert emitted / verify_steps > 1.05, f"mean accepted length {emitted / verify_steps:.3f}"
    assert ngram_server.healthy()
