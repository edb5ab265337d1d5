"""SGLang's own NGRAM speculative decoding runs on CPU through the tree-verify attention path, and its greedy
output equals the non-speculative greedy output token for token."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_dart.server_process import SglangServer, serving
from tests.support.prompts import ALL_PROMPTS, chat_ids

pytestmark = pytest.mark.server

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def smollm2_servers(smollm2_f32_dir, server_logs) -> Iterator[dict[str, SglangServer]]:
    """A plain and an NGRAM server, started side by side and stopped with this module (a SmolLM2 server
    holds about 5.6 GB)."""
    plain = ["--dtype", "float32"]
    ngram = [*plain, "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"]
    servers = {
        "plain": SglangServer(smollm2_f32_dir, plain, server_logs / "smollm2-plain-vs-ngram.log"),
        "ngram": SglangServer(smollm2_f32_dir, ngram, server_logs / "smollm2-ngram.log"),
    }
    with serving(servers):
        yield servers


@pytest.fixture(scope="module")
def tokenizer(smollm2_f32_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_f32_dir)


def test_ngram_greedy_equals_plain_greedy(smollm2_servers, tokenizer):
    smollm2_server, smollm2_ngram_server = smollm2_servers["plain"], smollm2_servers["ngram"]
    prompts = [chat_ids(tokenizer, p) for p in ALL_PROMPTS]
    with ThreadPoolExecutor(max_workers=4) as pool:  # batches of up to 4 in the speculative server
        speculative = list(
            pool.map(
                lambda ids: smollm2_ngram_server.generate(
                    {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}}
                ),
                prompts,
            )
        )
        plain = list(pool.map(lambda ids: smollm2_server.greedy_ids(ids, NEW_TOKENS), prompts))
    for prompt, spec, ref in zip(ALL_PROMPTS, speculative, plain, strict=True):
        assert spec["output_ids"] == ref, f"{prompt!r}"

    # Verification must really accept drafted tokens, or the test would pass with speculation doing nothing.
    verify_steps = sum(out["meta_info"]["spec_verify_ct"] for out in speculative)
    emitted = sum(len(out["output_ids"]) for out in speculative)
    assert verify_steps > 0
    assert emitted / verify_steps > 1.05, f"mean accepted length {emitted / verify_steps:.3f}"
    assert smollm2_ngram_server.healthy()
